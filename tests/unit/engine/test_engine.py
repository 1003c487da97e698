"""The training engine and the `moetrain train` command."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from moetrain.cli import build_train_config, main
from moetrain.config import TrainConfig, config_from_dict
from moetrain.engine import Trainer, check_fits, lr_at
from moetrain.registry import DataShard
from tests.helpers.dist_utils import run_distributed
from tests.helpers.paths import ROOT


def tiny(out_dir, **overrides) -> dict:
    config = {
        "model": {
            "name": "moe_lm",
            "d_model": 32,
            "num_layers": 1,
            "num_heads": 2,
            "max_seq_len": 16,
            "moe": {"d_ff": 32, "num_experts": 4, "top_k": 2, "router_jitter": 0.05},
        },
        "data": {"micro_batch_size": 4, "seq_len": 16},
        "optim": {"lr": 3e-3, "warmup_steps": 2},
        "steps": 8,
        "out_dir": str(out_dir),
        "threads": 1,
        "log_every": 1,
        "device": "cpu",  # the gloo tests keep to the CPU on a GPU machine too
    }
    for key, value in overrides.items():
        node = config
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return config


def run(config: dict, until=None) -> list[float]:
    return [m["loss"] for m in Trainer(config_from_dict(TrainConfig, config)).train(until=until)]


def test_same_config_twice_gives_the_same_losses(tmp_path):
    first = run(tiny(tmp_path / "a"))
    second = run(tiny(tmp_path / "b"))
    assert first == second and len(first) == 8
    assert all(torch.isfinite(torch.tensor(first)))


def test_resume_equals_straight_run(tmp_path):
    straight = run(tiny(tmp_path / "straight", grad_accum=2))
    interrupted = run(tiny(tmp_path / "resumed", grad_accum=2), until=4)
    resumed = run(tiny(tmp_path / "resumed", grad_accum=2))
    assert len(interrupted) == 4 and len(resumed) == 4
    assert interrupted + resumed == straight


@pytest.mark.parametrize(
    "overrides",
    [
        {"precision": "bf16"},
        {"precision": "fp16"},
        {"optim.name": "groupwise"},
        {"optim.name": "offload", "precision": "bf16"},
        {"optim.name": "offload", "precision": "fp16", "grad_accum": 2},
        {"optim.name": "offload", "precision": "bf16", "param_dtype": "bf16"},
        {"optim.name": "offload", "precision": "fp16", "param_dtype": "fp16"},
        {"recompute_budget_mb": 0.05},
    ],
)
def test_precisions_and_optimizers_train(tmp_path, overrides):
    losses = run(tiny(tmp_path, steps=12, **overrides))
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def test_metrics_file_and_checkpoints(tmp_path):
    run(tiny(tmp_path, checkpoint_every=3, keep_last=2))
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, 9))
    for key in ("loss", "aux_loss", "lr", "grad_norm", "tokens_per_s", "expert_load_cv", "dropped_fraction"):
        assert key in lines[-1]
    assert len(lines[-1]["expert_load_cv"]) == 1  # one MoE layer
    checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if not p.name.endswith(".tmp"))
    assert len([c for c in checkpoints if c.startswith("step_")]) == 2  # keep_last


def test_lr_schedule_warmup_then_cosine():
    config = config_from_dict(
        TrainConfig, tiny("x", steps=12, **{"optim.warmup_steps": 2, "optim.min_lr_ratio": 0.1})
    )
    values = [lr_at(step, config) for step in range(12)]
    assert values[:2] == [0.5, 1.0] and values[2] == pytest.approx(1.0)
    assert values[-1] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(0.9 * torch.pi)).item()))
    assert all(a >= b for a, b in zip(values[2:], values[3:], strict=False))


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_cli_errors_are_one_line_before_training(tmp_path, capsys):
    good = tiny(tmp_path)
    cases = {
        _write(
            tmp_path, "unknown.json", json.dumps({**good, "optim": {"lrr": 1}})
        ): "unknown key 'optim.lrr'",
        _write(tmp_path, "bad.yaml", "model: [unclosed"): "is not valid YAML",
        str(tmp_path / "missing.yaml"): "cannot read config",
        _write(tmp_path, "value.json", json.dumps({**good, "precision": "fp8"})): "precision must be one of",
        _write(
            tmp_path, "ep.json", json.dumps({**good, "parallel": {"ep_size": 3}})
        ): "ep_size = 3 must divide",
        _write(
            tmp_path, "speeds.json", json.dumps({**good, "balance": {"speeds": [1.0, -2]}})
        ): "balance.speeds[1] must be a finite number > 0, got -2",
        _write(tmp_path, "device.json", json.dumps({**good, "device": "tpu"})): "device must be one of",
    }
    for path, message in cases.items():
        assert main(["train", "--config", path]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "metrics.jsonl").exists()
    run(tiny(tmp_path / "run", steps=2))  # a saved run whose checkpoint then gets truncated
    saved = next((tmp_path / "run" / "checkpoints" / "step_00000002").glob("*.distcp"))
    saved.write_bytes(saved.read_bytes()[:100])
    capsys.readouterr()
    assert (
        main(["train", "--config", _write(tmp_path, "run.json", json.dumps(tiny(tmp_path / "run", steps=3)))])
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert saved.name in err and len(err.splitlines()) == 1, err


def test_cli_overrides(tmp_path):
    path = _write(tmp_path, "run.yaml", json.dumps(tiny(tmp_path)))
    config = build_train_config(path, ["optim.lr=1e-4", "optim.betas=[0.8, 0.9]", "model.moe.top_k=1"])
    assert config.optim.lr == 1e-4 and config.optim.betas == (0.8, 0.9) and config.model.moe.top_k == 1
    with pytest.raises(ValueError, match="experts"):
        check_fits(config_from_dict(TrainConfig, tiny(tmp_path, **{"parallel.ep_size": 8})), 8)


@pytest.mark.timeout(180)
def test_sigterm_checkpoints_then_exits(tmp_path):
    path = _write(tmp_path, "run.json", json.dumps(tiny(tmp_path, steps=100000)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moetrain.cli", "train", "--config", path],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err[-2000:]  # EXIT_PREEMPTED: checkpointed, to be resubmitted
    assert "SIGTERM: checkpoint saved" in out + err
    steps = [
        p
        for p in (tmp_path / "checkpoints").iterdir()
        if p.name.startswith("step_") and not p.name.endswith(".tmp")
    ]
    assert len(steps) == 1


def distributed_worker(rank, world, out_dir, until=None):
    config = config_from_dict(
        TrainConfig, tiny(out_dir, **{"parallel.ep_size": world, "parallel.local_world_size": 1})
    )
    return [m["loss"] for m in Trainer(config).train(until=until)]


@pytest.mark.timeout(240)
def test_two_ranks_with_expert_parallelism_train_and_resume(tmp_path):
    straight = run_distributed(distributed_worker, 2, str(tmp_path / "straight"))
    assert straight[0] == straight[1] and len(straight[0]) == 8  # the logged loss is the global mean
    first = run_distributed(distributed_worker, 2, str(tmp_path / "resumed"), 5)
    second = run_distributed(distributed_worker, 2, str(tmp_path / "resumed"))
    assert first[0] + second[0] == straight[0]  # stopped at 5, resumed to 8: the same run
    assert first[1] + second[1] == straight[1]
    # The same checkpoint resumed by one process: the experts of both ranks are gathered, and the
    # rank the saved run had keeps its data stream.
    fewer = run(tiny(tmp_path / "resumed", steps=10))
    assert len(fewer) == 2 and all(torch.isfinite(torch.tensor(fewer)))


def tensor_parallel_worker(rank, world, out_dir, until=None, replica="ddp", recompute=None):
    overrides = {"parallel.tp_size": world, "parallel.replica": replica, "steps": 4, "model.num_heads": 4}
    if recompute is not None:
        overrides["recompute_budget_mb"] = recompute
    config = config_from_dict(TrainConfig, tiny(out_dir, **overrides))
    return [m["loss"] for m in Trainer(config).train(until=until)]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tensor_parallel_training_equals_one_process_and_resumes(tmp_path):
    """tp_size 2 on two ranks (the LM's default strategy: q/k/v, projection, embedding and head
    split; the head's logits through the parallel cross-entropy): the same losses as one process
    on the same data, with DDP or FSDP2 replicas and with recompute_budget_mb 0, and a run stopped
    at step 2 and resumed ends where the straight run ends."""
    single = run(tiny(tmp_path / "single", steps=4, **{"model.num_heads": 4}))
    straight = run_distributed(tensor_parallel_worker, 2, str(tmp_path / "straight"))
    assert straight[0] == straight[1]
    assert straight[0] == pytest.approx(single, rel=1e-4)
    first = run_distributed(tensor_parallel_worker, 2, str(tmp_path / "resumed"), 2)
    second = run_distributed(tensor_parallel_worker, 2, str(tmp_path / "resumed"))
    assert first[0] + second[0] == pytest.approx(straight[0], rel=1e-6)
    fsdp = run_distributed(tensor_parallel_worker, 2, str(tmp_path / "fsdp"), None, "fsdp")
    assert fsdp[0] == pytest.approx(single, rel=1e-4)
    recomputed = run_distributed(tensor_parallel_worker, 2, str(tmp_path / "recompute"), None, "ddp", 0)
    assert recomputed[0] == pytest.approx(single, rel=1e-4)  # activation checkpointing of split layers


def first_batch_after_resuming(rank, world, out_dir, tp_size):
    overrides = {"parallel.tp_size": tp_size, "parallel.ep_size": world // tp_size, "model.num_heads": 4}
    trainer = Trainer(config_from_dict(TrainConfig, tiny(out_dir, steps=4, **overrides)))
    try:
        trainer.maybe_resume()
        return trainer.step, trainer.batches.next()[0]
    finally:
        trainer.close()


@pytest.mark.timeout(240)
def test_ranks_that_shared_a_tensor_parallel_stream_resume_as_two_streams_on_different_data(tmp_path):
    """Saved under tp_size 2 (both ranks read stream 0), resumed under ep_size 2 (two streams):
    rank 1's saved data position was stream 0's, so it starts a stream of its own."""
    run_distributed(tensor_parallel_worker, 2, str(tmp_path), 2)
    (step0, batch0), (step1, batch1) = run_distributed(first_batch_after_resuming, 2, str(tmp_path), 1)
    assert step0 == step1 == 2
    assert not torch.equal(batch0, batch1)
    (_, again0), (_, again1) = run_distributed(first_batch_after_resuming, 2, str(tmp_path), 2)
    assert torch.equal(again0, again1)  # under tp_size 2 again: one stream, as saved


def overflow_worker(rank, world, out_dir):
    """fp16, ep_size = world: each rank's experts are its own (expert-DP group of one), so an
    overflow in rank 0's expert gradient reaches no other rank through the gradient reductions."""
    config = config_from_dict(
        TrainConfig,
        tiny(
            out_dir, steps=4, precision="fp16", **{"parallel.ep_size": world, "parallel.local_world_size": 1}
        ),
    )
    trainer = Trainer(config)
    if rank == 0:
        expert_weight = next(p for n, p in trainer.model.named_parameters() if "experts" in n)
        expert_weight.register_hook(lambda g: torch.full_like(g, float("inf")) if trainer.step == 1 else g)
    history = trainer.train()
    dense = [p.detach().clone() for n, p in trainer.model.named_parameters() if "experts" not in n]
    return [(m["skipped"], m["loss_scale"]) for m in history], dense


@pytest.mark.timeout(240)
def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    (steps0, dense0), (steps1, dense1) = run_distributed(overflow_worker, 2, str(tmp_path))
    assert steps0 == steps1
    assert [skipped for skipped, _ in steps0] == [False, True, False, False]
    scales = [scale for _, scale in steps0]
    assert scales[2] == scales[1] / 2  # backed off once, on both ranks
    assert all(torch.equal(a, b) for a, b in zip(dense0, dense1, strict=True))  # replicas still equal


def test_resume_drops_metrics_of_steps_redone(tmp_path):
    run(tiny(tmp_path, checkpoint_every=3), until=7)  # checkpoints at 3, 6 and 7
    for step in (6, 7):  # as if the run crashed after step 7 with only step 3 saved
        shutil.rmtree(tmp_path / "checkpoints" / f"step_{step:08d}")
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 8, "lo')  # a torn last line
    run(tiny(tmp_path, checkpoint_every=3))
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))


