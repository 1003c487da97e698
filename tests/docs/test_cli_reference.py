"""`moetrain train --help` lists every config key with its type, default and meaning, generated from
the config dataclasses (so the list cannot drift from what is validated); `moetrain --version`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from moetrain import __version__
from moetrain.config import TrainConfig
from moetrain.config_reference import config_keys
from moetrain.registry import registered_models


def test_every_config_key_has_a_meaning():
    rows = config_keys(TrainConfig)
    for name in ("moe_lm", "m6_moe"):  # ours; models other tests register need not document theirs
        rows += config_keys(registered_models()[name].config_class, "model.")
    missing = [key for key, _, _, meaning in rows if not meaning]
    assert not missing, f"config fields without option(help=...): {missing}"
    keys = {key for key, *_ in rows}
    assert {"optim.lr", "parallel.ep_size", "model.moe.top_k", "model.tasks.max_image_pixels"} <= keys


def test_train_help_lists_the_keys_and_version_prints(capsys):
    from moetrain.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for line in ("optim.lr", "float, default 0.003", "peak learning rate", "checkpoint_every_minutes",
                 "model.* of model.name = m6_moe", "model.* of model.name = moe_lm"):  # fmt: skip
        assert line in out, line
    result = subprocess.run(
        [sys.executable, "-m", "moetrain.cli", "--version"], capture_output=True, text=True
    )
    assert result.stdout.strip() == f"moetrain {__version__}"
