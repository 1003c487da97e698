"""Every shipped config file is a valid TrainConfig whose parallel layout fits its model."""

from pathlib import Path

import pytest

from moetrain.cli import build_train_config
from moetrain.engine import check_fits

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted([*ROOT.glob("configs/*.yaml"), *ROOT.glob("models/m6_moe/*.yaml")])


def test_configs_are_found():
    names = {p.name for p in CONFIGS}
    assert {"tiny_lm.yaml", "m6_1t.yaml", "tiny.yaml", "demo.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_is_valid(path):
    config = build_train_config(str(path), [])
    check_fits(config, config.parallel.ep_size)