def balanced_worker(rank, world, out_dir, speeds):
    # Calibration times passes of up to 4 micro-batches: a wider model keeps them well above noise.
    balance = {"balance.speeds": speeds}
    if not speeds:
        balance = {
            "balance.calibrate": True,
            "model.d_model": 64,
            "model.max_seq_len": 64,
            "data.seq_len": 64,
            "data.micro_batch_size": 8,
        }
    config = config_from_dict(TrainConfig, tiny(out_dir, steps=3, **{"parallel.ep_size": world, **balance}))
    trainer = Trainer(config)
    history = trainer.train()
    return trainer.batches.batch, trainer.loss_weight, [m["tokens_per_s"] > 0 for m in history]


@pytest.mark.timeout(240)
@pytest.mark.serial  # calibrates rank speeds: run alone
def test_balanced_batches_follow_rank_speeds(tmp_path):
    results = run_distributed(balanced_worker, 2, str(tmp_path), [3.0, 1.0])
    (n0, w0, ok0), (n1, w1, ok1) = results
    assert (n0, n1) == (6, 2)  # 8 sequences split 3:1
    assert (w0, w1) == (2 * 6 / 8, 2 * 2 / 8)
    assert all(ok0 + ok1)
    (n0, w0, _), (n1, w1, _) = run_distributed(balanced_worker, 2, str(tmp_path / "calibrated"), None)
    assert n0 + n1 == 16 and w0 + w1 == pytest.approx(2.0)  # measured speeds, same global batch
    with pytest.raises(ValueError, match="balance"):
        config_from_dict(TrainConfig, tiny(tmp_path, **{"balance.speeds": [1.0], "balance.calibrate": True}))


