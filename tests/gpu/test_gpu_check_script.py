"""scripts/gpu_check.sh runs only where a GPU is, so what a CPU machine can check of it is checked
here: the script parses, refuses a machine without a GPU with one line, every `moetrain train`
smoke's config and overrides validate, and every benchmark it calls accepts its flags (and runs,
shrunk, on the CPU)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys

import pytest

from moetrain.cli import build_train_config
from tests.helpers.paths import ROOT

SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _logical_lines() -> list[str]:
    return SCRIPT.read_text().replace("\\\n", " ").splitlines()


def test_the_script_parses_and_refuses_a_machine_without_a_gpu(tmp_path):
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: run the script itself")
    done = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "out")],
        capture_output=True, text=True, timeout=120, env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 2
    expected = f"gpu_check: {sys.executable} has no torch with a usable CUDA GPU; nothing to check"
    assert done.stderr.strip() == expected


def test_every_test_the_script_names_is_collected():
    """The tests step's files and test ids exist (pytest would end the step at once otherwise)."""
    line = next(line for line in _logical_lines() if line.startswith("run_step tests "))
    named = [word for word in shlex.split(line) if word.startswith("tests/")]
    assert len(named) >= 4, line
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *named],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    collected = [row for row in done.stdout.splitlines() if "::" in row]
    for name in named:
        assert any(row == name or row.startswith(f"{name}::") for row in collected), name


SMOKES = [line.split()[1:] for line in _logical_lines() if line.startswith("smoke ")]


def _smoke_overrides() -> list[str]:
    """What the script's smoke function adds to every smoke's overrides."""
    lines = _logical_lines()
    start = next(i for i, line in enumerate(lines) if line.startswith("smoke() {"))
    words = shlex.split(lines[start + 1])
    assert words[:2] == ["train_command", "$@"], lines[start + 1]
    return words[2:]


def test_the_script_has_the_five_training_smokes():
    assert [smoke[0] for smoke in SMOKES] == [
        "train_lm",
        "train_lm_local",
        "train_m6_bf16",
        "train_m6_fp16",
        "train_m6_offload",
    ]


@pytest.mark.parametrize("smoke", SMOKES, ids=lambda smoke: smoke[0])
def test_every_training_smoke_is_a_valid_config(smoke, tmp_path):
    name, config, *overrides = smoke
    overrides = ["device=cuda", f"out_dir={tmp_path}", *overrides, *_smoke_overrides()]
    config = build_train_config(str(ROOT / config), overrides)
    assert config.device == "cuda" and config.threads == 2  # the smokes run side by side


BENCHMARKS = {
    m.group(1): shlex.split(m.group(2))
    for m in (re.match(r'run_step (bench_\w+) "\$python" (.*)', line) for line in _logical_lines())
    if m
}
# The same flags, shrunk to seconds on the CPU: what changes is only the device and the size.
FEW = ["--repeats", "2", "--warmup", "1"]
CPU_FLAGS = {
    "bench_layer_e8": ["--tokens", "256", "--d-model", "64", "--d-ff", "128", *FEW],
    "bench_layer_e64": ["--tokens", "256", "--d-model", "64", "--d-ff", "32", *FEW],
    "bench_compile": None,  # compiles two modules for minutes on a CPU: flags checked with --help only
    "bench_offload": ["--params", "80000", *FEW],
}


def test_the_script_runs_the_four_benchmarks():
    assert sorted(BENCHMARKS) == sorted(CPU_FLAGS)


@pytest.mark.parametrize("name", sorted(CPU_FLAGS))
def test_every_benchmark_accepts_the_scripts_flags_and_runs_on_the_cpu(name, tmp_path):
    script, *flags = BENCHMARKS[name]
    cpu = [("cpu" if flag == "cuda" else flag) for flag in flags]
    cpu = [str(tmp_path / "out.json") if "$out" in flag else flag for flag in cpu]
    if CPU_FLAGS[name] is None:
        done = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        for flag in flags:
            if flag.startswith("--"):
                assert flag in done.stdout, flag
        return
    done = subprocess.run(
        [sys.executable, script, *cpu, *CPU_FLAGS[name]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "out.json").read_text())


