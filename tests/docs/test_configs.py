"""Every shipped config file is a valid TrainConfig whose parallel layout fits its model."""

import pytest

from moetrain.cli import build_train_config
from moetrain.engine import check_fits
from tests.helpers.paths import ROOT

CONFIGS = sorted([*ROOT.glob("configs/*.yaml"), *ROOT.glob("models/m6_moe/*.yaml")])


def test_configs_are_found():
    names = {p.name for p in CONFIGS}
    assert {"tiny_lm.yaml", "m6_1t.yaml", "tiny.yaml", "demo.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_is_valid(path):
    config = build_train_config(str(path), [])
    check_fits(config, config.parallel.ep_size)


@pytest.mark.parametrize(
    "override,message",
    [
        ("model.tasks.skip_bad_records=maybe", "model.tasks.skip_bad_records must be True or False"),
        ("model.moe.top_k=9", "model.moe.top_k must satisfy"),
        ("balance.memory_limits=[4, 0]", "balance.memory_limits[1] must be an integer >= 1, got 0"),
        ("model.moe_every=5", "model.moe_every = 5 exceeds num_layers = 4"),
        ("param_dtype=bf16", "param_dtype = 'bf16' needs precision = 'bf16'"),
        (("precision=fp16", "param_dtype=fp16"), "param_dtype = 'fp16' keeps the model's weights in fp16"),
    ],
)
def test_errors_name_the_full_key_once(override, message):
    with pytest.raises(ValueError) as error:
        overrides = [override] if isinstance(override, str) else list(override)
        build_train_config(str(ROOT / "models/m6_moe/tiny.yaml"), overrides)
    assert str(error.value).startswith(message), str(error.value)
