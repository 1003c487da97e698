"""Bad command-line input to ``moetrain train``: one line on stderr naming the key, exit code 2,
nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest

from moetrain.cli import main
from moetrain.config import ParallelConfig
from moetrain.failures import EXIT_BAD_INPUT

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    ("sets", "asked"),
    [
        (["parallel.pp_virtual=2"], "parallel.pp_virtual = 2"),
        (["parallel.pp_schedule=interleaved_1f1b"], "parallel.pp_schedule = 'interleaved_1f1b'"),
        (
            ["parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual=2"],
            "parallel.pp_schedule = 'interleaved_1f1b' and pp_virtual = 2",
        ),
    ],
    ids=["virtual", "interleaved", "both"],
)
def test_pipeline_settings_without_pipeline_stages_are_refused_naming_pp_size(
    tmp_path, capsys, monkeypatch, sets, asked
):
    """With pp_size 1 there is no pipeline: these settings had been accepted and ignored."""
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    out_dir = tmp_path / "run"
    words = ["train", "--config", str(ROOT / "configs" / "tiny_lm.yaml"), "--set", f"out_dir={out_dir}"]
    assert main(words + [arg for s in sets for arg in ("--set", s)]) == EXIT_BAD_INPUT
    assert capsys.readouterr().err == (
        f"moetrain: error: {asked}: only used with pipeline stages, pp_size > 1 (got 1); without them "
        "leave pp_virtual = 1 and pp_schedule '1f1b' or 'gpipe'\n"
    )
    assert not out_dir.exists()
    ParallelConfig(pp_schedule="gpipe")  # a schedule that needs nothing more is left alone
    ParallelConfig(pp_size=2, pp_schedule="interleaved_1f1b", pp_virtual=2)
