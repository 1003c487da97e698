"""``moetrain launch`` (torchrun) ends a failed run with one line (issue 27): the line of the rank that
failed, with its log file, or the rank that was killed and what a survivor said about it; the exit
code is the rank's. torchrun's own traceback and failure summary (60-70 lines before) go to
``launcher.log`` in its log directory, named in that line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from moetrain.failures import EXIT_BAD_INPUT, EXIT_RUN_FAILED
from tests.faults.launch import INJECT, ROOT, tiny_config, write_config
from tests.helpers.dist_utils import free_port


def launch(
    tmp_path: Path, config: Path, *script: str, timeout: float, ranks: int = 2, sets: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "moetrain.cli", "launch", "--nproc-per-node", str(ranks),
        "--master-port", str(free_port()), "--log-dir", str(tmp_path / "launch-logs"),
        *script, "train", "--config", str(config), *(arg for s in sets for arg in ("--set", s)),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(150)
def test_a_failed_rank_under_the_launcher_ends_with_its_one_line(tmp_path):
    out_dir = tmp_path / "run"
    config = write_config(tmp_path, tiny_config(out_dir, **{"data.source": str(tmp_path / "missing.txt")}))
    result = launch(tmp_path, config, "-m", "moetrain.cli", timeout=120)
    err = result.stderr
    assert result.returncode == EXIT_BAD_INPUT, err  # the ranks' code (torchrun: 1)
    assert "Traceback" not in err and "ChildFailedError" not in err, err
    last = err.strip().splitlines()[-1]
    match = re.fullmatch(
        r"moetrain: error: rank (\d), model set-up: ValueError: data.source: cannot read .*missing.txt: "
        r"No such file or directory; full traceback in (\S+) \(launcher detail: (\S+)\)",
        last,
    )
    assert match, last
    rank, log, detail = match.groups()
    assert log == str(out_dir / "logs" / f"rank_{rank}.log") and Path(log).exists()
    assert detail == str(tmp_path / "launch-logs" / "launcher.log")
    assert "ChildFailedError" in Path(detail).read_text()  # torchrun's summary and traceback
    assert len([line for line in err.splitlines() if line.startswith("moetrain: error:")]) == 3  # 2 ranks + 1
    assert len(err.strip().splitlines()) < 15, err


@pytest.mark.timeout(150)
def test_a_killed_rank_under_the_launcher_is_named_in_the_last_line(tmp_path):
    out_dir = tmp_path / "run"
    config = write_config(tmp_path, tiny_config(out_dir, steps=100000, log_every=5, dist_timeout_s=12))
    result = launch(tmp_path, config, str(INJECT), "kill9-rank@1:30", timeout=120)
    err = result.stderr
    assert result.returncode == EXIT_RUN_FAILED, err
    assert "Traceback" not in err and "ChildFailedError" not in err, err
    last = err.strip().splitlines()[-1]
    assert re.match(
        r"moetrain: error: rank 1 \(pid \d+\) was killed by signal 9 \(SIGKILL\); rank 0 said: rank 0, ", last
    ), last
    assert "rank 1 stopped making progress at step 30" in last, last


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.timeout(150)
def test_a_bad_config_under_the_launcher_ends_with_the_ranks_line_and_exit_2(tmp_path, ranks):
    """A bad --set value fails every rank before the run starts: the launch ends like one process,
    exit 2 and the error line (not a rank killed by the launcher's SIGTERM, nor exit code 1)."""
    config = write_config(tmp_path, tiny_config(tmp_path / "run"))
    result = launch(tmp_path, config, "-m", "moetrain.cli", timeout=120, ranks=ranks, sets=("steps=-1",))
    err = result.stderr
    assert result.returncode == EXIT_BAD_INPUT, err
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(
        r"moetrain: error: steps must be an integer >= 1, got -1 \(launcher detail: \S+launcher.log\)", last
    ), last
    assert "Traceback" not in err and "signal" not in err, err