def test_device_choice():
    from moetrain.engine import resolve_device

    assert resolve_device("cpu", 0, 1) == torch.device("cpu")
    if torch.cuda.device_count() < 2:
        assert resolve_device("auto", 0, 2) == torch.device("cpu")  # no GPU for every local rank
        with pytest.raises(ValueError, match="device = 'cuda' needs one GPU per rank: 2 ranks"):
            resolve_device("cuda", 1, 2)


def test_skipped_bad_records_are_reported_and_logged(tmp_path, caplog):
    from m6_moe import ensure_synthetic_dataset

    data = ensure_synthetic_dataset(tmp_path / "data", num_train=16, num_heldout=2, size=32, progress=False)
    manifest = data / "train.jsonl"
    with open(manifest, "a") as f:
        f.write("{not json\n")
    config = build_train_config(
        str(ROOT / "models/m6_moe/tiny.yaml"),
        [
            f"out_dir={tmp_path / 'run'}",
            f"data.source={manifest}",
            "model.tasks.skip_bad_records=true",
            "steps=2",
            "log_every=1",
            "data.micro_batch_size=2",
            "threads=1",
            "device=cpu",
        ],
    )
    history = Trainer(config).train()
    assert [m["skipped_records"] for m in history] == [1, 1]
    out = "\n".join(r.getMessage() for r in caplog.records)
    assert "data (start, rank 0): 1 bad record skipped:" in out and "invalid JSON" in out
    assert "data (end, rank 0): 1 bad record skipped:" in out


