"""Edge cases of the fused CPU Adam and of ``moetrain plan --calibrate``.

- The first moment follows torch's two-sided ``lerp_`` (``end - (end - start) * (1 - w)`` once the
  weight ``w = 1 - beta1`` is >= 0.5): ``exp_avg`` equals ``torch.optim.Adam(foreach=False)``'s bit
  for bit at any beta1, on every SIMD path (the ``simd_level`` fixture), vector tails included,
  through CPUAdam and through OffloadOptimizer (the same kernel).
- CPUAdam refuses non-finite hyper-parameters when built, and a step the kernel refuses leaves
  the step count as it was.
- ``--calibrate``: a number the calibration reads from metrics.jsonl that is not finite, out of its
  range or not a number gives one line naming metrics.jsonl:<line> and the key (exit 2); so do a
  config.json that is not a JSON object and a metrics.jsonl that is not UTF-8. ``--json`` output is
  strict JSON.
"""

import json
import math

import pytest
import torch

from moetrain.cli import main
from moetrain.offload import CPUAdam, OffloadOptimizer
from moetrain.planner.calibrate import read_run
from tests.unit.planner.test_planner_calibrate import write_run

BETAS = [(0.0, 0.999), (0.3, 0.999), (0.5, 0.999), (0.9, 0.999)]
SIZES = [7, 4096 + 37]  # scalar only; 16- and 8-lane vectors plus a scalar tail


def two_gradients(numel: int) -> list[torch.Tensor]:
    """A large gradient, then a small one: with beta1 = 0 the first moment must be exactly g."""
    generator = torch.Generator().manual_seed(numel)
    return [torch.randn(numel, generator=generator) * scale for scale in (100.0, 1e-3)]


def stepped(optimizer_class, param0: torch.Tensor, grads: list[torch.Tensor], **options):
    """``(optimizer, param)``: an ``optimizer_class`` over one parameter starting at ``param0``
    after one step per gradient of ``grads``."""
    param = torch.nn.Parameter(param0.clone())
    optimizer = optimizer_class([param], lr=1e-3, **options)
    for grad in grads:
        param.grad = grad.clone()
        optimizer.step()
    return optimizer, param


def torch_exp_avg(param0: torch.Tensor, grads: list[torch.Tensor], betas) -> torch.Tensor:
    optimizer, param = stepped(torch.optim.Adam, param0, grads, betas=betas, foreach=False)
    return optimizer.state[param]["exp_avg"]


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("betas", BETAS, ids=str)
def test_cpu_adam_exp_avg_equals_torch_bit_for_bit(simd_level, numel, betas):
    param0 = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    grads = two_gradients(numel)
    optimizer, param = stepped(CPUAdam, param0, grads, betas=betas, adamw_mode=False)
    assert torch.equal(optimizer.state[param]["exp_avg"], torch_exp_avg(param0, grads, betas))


@pytest.mark.parametrize("betas", BETAS, ids=str)
def test_offload_optimizer_exp_avg_equals_torch_bit_for_bit(simd_level, betas):
    numel = SIZES[-1]
    param0 = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    grads = two_gradients(numel)
    optimizer, _ = stepped(OffloadOptimizer, param0, grads, betas=betas, adamw_mode=False)
    exp_avg = optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(exp_avg.reshape(-1), torch_exp_avg(param0, grads, betas))


@pytest.mark.parametrize("key", ["lr", "eps", "weight_decay"])
@pytest.mark.parametrize("value", [math.inf, math.nan, True])
def test_cpu_adam_refuses_non_finite_hyperparameters(key, value):
    with pytest.raises(ValueError, match=f"CPUAdam: {key} must be a finite number >= 0"):
        CPUAdam([torch.nn.Parameter(torch.zeros(4))], **{key: value})


def test_cpu_adam_refused_step_keeps_the_step_count():
    param = torch.nn.Parameter(torch.zeros(4))
    optimizer = CPUAdam([param], lr=1e-3)
    param.grad = torch.ones(4)
    optimizer.step()
    optimizer.param_groups[0]["lr"] = math.inf  # a scheduler may set it after the checks
    with pytest.raises((ValueError, RuntimeError), match="lr must be finite"):
        optimizer.step()
    assert optimizer.state[param]["step"].item() == 1.0


# --calibrate ---------------------------------------------------------------------------------

