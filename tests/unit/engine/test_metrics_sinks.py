"""Metrics sinks (issue 30): ``metrics.sinks`` picks where the metrics of logging steps go; the
Weights & Biases and MLflow sinks are tested against fakes of their client modules (no network),
put in ``sys.modules`` where ``import wandb`` / ``import mlflow`` find them."""

from __future__ import annotations

import json
import math
import sys
import tracemalloc
import types
from types import SimpleNamespace
from typing import ClassVar

import pytest

from moetrain.metrics import drop_records_after, finite_or_null, replace_text, scalars
from tests.faults.test_run_directory import one_error, train


class FakeWandb(types.ModuleType):
    def __init__(self):
        super().__init__("wandb")
        self.calls = []
        self.util = SimpleNamespace(generate_id=lambda: "wb-run-1")

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        self.run = SimpleNamespace(summary={})
        return self.run

    def log(self, data, step=None):
        self.calls.append(("log", step, data))

    def finish(self):
        self.calls.append(("finish",))


class FakeMlflow(types.ModuleType):
    def __init__(self):
        super().__init__("mlflow")
        self.calls = []

    def set_experiment(self, name):
        self.calls.append(("set_experiment", name))

    def start_run(self, run_id=None, run_name=None):
        self.calls.append(("start_run", run_id, run_name))
        return SimpleNamespace(info=SimpleNamespace(run_id=run_id or "ml-run-1"))

    def log_params(self, params):
        self.calls.append(("log_params", params))

    def log_metrics(self, metrics, step=None):
        self.calls.append(("log_metrics", step, metrics))

    def end_run(self):
        self.calls.append(("end_run",))


@pytest.fixture
def trackers(monkeypatch):
    wandb, mlflow = FakeWandb(), FakeMlflow()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setitem(sys.modules, "mlflow", mlflow)
    return wandb, mlflow


def test_the_chosen_sinks_get_every_logging_step_the_summary_and_the_end(tmp_path, trackers):
    wandb, mlflow = trackers
    out_dir = tmp_path / "run"
    sinks = {"metrics.sinks": ["jsonl", "wandb", "mlflow"]}
    assert train(tmp_path, out_dir, steps=3, **sinks) == 0
    (kind, init), *logs, (end,) = wandb.calls
    assert (
        kind == "init" and init["project"] == "run" and init["id"] == "wb-run-1" and init["resume"] == "allow"
    )
    assert init["config"]["steps"] == 3 and init["dir"] == str(out_dir)
    assert [step for _, step, _ in logs] == [1, 2, 3] and end == "finish"
    names = set(logs[0][2])
    assert {"loss", "aux_loss", "lr", "grad_norm", "tokens_per_s", "skipped_steps"} <= names
    assert {"expert_load_cv/layer0", "dropped_fraction/layer0"} <= names
    assert wandb.run.summary["last_step"] == 3.0 and wandb.run.summary["preempted"] == 0.0
    assert mlflow.calls[0] == ("set_experiment", "run") and mlflow.calls[1] == ("start_run", None, "run")
    assert mlflow.calls[2][0] == "log_params" and mlflow.calls[2][1]["optim.lr"] == "0.003"
    assert [call[1] for call in mlflow.calls if call[0] == "log_metrics"] == [1, 2, 3, None]  # None: summary
    assert mlflow.calls[-1] == ("end_run",)
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
    assert json.loads((out_dir / "summary.json").read_text())["last_step"] == 3
    # a resumed run continues the same tracker runs, without logging the params again
    wandb.calls.clear(), mlflow.calls.clear()
    assert train(tmp_path, out_dir, steps=4, **sinks) == 0
    assert wandb.calls[0][1]["id"] == "wb-run-1" and [c[1] for c in wandb.calls if c[0] == "log"] == [4]
    assert ("start_run", "ml-run-1", "run") in mlflow.calls and not any(
        c[0] == "log_params" for c in mlflow.calls
    )