def test_tensorboard_events_when_installed(tmp_path):
    pytest.importorskip("tensorboard", reason="the optional tensorboard package is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run(tiny(tmp_path, steps=3))
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "expert_load_cv/layer0",
        "dropped_fraction/layer0",
    } <= tags
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3]


BALANCE_GRADIENT = {
    "model.moe.capacity_factor": None,  # dropless: a rank's capacity would depend on its batch
    "model.moe.aux_loss_coef": 0.0,  # the balancing loss is not additive over sequences
    "model.moe.router_jitter": 0.0,
    "optim.grad_clip": 0.0,
    "steps": 1,
}


def balanced_gradient_worker(rank, world, out_dir):
    config = config_from_dict(
        TrainConfig, tiny(out_dir, **{**BALANCE_GRADIENT, "balance.speeds": [3.0, 1.0]})
    )
    trainer = Trainer(config)
    trainer.train_step()
    return trainer.batches.batch, {name: p.grad.clone() for name, p in trainer.model.named_parameters()}


@pytest.mark.timeout(240)
@pytest.mark.serial  # calibrates rank speeds: run alone
def test_balanced_step_has_the_gradient_of_the_global_batch(tmp_path):
    """Through the engine: 2 data-parallel ranks with micro-batches 6 and 2 (speeds 3:1) give the
    gradient of one process on the same 8 sequences (the loss weights w_r = W * n_r / N)."""
    from moe_lm import TextBatches

    (n0, grads0), (n1, grads1) = run_distributed(balanced_gradient_worker, 2, str(tmp_path / "ranks"))
    assert (n0, n1) == (6, 2)
    config = config_from_dict(TrainConfig, tiny(tmp_path / "one", **BALANCE_GRADIENT))
    reference = Trainer(config)
    corpus, seq = reference.batches.corpus, config.data.seq_len
    draws = [TextBatches(corpus, n, seq, config.seed, rank).next() for rank, n in enumerate((n0, n1))]
    inputs, targets = (torch.cat(parts) for parts in zip(*draws, strict=True))
    reference.loss_fn(reference.model(inputs), targets).backward()
    for name, param in reference.model.named_parameters():
        torch.testing.assert_close(grads0[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)
        torch.testing.assert_close(grads1[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)


M6_BALANCE_GRADIENT = [
    "steps=1",
    "data.micro_batch_size=4",
    "model.moe.capacity_factor=null",
    "model.moe.aux_loss_coef=0.0",
    "model.moe.router_jitter=0.0",
    "model.dropout=0.0",
    "optim.grad_clip=0.0",
    "threads=1",
    "device=cpu",
]


def m6_balanced_worker(rank, world, out_dir):
    overrides = [*M6_BALANCE_GRADIENT, f"out_dir={out_dir}", "balance.speeds=[3.0, 1.0]"]
    trainer = Trainer(build_train_config(str(ROOT / "models/m6_moe/tiny.yaml"), overrides))
    trainer.train_step()
    return trainer.batches.batch, {name: p.grad.clone() for name, p in trainer.model.named_parameters()}


@pytest.mark.timeout(240)
@pytest.mark.serial  # calibrates rank speeds: run alone
def test_balanced_m6_step_has_the_gradient_of_the_mean_over_all_target_tokens(tmp_path):
    """M6 averages its loss over target tokens, whose number varies between samples: balanced
    ranks are weighted by their share of the target tokens, so micro-batches 6 + 2 give one
    process's gradient of the mean over every target token of the same 8 samples."""
    from m6_moe import build_m6
    from m6_moe.tasks import count_target_tokens, m6_loss

    (n0, grads0), (n1, grads1) = run_distributed(m6_balanced_worker, 2, str(tmp_path / "ranks"))
    assert (n0, n1) == (6, 2)
    config = build_train_config(
        str(ROOT / "models/m6_moe/tiny.yaml"), [*M6_BALANCE_GRADIENT, f"out_dir={tmp_path / 'one'}"]
    )
    model = Trainer(config).model
    sums, tokens = [], []
    batches = build_m6(config, DataShard())[1]
    for start, n in ((0, n0), (n0, n1)):  # rank r reads its slice of the global stream's first 8
        inputs, labels = batches.draw(start, n)
        tokens.append(count_target_tokens(labels))
        sums.append(m6_loss(model(**inputs), labels) * tokens[-1])
    assert tokens[0] / n0 != tokens[1] / n1  # unequal tokens per sample: sequence weights would be off
    (sum(sums) / sum(tokens)).backward()
    for name, param in model.named_parameters():
        want = torch.zeros_like(param) if param.grad is None else param.grad
        torch.testing.assert_close(grads0[name], want, rtol=1e-4, atol=1e-6, msg=name)
        torch.testing.assert_close(grads1[name], want, rtol=1e-4, atol=1e-6, msg=name)


def test_runtime_failure_is_one_line_naming_rank_step_and_module_with_the_traceback_in_the_log(
    tmp_path, monkeypatch, capsys
):
    from moetrain.layers import MoELayer
    from moetrain.logs import detach_handlers

    original = MoELayer.forward
    calls = []

    def failing_forward(self, x):
        calls.append(1)
        if len(calls) == 2:  # the second step's forward
            raise RuntimeError("injected fault\nsecond line of the message")
        return original(self, x)

    monkeypatch.setattr(MoELayer, "forward", failing_forward)
    path = _write(tmp_path, "run.json", json.dumps(tiny(tmp_path / "run", steps=4)))
    try:
        code = main(["train", "--config", path])
    finally:
        detach_handlers()
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("moetrain: error:")]
    log_file = tmp_path / "run" / "logs" / "rank_0.log"
    assert code == 1 and len(lines) == 1, err
    assert lines[0] == (
        "moetrain: error: rank 0, step 2, forward of module blocks.0.ffn (MoELayer): RuntimeError: injected "
        f"fault; full traceback in {log_file}"
    )
    assert "Traceback" not in err
    text = log_file.read_text()
    assert (
        "Traceback (most recent call last)" in text and "injected fault" in text and "failing_forward" in text
    )


def test_checkpoints_by_wall_clock_time(tmp_path):
    """checkpoint_every_minutes: a checkpoint once that much time passed since the last one (here
    so little that every step qualifies, then so much that only the final one is written)."""
    often = tiny(tmp_path / "often", steps=4, checkpoint_every_minutes=1e-9, keep_last=10)
    run(often)
    assert [p.name for p in sorted((tmp_path / "often" / "checkpoints").iterdir())] == [
        f"step_0000000{s}" for s in (1, 2, 3, 4)
    ]
    rarely = tiny(tmp_path / "rarely", steps=4, checkpoint_every_minutes=60, keep_last=10)
    run(rarely)
    assert [p.name for p in (tmp_path / "rarely" / "checkpoints").iterdir()] == ["step_00000004"]


def test_checkpoint_at_end_false_writes_no_final_checkpoint(tmp_path):
    """checkpoint_at_end: false keeps checkpoint_every's checkpoints and writes none at the end; the
    default writes one."""
    run(tiny(tmp_path / "none", steps=4, checkpoint_every=3, keep_last=10, checkpoint_at_end=False))
    assert [p.name for p in (tmp_path / "none" / "checkpoints").iterdir()] == ["step_00000003"]
    run(tiny(tmp_path / "default", steps=4, checkpoint_every=3, keep_last=10))
    names = sorted(p.name for p in (tmp_path / "default" / "checkpoints").iterdir())
    assert names == ["step_00000003", "step_00000004"]


def stray_expert_copies_worker(rank, world, out_dir):
    """Trains 2 steps; returns the shapes of live tensors shaped like an expert weight that are not
    the model's weights, gradients or optimizer state."""
    import gc

    trainer = Trainer(config_from_dict(TrainConfig, tiny(out_dir, steps=2)))
    trainer.train()
    params = list(trainer.model.parameters())
    states = [v for state in trainer.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    grads = [p.grad for p in params if p.grad is not None]
    owned = {t.untyped_storage().data_ptr() for t in [*params, *grads, *states]}
    expert_shapes = {tuple(p.shape) for name, p in trainer.model.named_parameters() if ".experts." in name}
    gc.collect()
    stray = [
        tuple(t.shape)
        for t in gc.get_objects()
        if isinstance(t, torch.Tensor)
        and tuple(t.shape) in expert_shapes
        and t.untyped_storage().data_ptr() not in owned
    ]
    trainer.close()
    return sorted(expert_shapes), stray


def test_a_run_holds_no_copy_of_the_experts_beside_the_model(tmp_path):
    """The experts each MoE layer had before parallelize replaced them by their slice (a copy) are
    freed: they were kept alive beside it, 4 bytes per expert parameter on every rank, 2 GiB of
    the H100 calibration run's peak (docs/planner.md). One fresh rank process, so that no other
    test's tensors are in sight."""
    [(expert_shapes, stray)] = run_distributed(stray_expert_copies_worker, 1, str(tmp_path))
    assert expert_shapes
    assert not stray, f"tensors of the experts' shapes outside the model and its optimizer: {stray}"


# (world, overrides): the layouts experts_init local is checked in against the whole build
EXPERTS_INIT_LAYOUTS = {
    "one-rank": (1, {}),
    "ep2": (2, {"parallel": {"ep_size": 2}}),
    "ddp-experts-replicated": (2, {"parallel": {"ep_size": 1}}),
    "fsdp-ep2": (2, {"parallel": {"ep_size": 2, "replica": "fsdp"}}),
    "tp2": (2, {"parallel": {"ep_size": 1, "tp_size": 2}}),
    "pp2": (2, {"parallel": {"ep_size": 1, "pp_size": 2}, "grad_accum": 2}),
    "offload-bf16-ep2": (
        2,
        {
            "parallel": {"ep_size": 2},
            "optim": {"name": "offload", "lr": 3e-3, "warmup_steps": 2},
            "param_dtype": "bf16",
            "precision": "bf16",
        },
    ),
}


def experts_init_worker(rank, world, out_dir, experts_init, layout):
    """Trains the tiny run (2 layers) in ``layout``; returns the losses and gradient norms, this
    rank's weights, the expert count of every GroupedExperts initialised with memory (on ``meta``
    nothing is) and of every GroupedExperts the trained model holds."""
    from moetrain.layers.experts import GroupedExperts

    initialised = []
    reset = GroupedExperts.reset_parameters

    def recording_reset(self):
        if self.w1_EDF.device.type != "meta":
            initialised.append(self.num_experts)
        reset(self)

    GroupedExperts.reset_parameters = recording_reset
    _, overrides = EXPERTS_INIT_LAYOUTS[layout]
    config = {**tiny(out_dir, steps=4, log_every=1), **overrides, "experts_init": experts_init}
    config["model"] = {**config["model"], "num_layers": 2}
    trainer = Trainer(config_from_dict(TrainConfig, config))
    history = [(m["loss"], m["grad_norm"]) for m in trainer.train()]
    weights = {  # a split or sharded weight: this rank's part
        name: (value.to_local() if hasattr(value, "to_local") else value).detach().clone()
        for name, value in trainer.model.state_dict().items()
    }
    held = [m.num_experts for m in trainer.model.modules() if isinstance(m, GroupedExperts)]
    trainer.close()
    return history, weights, initialised, held


@pytest.mark.parametrize("layout", sorted(EXPERTS_INIT_LAYOUTS))
def test_experts_init_local_allocates_only_this_ranks_experts_and_trains_the_same(tmp_path, layout):
    """experts_init local: a rank allocates and initialises exactly the experts it keeps (the whole
    build: every expert of every layer), and the run equals the whole build's bit for bit in every
    layout: the same losses and gradient norms, the same weights (dense ones drawn from the same
    generator sequence, experts from their per-expert seeds, in the weights' own dtype)."""
    world, _ = EXPERTS_INIT_LAYOUTS[layout]
    whole = run_distributed(experts_init_worker, world, str(tmp_path / "whole"), "whole", layout)
    local = run_distributed(experts_init_worker, world, str(tmp_path / "local"), "local", layout)
    for (history, weights, built, _), (local_history, local_weights, initialised, held) in zip(
        whole, local, strict=True
    ):
        assert local_history == history and len(history) == 4
        assert local_weights.keys() == weights.keys()
        for name, value in weights.items():
            assert local_weights[name].dtype == value.dtype and torch.equal(local_weights[name], value), name
        assert sorted(initialised) == sorted(held) and built == [4, 4]


def experts_init_resume_worker(rank, world, out_dir, experts_init, until):
    config = {**tiny(out_dir, steps=4, log_every=1), "parallel": {"ep_size": 2}, "experts_init": experts_init}
    trainer = Trainer(config_from_dict(TrainConfig, config))
    losses = [m["loss"] for m in trainer.train(until=until)]
    trainer.close()
    return losses


def test_experts_init_local_resumes_where_the_whole_build_runs_on(tmp_path):
    """Stopped at step 2 and resumed on 2 expert-parallel ranks with experts_init local, the run's
    losses are the whole build's straight run (the checkpoint's experts load into the experts
    allocated after sharding)."""
    straight = run_distributed(experts_init_resume_worker, 2, str(tmp_path / "whole"), "whole", None)
    first = run_distributed(experts_init_resume_worker, 2, str(tmp_path / "local"), "local", 2)
    second = run_distributed(experts_init_resume_worker, 2, str(tmp_path / "local"), "local", None)
    assert [a + b for a, b in zip(first, second, strict=True)] == straight
    assert all(len(losses) == 4 for losses in straight)


def test_experts_init_must_be_whole_or_local(tmp_path):
    with pytest.raises(ValueError, match="experts_init must be one of 'whole', 'local', got 'lazy'"):
        config_from_dict(TrainConfig, tiny(tmp_path, experts_init="lazy"))


def test_weight_decay_spares_the_experts_stacked_biases(tmp_path):
    """Decay applies to matrices: the experts' weights (one matrix per expert) and the router;
    not to norms or to the experts' biases, which are 2-D only because they stack one per expert."""
    trainer = Trainer(config_from_dict(TrainConfig, tiny(tmp_path, **{"model.moe.expert_bias": True})))
    try:
        names = {id(p): name for name, p in trainer.model.named_parameters()}
        groups = {group["weight_decay"]: group["params"] for group in trainer.optimizer.param_groups}
        groups = {decay: {names[id(p)] for p in params} for decay, params in groups.items()}
    finally:
        trainer.close()
    decayed, spared = groups[trainer.config.optim.weight_decay], groups[0.0]
    expert_biases = {name for name in names.values() if name.endswith(("b1_EF", "b2_ED"))}
    expert_weights = {name for name in names.values() if name.endswith(("w1_EDF", "w2_EFD"))}
    norms = {name for name in names.values() if "norm" in name}
    assert expert_biases and expert_weights and norms
    assert expert_biases | norms <= spared
    assert expert_weights <= decayed
    assert any(name.endswith("router.weight") for name in decayed)


def test_a_model_built_in_another_dtype_is_cast_to_param_dtype(tmp_path, monkeypatch, caplog):
    """A builder may return bf16 weights (an HF config's torch_dtype): param_dtype fp32 trains fp32."""
    from moetrain import registry

    spec = registry.get_model("moe_lm")

    def bf16_builder(config, shard):
        model, batches, loss_fn = spec.builder(config, shard)
        return model.to(torch.bfloat16), batches, loss_fn

    monkeypatch.setitem(registry._REGISTRY, "moe_lm", dataclasses.replace(spec, builder=bf16_builder))
    caplog.set_level("INFO", logger="moetrain.engine.setup")
    trainer = Trainer(config_from_dict(TrainConfig, tiny(tmp_path, steps=2)))
    try:
        assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
        losses = [m["loss"] for m in trainer.train()]
    finally:
        trainer.close()
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    assert "model built with torch.bfloat16 weights, cast to param_dtype torch.float32" in caplog.text


@pytest.mark.parametrize("async_checkpoint", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("log_every,checkpoint_every", [(2, 2), (1, 2), (2, 4)])
def test_every_checkpoint_stall_is_reported_once_on_the_next_logging_step(
    tmp_path, async_checkpoint, log_every, checkpoint_every
):
    """A save comes after its step's metrics line: its checkpoint_stall_s is on the next logging
    line, once (it was lost whenever the checkpoint step was a logging step, and with async saves
    until a later save waited for it). The last save (step 8, the end) has no line after it."""
    config = tiny(
        tmp_path, steps=8, log_every=log_every, checkpoint_every=checkpoint_every,
        async_checkpoint=async_checkpoint, keep_last=10,
    )  # fmt: skip
    run(config)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    with_stall = [m["step"] for m in lines if "checkpoint_stall_s" in m]
    saves = range(checkpoint_every, 8, checkpoint_every)
    assert with_stall == [s + log_every - s % log_every for s in saves], with_stall
    assert all(m["checkpoint_stall_s"] > 0 for m in lines if "checkpoint_stall_s" in m)


def _sigterm_at_step(trainer: Trainer, step: int, rank: int = 0) -> None:
    """Sends this process SIGTERM (on ``rank`` only) as ``trainer`` starts optimizer step ``step``."""
    original = trainer.train_step

    def train_step():
        if trainer.step == step - 1 and trainer.rank == rank:
            os.kill(os.getpid(), signal.SIGTERM)
        return original()

    trainer.train_step = train_step


def test_sigterm_logs_the_steps_since_the_last_logging_step(tmp_path):
    """SIGTERM at step 7 with log_every 5: step 7 is logged (steps 6-7, whose window was dropped)
    before the checkpoint, and summary.json holds step 7's values beside last_step 7."""
    trainer = Trainer(config_from_dict(TrainConfig, tiny(tmp_path, steps=100, log_every=5)))
    _sigterm_at_step(trainer, 7)
    history = trainer.train()
    trainer.close()
    assert trainer.preempted and trainer.step == 7
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [5, 7] == [m["step"] for m in history]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["last_step"] == 7 and summary["preempted"] is True
    assert summary["loss"] == lines[-1]["loss"] and summary["lr"] == lines[-1]["lr"]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000007"]


def sigterm_on_one_rank_worker(rank, world, out_dir):
    layout = {"parallel.ep_size": world, "parallel.local_world_size": 1}
    config = tiny(out_dir, steps=100, log_every=5, **layout)
    trainer = Trainer(config_from_dict(TrainConfig, config))
    _sigterm_at_step(trainer, 7, rank=1)
    history = trainer.train()
    trainer.close()
    return trainer.step, [m["step"] for m in history]


@pytest.mark.timeout(120)
def test_sigterm_on_one_rank_logs_the_stop_step_on_every_rank(tmp_path):
    """SIGTERM reaching rank 1 only: every rank agrees on the stop before the step's metrics (their
    all-reduces stay matched), logs step 7 and stops there."""
    results = run_distributed(sigterm_on_one_rank_worker, 2, tmp_path)
    assert results == [(7, [5, 7]), (7, [5, 7])]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [5, 7]