@pytest.mark.parametrize("capacity", [None, 3])
def test_the_benchmarks_reference_moes_compute_the_same_layer(capacity):
    """The plain and the torchtitan-style MoE of benchmarks/moe_layer.py are references the layer
    is timed against: they must compute the same function (fp64, a capacity that drops slots)."""
    moe_layer = _import_moe_layer_benchmark()
    torch = pytest.importorskip("torch")
    generator = torch.Generator().manual_seed(0)
    x, router, w1, w2 = (
        torch.randn(*shape, dtype=torch.float64, generator=generator)
        for shape in ((20, 8), (4, 8), (4, 8, 12), (4, 12, 8))
    )
    plain = moe_layer.plain_pytorch_moe(x, router, w1, w2, 2, capacity)
    titan = moe_layer.titan_style_moe(x, router, w1, w2, 2, capacity)
    torch.testing.assert_close(titan, plain, rtol=1e-12, atol=1e-12)
    if capacity is not None:
        assert not torch.allclose(plain, moe_layer.plain_pytorch_moe(x, router, w1, w2, 2, None))


def _import_moe_layer_benchmark():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import moe_layer
    finally:
        sys.path.pop(0)
    return moe_layer


def test_the_layer_benchmarks_host_synchronization_census_names_each_place(monkeypatch):
    """What ``host_synchronizations`` reports on a GPU, with the CUDA calls it makes stood in for:
    one ``file:line`` per "called a synchronizing CUDA operation" warning the call raised, none for
    other warnings, and the sync debug mode set to "warn" around the call only."""
    import warnings

    torch = pytest.importorskip("torch")
    moe_layer = _import_moe_layer_benchmark()
    modes = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def call():
        assert modes == ["warn"]
        warnings.warn("called a synchronizing CUDA operation", stacklevel=1)
        warnings.warn("something else", stacklevel=1)
        warnings.warn("called a synchronizing CUDA operation", stacklevel=1)

    places = moe_layer.host_synchronizations(call)
    assert modes == ["warn", "default"]
    line = call.__code__.co_firstlineno
    assert places == [f"test_gpu_check_script.py:{line + 2}", f"test_gpu_check_script.py:{line + 4}"]
    assert moe_layer.host_synchronizations(lambda: None) == []


def _calibration_overrides() -> dict[str, list[str]]:
    """The calibration runs' overrides: the calibrate function's training overrides plus each call's."""
    lines = _logical_lines()
    train = 'moetrain_train "$name" configs/tiny_lm.yaml'
    body = next(line for line in lines if line.strip().startswith(train))
    common = [word for word in shlex.split(body)[3:] if word != "$@"]
    calls = [shlex.split(line)[1:] for line in lines if line.startswith("calibrate ")]
    return {name: common + extra for name, *extra in calls}


def test_the_calibration_runs_are_valid_configs_with_and_without_recompute(tmp_path):
    runs = _calibration_overrides()
    assert sorted(runs) == ["calibrate_full", "calibrate_none"]
    base = ["device=cuda", f"out_dir={tmp_path}"]
    config = str(ROOT / "configs/tiny_lm.yaml")
    configs = {name: build_train_config(config, [*base, *o]) for name, o in runs.items()}
    assert configs["calibrate_none"].recompute_budget_mb is None
    assert configs["calibrate_full"].recompute_budget_mb == 0
    assert configs["calibrate_none"].model.d_model == 1024 and configs["calibrate_none"].precision == "bf16"
    for config in configs.values():  # dropless: the plan's rows whatever the router does; no checkpoint
        assert config.model.moe.capacity_factor in (0, None) and not config.checkpoint_at_end