def test_only_the_chosen_sinks_write(tmp_path, trackers):
    wandb, _ = trackers
    out_dir = tmp_path / "run"
    assert train(tmp_path, out_dir, steps=2, **{"metrics.sinks": ["wandb"], "metrics.project": "p"}) == 0
    assert wandb.calls[0][1]["project"] == "p"
    assert not (out_dir / "metrics.jsonl").exists() and not (out_dir / "tensorboard").exists()


def test_a_tracker_that_is_not_installed_is_one_line_before_training(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow raises ImportError
    out_dir = tmp_path / "run"
    assert train(tmp_path, out_dir, steps=2, **{"metrics.sinks": ["jsonl", "mlflow"]}) == 2
    line = one_error(capsys)
    assert (
        "metrics.sinks: 'mlflow' needs the mlflow package, which is not installed (pip install mlflow" in line
    )
    assert not (out_dir / "checkpoints").exists() and not (out_dir / ".lock").exists()


def test_an_unknown_sink_is_a_config_error(tmp_path, capsys):
    assert train(tmp_path, tmp_path / "run", **{"metrics.sinks": ["jsonl", "neptune"]}) == 2
    assert (
        "metrics.sinks must be one of 'jsonl', 'tensorboard', 'wandb', 'mlflow', got 'neptune'"
        in one_error(capsys)
    )


class FakeSummaryWriter:
    """``torch.utils.tensorboard.SummaryWriter`` as the sink uses it (the package is optional and
    not installed by ``make test``; ``tests/unit/engine/test_engine.py`` reads real events where it is)."""

    writers: ClassVar[list] = []

    def __init__(self, log_dir, purge_step=None):
        self.log_dir, self.purge_step, self.scalars, self.closed = log_dir, purge_step, [], False
        FakeSummaryWriter.writers.append(self)

    def add_scalar(self, name, value, step):
        self.scalars.append((name, value, step))

    def close(self):
        self.closed = True


def test_tensorboard_gets_every_logging_step_and_a_resumed_run_purges_the_steps_redone(tmp_path, monkeypatch):
    module = types.ModuleType("torch.utils.tensorboard")
    module.SummaryWriter = FakeSummaryWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", module)
    monkeypatch.setattr(FakeSummaryWriter, "writers", [])
    out_dir = tmp_path / "run"
    sinks = {"metrics.sinks": ["tensorboard"], "checkpoint_every": 2}
    assert train(tmp_path, out_dir, steps=3, **sinks) == 0
    assert train(tmp_path, out_dir, steps=5, **sinks) == 0  # resumes at step 3 (the end's checkpoint)
    first, resumed = FakeSummaryWriter.writers
    assert first.log_dir == resumed.log_dir == str(out_dir / "tensorboard")
    assert (first.purge_step, resumed.purge_step) == (1, 4) and first.closed and resumed.closed
    logged = [(name, step) for name, _, step in first.scalars if not name.startswith("summary/")]
    assert sorted({step for _, step in logged}) == [1, 2, 3]
    assert {"loss", "lr", "grad_norm", "expert_load_cv/layer0"} <= {
        name for name, step in logged if step == 1
    }
    summary = {name: (value, step) for name, value, step in first.scalars if name.startswith("summary/")}
    assert summary["summary/last_step"] == (3.0, 3)
    assert sorted({step for name, _, step in resumed.scalars if name == "loss"}) == [4, 5]


def test_tensorboard_without_its_package_writes_nothing_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # the import raises ImportError
    out_dir = tmp_path / "run"
    assert train(tmp_path, out_dir, steps=2, **{"metrics.sinks": ["jsonl", "tensorboard"]}) == 0
    assert "tensorboard is not installed: no TensorBoard events (metrics.sinks)" in capsys.readouterr().err
    assert not (out_dir / "tensorboard").exists() and (out_dir / "metrics.jsonl").exists()


def test_scalars_flattens_per_layer_lists_and_json_gets_null_for_non_finite_values():
    metrics = {"step": 3, "loss": 2.5, "skipped": True, "expert_load_cv": [0.1, 0.2]}
    assert scalars(metrics) == {
        "loss": 2.5,
        "skipped": 1.0,
        "expert_load_cv/layer0": 0.1,
        "expert_load_cv/layer1": 0.2,
    }
    assert finite_or_null({"a": float("inf"), "b": [1.0, float("nan")]}) == {"a": None, "b": [1.0, None]}


def old_drop_records_after(path, step):
    """drop_records_after as it was (the whole file read into memory): the reference."""

    def record_step(line):
        try:
            return json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            return math.inf

    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    kept = [line for line in lines if record_step(line) <= step]
    if len(kept) < len(lines):
        replace_text(path, "".join(line + "\n" for line in kept))


def records(*steps):
    return "".join(json.dumps({"step": s, "loss": 1.5}) + "\n" for s in steps).encode()


@pytest.mark.parametrize(
    "content, step",
    [
        (records(1, 2, 3, 4), 2),  # a tail to drop: truncated
        (records(1, 2, 3) + b'{"step": 4, "lo', 3),  # a torn last line
        (records(1, 2, 3) + b'{"step": 4, "lo', 9),
        (records(1, 2, 3), 3),  # nothing to drop
        (records(1, 2, 3)[:-1], 5),  # no newline at the end, nothing to drop
        (b"", 0),
        (records(1) + b"garbage\n" + records(2, 3), 2),  # an unreadable line before kept ones
        (records(1, 2, 9, 3), 5),  # steps out of order
        (records(1) + b"\n\n" + records(2), 5),  # blank lines
        (records(1) + b'[1]\n{"loss": 2}\n"x"\n' + records(2), 5),
        (records(1).replace(b"\n", b"\r\n") + records(2, 3), 2),  # CRLF, then a tail to drop
        (records(1)[:-2] + b'\xff"}\n' + records(2, 3), 2),  # a byte that is not UTF-8
        (records(1)[:-2] + b' \xe2\x80\xa8"}\n' + records(2, 3), 2),  # U+2028 splits the line
        (records(1) + b'{"step": 2}\r{"step": 7}\n', 5),  # a CR inside a line
        (records(1, 7) + records(2)[:-1], 5),  # a kept last line without a newline after a dropped one
    ],
)
def test_drop_records_after_leaves_what_the_whole_file_version_left(tmp_path, content, step):
    streamed, reference = tmp_path / "streamed.jsonl", tmp_path / "reference.jsonl"
    streamed.write_bytes(content)
    reference.write_bytes(content)
    drop_records_after(streamed, step)
    old_drop_records_after(reference, step)
    assert streamed.read_bytes() == reference.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["reference.jsonl", "streamed.jsonl"]  # no temporary


def test_drop_records_after_drops_a_record_whose_step_is_not_a_number(tmp_path):
    path = tmp_path / "metrics.jsonl"
    deep = b"[" * 100_000 + b"]" * 100_000
    path.write_bytes(records(1, 2) + b'{"step": "3"}\n{"step": null}\n{"step": ' + deep + b"}\n")
    drop_records_after(path, 5)  # a string or null step was a TypeError, deep nesting a RecursionError
    assert path.read_bytes() == records(1, 2)
    drop_records_after(tmp_path / "missing.jsonl", 5)  # no file: nothing to do
    assert not (tmp_path / "missing.jsonl").exists()


@pytest.mark.parametrize("bad_line_first", [False, True])  # truncated, rewritten
def test_drop_records_after_reads_the_file_as_a_stream(tmp_path, bad_line_first):
    line = {"step": 0, "loss": 1.5, "expert_load_cv": [0.25] * 60}
    steps = 40_000  # ~20 MB
    path = tmp_path / "metrics.jsonl"
    with open(path, "w") as file:
        if bad_line_first:
            file.write("garbage\n")
        for s in range(1, steps + 1):
            file.write(json.dumps({**line, "step": s}) + "\n")
    size = path.stat().st_size
    assert size > 15e6
    tracemalloc.start()
    try:
        drop_records_after(path, steps - 10)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < size / 20  # the whole-file version held the file and its lines (> 2x its size)
    with open(path) as file:
        kept = [json.loads(x)["step"] for x in file]
    assert kept == list(range(1, steps - 9))
