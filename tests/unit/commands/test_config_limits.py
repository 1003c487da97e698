"""Config input at and past its limits, through ``moetrain train`` as users run it (in-process, one
rank): a YAML alias inside its own anchor, nesting thousands deep, an alias bomb, huge values in an
error line, numbers past what the run can use, keys that other keys make meaningless and a
``--strategy`` file without a strategy. Each is exit 2 and one error line naming the key, before
the run writes anything (the model builder's checks, after its log file only); and
``num_apply_groups`` far above the parameter count costs no memory."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest
import torch

from moetrain.config.files import MAX_CONFIG_VALUES, build_train_config
from moetrain.config.train import SEED_MAX
from moetrain.failures import EXIT_BAD_INPUT
from moetrain.offload import GroupwiseApply
from moetrain.offload.apply_groups import plan_apply_groups
from tests.faults.launch import tiny_config
from tests.faults.test_run_directory import one_error as the_error_line
from tests.faults.test_run_directory import train_file as train
from tests.helpers.paths import ROOT

TOO_DEEP = "nested too deeply or refers to itself (an alias inside its own anchor)"


@pytest.fixture(autouse=True)
def _no_launcher_error_file(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)


def one_error(capsys) -> str:
    """The one error line on stderr, without its ``moetrain: error: `` prefix."""
    return the_error_line(capsys).removeprefix("moetrain: error: ")


def json_config(tmp_path: Path, **overrides) -> tuple[Path, Path]:
    """The tiny LM config (``tests.faults.launch.tiny_config``) as a JSON file; returns it and its
    ``out_dir``."""
    out_dir = tmp_path / "run"
    path = tmp_path / "run.json"
    path.write_text(json.dumps(tiny_config(out_dir, **overrides)))
    return path, out_dir


def yaml_config(tmp_path: Path, text: str) -> tuple[Path, Path]:
    """The tiny LM config as a YAML file (one line per top-level key) after the lines ``text``;
    returns it and its ``out_dir``."""
    out_dir = tmp_path / "run"
    path = tmp_path / "run.yaml"
    lines = [f"{key}: {json.dumps(value)}" for key, value in tiny_config(out_dir).items()]
    path.write_text("\n".join([text, *lines]) + "\n")
    return path, out_dir


# -- 1. a recursive alias, deep nesting --------------------------------------------------------------


def test_an_alias_inside_its_own_anchor_is_one_line_naming_the_key(tmp_path, capsys):
    config, out_dir = yaml_config(tmp_path, "imports: &a [*a]")
    assert train(config) == EXIT_BAD_INPUT
    assert one_error(capsys) == f"config {config}: imports: {TOO_DEEP}"
    assert not out_dir.exists()


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_nesting_thousands_deep_is_one_line(tmp_path, capsys, suffix):
    config = tmp_path / f"deep{suffix}"
    config.write_text('{"imports": ' + "[" * 3000 + "]" * 3000 + "}")
    assert train(config) == EXIT_BAD_INPUT
    assert one_error(capsys) == f"config {config}: {TOO_DEEP}"


@pytest.mark.parametrize("value", ["&a [*a]", "[" * 3000 + "]" * 3000], ids=["alias", "deep"])
def test_a_set_value_nested_too_deep_is_one_line_naming_the_key(tmp_path, capsys, value):
    config, _ = json_config(tmp_path)
    assert train(config, "--set", f"imports={value}") == EXIT_BAD_INPUT
    assert one_error(capsys) == f"--set imports: {TOO_DEEP}"


# -- 2. alias bombs and huge values in error lines -----------------------------------------------------


def alias_bomb(levels: int, key: str) -> str:
    """YAML whose ``key`` holds ``10**levels`` strings written out, in ~60 bytes per level."""
    lines = ["x0: &x0 [aaaaaaaaaa]"]
    lines += [f"x{i}: &x{i} [{', '.join([f'*x{i - 1}'] * 10)}]" for i in range(1, levels + 1)]
    return "\n".join([*lines, f"{key}: *x{levels}"])


def test_an_alias_bomb_is_refused_before_it_expands(tmp_path, capsys):
    config = tmp_path / "bomb.yaml"
    config.write_text(alias_bomb(5, "imports"))  # 329 bytes; 10**5 strings (1.6 MB of error line before)
    assert train(config) == EXIT_BAD_INPUT
    assert one_error(capsys) == (
        f"config {config}: x5: the config holds more than {MAX_CONFIG_VALUES} values (each use of a YAML "
        "alias counts its anchor's values again)"
    )


def test_a_huge_value_makes_a_short_error_line(tmp_path, capsys):
    bomb = tmp_path / "bomb.yaml"  # 10**4 strings: under the limit, each in `got [...]`
    bomb.write_text(alias_bomb(4, "imports").replace("x0:", "model: {name: moe_lm}\nx0:"))
    long_string, _ = json_config(tmp_path, precision="p" * 10**6)
    for config in (bomb, long_string):
        assert train(config) == EXIT_BAD_INPUT
        line = one_error(capsys)
        assert len(line) < 1000, line[:2000]
        assert line.startswith(("imports must be a list of module names, got [[", "precision must be one of"))


# -- 3. num_apply_groups far above the parameter count -----------------------------------------------


def test_groupwise_apply_with_far_more_groups_than_parameters_allocates_nothing_per_group():
    model = torch.nn.Linear(4, 4)  # 2 parameters
    model(torch.randn(2, 4)).sum().backward()
    optimizer = GroupwiseApply(torch.optim.AdamW(model.parameters(), foreach=False), 10**6)
    assert optimizer.apply_groups() == [[model.weight], [model.bias]]
    tracemalloc.start()
    try:
        optimizer.step()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20, f"{peak} bytes of Python objects for 2 parameters"  # was 61 MiB: a list per group
    assert all(optimizer.state[p]["step"] == 1 for p in model.parameters())


def test_plan_apply_groups_with_far_more_groups_than_elements():
    tracemalloc.start()
    try:
        groups = plan_apply_groups([3, 2], num_apply_groups=10**6)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert groups == plan_apply_groups([3, 2], num_apply_groups=5)
    assert groups == [[(0, 0, 1)], [(0, 1, 2)], [(0, 2, 3)], [(1, 0, 1)], [(1, 1, 2)]]
    assert peak < 2**20, f"{peak} bytes to plan 5 elements"  # was ~40 MiB: a bound per group
    assert plan_apply_groups([0, 0], num_apply_groups=10**30) == []


# -- 4. to 10. values refused at start-up, naming their key -------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"optim.eps": 0}, "optim.eps must be a finite number > 0, got 0"),
        ({"seed": SEED_MAX + 1}, f"seed must be an integer in [0, {SEED_MAX}], got {SEED_MAX + 1}"),
        ({"threads": 2**31}, f"threads must be an integer in [1, 4096], got {2**31}"),
        (
            {"dist_timeout_s": 1e15},
            f"dist_timeout_s must be a number in [1, 31536000] (seconds, a year at most), got {1e15!r}",
        ),
        (
            {"recompute_budget_mb": 1e303},
            f"recompute_budget_mb must be a number in [0, {2**40}] (MiB) or None, got {1e303!r}",
        ),
        (
            {"resume": False, "resume_from": 5},
            "resume_from = 5 needs resume: true (resume: false starts from scratch)",
        ),
        (
            {"resume": False, "resume_from": "latest-valid"},
            "resume_from = 'latest-valid' needs resume: true (resume: false starts from scratch)",
        ),
        (
            {"balance.memory_limits": [1]},
            "balance.memory_limits needs balance.speeds or balance.calibrate: true (without either, "
            "balancing is off and the limits would be ignored)",
        ),
    ],
    ids=[
        "eps",
        "seed",
        "threads",
        "dist-timeout",
        "recompute-budget",
        "resume-from",
        "resume-latest-valid",
        "memory-limits",
    ],
)
def test_a_value_the_run_cannot_use_is_one_line_naming_its_key(tmp_path, capsys, overrides, expected):
    config, out_dir = json_config(tmp_path, **overrides)
    assert train(config) == EXIT_BAD_INPUT
    assert one_error(capsys) == expected
    assert not out_dir.exists()


def test_resume_from_on_the_command_line_needs_resume(tmp_path, capsys):
    config, out_dir = json_config(tmp_path, resume=False)
    assert train(config, "--resume-from", "3") == EXIT_BAD_INPUT
    assert one_error(capsys).startswith("resume_from = 3 needs resume: true")
    assert not out_dir.exists()


def test_seed_max_keeps_every_seed_formula_a_generator_seed():
    """The largest seed, rank and step a run may reach seed the data streams of both models."""
    from moe_lm import TextBatches

    corpus = torch.arange(64, dtype=torch.uint8)
    batches = TextBatches(corpus, 2, 8, SEED_MAX * 31 + 11 + 4096, 0)  # the engine's probe stream
    batches.reseed(SEED_MAX, 10**6 - 1, 10**15)  # a rank of a million, a quadrillion steps
    batches.next()
    torch.manual_seed(SEED_MAX)  # the weights


def test_a_date_like_seed_trains(tmp_path, capsys):
    config, _ = json_config(tmp_path, seed=20240101, steps=1)
    assert train(config) == 0, capsys.readouterr().err


def test_out_dir_with_a_nul_byte_is_one_line_naming_out_dir(tmp_path, capsys):
    config, _ = json_config(tmp_path)
    assert train(config, "--set", f'out_dir="{tmp_path}/a\\0b"') == EXIT_BAD_INPUT
    assert (
        one_error(capsys) == f"out_dir must be a directory path (without NUL bytes), got '{tmp_path}/a\\x00b'"
    )


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"model.vocab_size": 100}, "model.vocab_size must be >= 256 (the byte corpus' ids 0-255), got 100"),
        ({"data.seq_len": 17}, "data.seq_len = 17 exceeds model.max_seq_len = 16"),
    ],
    ids=["vocab_size", "seq_len"],
)
def test_a_config_the_model_cannot_take_is_refused_before_the_run_writes(
    tmp_path, capsys, overrides, expected
):
    """The model's check hook runs before the run takes out_dir (it ran in the builder, after the run
    had started its log file there)."""
    config, out_dir = json_config(tmp_path, **overrides)
    assert train(config) == EXIT_BAD_INPUT
    assert one_error(capsys) == expected
    assert not out_dir.exists()


def test_a_registered_check_hook_must_be_callable():
    from moetrain.registry import register_model

    with pytest.raises(ValueError, match="^check hook of model 'x' must be callable, got 3$"):
        register_model("x", dict, lambda config, shard: None, check=3)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "strategy: null",
            "strategy must be a non-empty mapping of module-name patterns to one of 'replica', 'expert', "
            "'split', 'split.row', 'split.head', 'pipeline', got None",
        ),
        (
            "strategy: {'*': replica}\nparallel: 0",
            "'parallel' may hold ep_size, tp_size, ep_layout, replica, got 0",
        ),
        (
            "strategy: {'*': replica}\nparallel: []",
            "'parallel' may hold ep_size, tp_size, ep_layout, replica, got []",
        ),
    ],
    ids=["null-strategy", "parallel-0", "parallel-list"],
)
def test_a_strategy_file_without_a_strategy_or_sizes_is_refused(tmp_path, capsys, text, expected):
    config, out_dir = json_config(tmp_path)
    strategy = tmp_path / "plan.yaml"
    strategy.write_text(text)
    assert train(config, "--strategy", str(strategy)) == EXIT_BAD_INPUT
    assert one_error(capsys) == f"strategy file {strategy}: {expected}"
    assert not out_dir.exists()


def test_a_strategy_file_with_null_parallel_keeps_the_configs_sizes(tmp_path):
    strategy = tmp_path / "plan.yaml"
    strategy.write_text("strategy: {'*': replica}\nparallel: null")
    config = build_train_config(str(ROOT / "configs" / "tiny_lm.yaml"), [], str(strategy))
    assert config.parallel.strategy == {"*": "replica"}


def test_m6_image_channels_true_is_refused():
    with pytest.raises(ValueError) as error:
        build_train_config(str(ROOT / "models" / "m6_moe" / "tiny.yaml"), ["model.image_channels=true"])
    assert str(error.value) == "model.image_channels must be one of 1, 3, got True"