KEYS = [
    "time/step_s",
    "tokens_per_s",
    "time/forward_s",
    "time/all_to_all_s",
    "memory/peak_allocated_bytes",
    "memory/peak_reserved_bytes",
    "memory/peak_backward_bytes",
]
BAD = [0, -1, math.nan, math.inf, True, "0.1", None]
GOOD = {"time/step_s": 0.1, "tokens_per_s": 1000.0}  # the divisors: 0 is out of range for these only
CASES = [(key, value) for key in KEYS for value in BAD if not (value == 0 and key not in GOOD)]


def calibrate_cli(run_dir, capsys, *extra: str) -> tuple[int, str, str]:
    code = main(
        [
            "plan",
            "--calibrate",
            str(run_dir),
            "--cluster",
            "a100-80gb",
            "--nodes",
            "1",
            "--gpus-per-node",
            "1",
            *extra,
        ]
    )
    out, err = capsys.readouterr()
    return code, out, err


def strict_json(text: str):
    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize(("key", "value"), CASES, ids=str)
def test_read_run_refuses_a_bad_number_naming_line_and_key(tmp_path, key, value):
    records = [{"step": 1, **GOOD}, {"step": 2, **GOOD}, {"step": 3, **GOOD, key: value}]
    write_run(tmp_path / "run", 1, records)
    with pytest.raises(ValueError) as error:
        read_run(tmp_path / "run")
    message = str(error.value)
    assert "\n" not in message
    assert f"metrics.jsonl:3: {key} must be a number in " in message


@pytest.mark.parametrize("value", [-0.1, 1.5, math.nan, math.inf, True, "x"], ids=repr)
def test_read_run_refuses_a_dropped_fraction_outside_0_1(tmp_path, value):
    records = [{"step": 1, **GOOD}, {"step": 2, **GOOD, "dropped_fraction": [0.5, value]}]
    write_run(tmp_path / "run", 1, records)
    with pytest.raises(
        ValueError, match=r"metrics\.jsonl:2: dropped_fraction\[1\] must be a number in \[0, 1\]"
    ):
        read_run(tmp_path / "run")


def test_zero_phase_times_and_peaks_calibrate_to_strict_json(tmp_path, capsys):
    zeros = {"time/forward_s": 0.05, "time/backward_s": 0.05, "time/all_to_all_s": 0.0}
    zeros |= {
        "memory/peak_allocated_bytes": 2**30,
        "memory/peak_optimizer_bytes": 0,
        "dropped_fraction": [0.0],
    }
    write_run(tmp_path / "run", 1, [{"step": 1, **GOOD, **zeros}, {"step": 2, **GOOD, **zeros}])
    code, out, err = calibrate_cli(tmp_path / "run", capsys, "--json")
    assert code == 0, err
    assert strict_json(out)["measured"]["step_s"] == 0.1


@pytest.mark.parametrize(
    ("key", "value"), [("time/step_s", math.nan), ("time/step_s", -1), ("tokens_per_s", math.inf)], ids=str
)
def test_calibrate_cli_bad_number_exits_2_with_one_line(tmp_path, capsys, key, value):
    record = {"step": 1, key: value}
    write_run(tmp_path / "run", 1, [record, {**record, "step": 2}])
    code, out, err = calibrate_cli(tmp_path / "run", capsys, "--json")
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and f"metrics.jsonl:1: {key}" in err


def test_calibrate_cli_overflowing_figures_exit_2(tmp_path, capsys):
    record = {"step": 1, "time/step_s": 1e-320}  # finite, but tokens / step overflows
    write_run(tmp_path / "run", 1, [record, {**record, "step": 2}])
    code, out, err = calibrate_cli(tmp_path / "run", capsys, "--json")
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and "tokens_per_s = inf (not finite)" in err


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("config.json", b"[1, 2]\n", "config.json must be a JSON object, got list"),
        ("config.json", b'{"model": \n', "config.json must be a JSON object: Expecting value"),
        ("config.json", b'\xff\xfe{"model": {}}\n', "config.json must be UTF-8 text"),
        ("metrics.jsonl", b'\xff\xfe{"step": 1}\n', "metrics.jsonl must be UTF-8 text"),
    ],
    ids=["list-config", "truncated-config", "binary-config", "binary-metrics"],
)
def test_calibrate_cli_unreadable_files_exit_2_naming_the_file(tmp_path, capsys, name, content, expected):
    write_run(tmp_path / "run", 1, [{"step": 1, **GOOD}])
    (tmp_path / "run" / name).write_bytes(content)
    code, out, err = calibrate_cli(tmp_path / "run", capsys)
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and expected in err, err
