"""Checkpoints: round trips, resharding across world sizes / ep_size, atomicity and integrity.

World 4 is emulated as 2 nodes x 2 local ranks (``local_world_size=2``). Models are tiny; the
distributed runs take most of the time (one world-4 save, one world-2 load).
"""

from __future__ import annotations

import errno
import io
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moetrain import MoEConfig, MoELayer, shard_experts
from moetrain import checkpoint as ckpt
from moetrain.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from moetrain.grad_sync import ExpertGradReducer, wrap_data_parallel
from moetrain.layers.experts import GroupedExperts
from moetrain.offload import OffloadOptimizer
from moetrain.parallel import ParallelContext
from tests.helpers.dist_utils import run_distributed
from tests.helpers.paths import ROOT

D_MODEL, D_FF, EXPERTS = 8, 12, 4


class Net(nn.Module):
    def __init__(self, parallel=None, num_experts=EXPERTS, d_ff=D_FF, jitter=0.1):
        super().__init__()
        self.inp = nn.Linear(6, D_MODEL)
        cfg = MoEConfig(
            d_model=D_MODEL,
            d_ff=d_ff,
            num_experts=num_experts,
            top_k=2,
            capacity_factor=None,
            eval_capacity_factor=None,
            router_jitter=jitter,
        )
        self.moe = MoELayer(cfg)
        if parallel is not None:
            shard_experts(self.moe, parallel)
        self.out = nn.Linear(D_MODEL, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.moe(self.inp(x.to(self.inp.weight.dtype))))).float()


def _batch():
    """Draws from torch's and Python's RNG, so a restored RNG state shows in the losses."""
    x = torch.randn(12, 6) * (0.5 + random.random())
    return x, torch.randn(12, 3)


def _train(model, optimizer, scheduler, steps):
    losses = []
    for _ in range(steps):
        x, y = _batch()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        losses.append(loss.item())
    return losses


def _adamw(model):
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-2)


def _offload(model):
    return OffloadOptimizer(model.parameters(), lr=1e-2, weight_decay=0.01)


def _setup(seed, make_optimizer, dtype):
    torch.manual_seed(seed)
    random.seed(seed)
    model = Net().to(dtype)
    optimizer = make_optimizer(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return model, optimizer, scheduler


@pytest.mark.parametrize(
    "make_optimizer, dtype",
    [(_adamw, torch.float32), (_offload, torch.float32), (_offload, torch.bfloat16)],
    ids=["adamw", "offload-fp32", "offload-bf16-master"],
)
def test_round_trip_continues_training_identically(tmp_path, caplog, make_optimizer, dtype):
    caplog.set_level("INFO", logger="moetrain.checkpoint")
    model, optimizer, scheduler = _setup(0, make_optimizer, dtype)
    _train(model, optimizer, scheduler, 3)
    save_checkpoint(
        tmp_path, 3, model=model, optimizer=optimizer, scheduler=scheduler, extra_state={"pos": 36}
    )
    saved_state = {k: v.clone() for k, v in optimizer.state[model.moe.experts.w1_EDF].items()}
    expected = _train(model, optimizer, scheduler, 3)
    expected_params = [p.detach().clone() for p in model.parameters()]

    model2, optimizer2, scheduler2 = _setup(1, make_optimizer, dtype)  # other weights and RNG
    _train(model2, optimizer2, scheduler2, 1)  # other optimizer state and LR
    info = load_checkpoint(tmp_path, model=model2, optimizer=optimizer2, scheduler=scheduler2)
    assert info["step"] == 3 and info["extra_state"] == {"pos": 36} and info["extra_state_rank"] == 0
    assert info["rng_restored"] == ["torch_cpu", "python"] and info["saved_world_size"] == 1
    for key, value in optimizer2.state[model2.moe.experts.w1_EDF].items():
        assert torch.equal(value, saved_state[key]), key
    assert _train(model2, optimizer2, scheduler2, 3) == expected
    for p, q in zip(model2.parameters(), expected_params, strict=True):
        assert torch.equal(p.detach(), q)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("moetrain.checkpoint")]
    assert len(lines) == 4 and " s" in lines[1] and "iB" in lines[1] and "iB" in lines[3]


def test_a_parameter_may_change_param_groups_but_the_parameters_must_be_the_checkpoints(tmp_path):
    """Optimizer state is found by parameter name: a version that groups a parameter differently
    (weight decay sparing the experts' stacked biases) resumes a run saved by an older one; an
    optimizer without one of the checkpoint's parameters is refused, naming it."""
    model, optimizer, scheduler = _setup(0, _adamw, torch.float32)
    _train(model, optimizer, scheduler, 2)
    save_checkpoint(tmp_path, 2, model=model, optimizer=optimizer, scheduler=scheduler)

    def regrouped(target, leave_out=()):
        named = [(n, p) for n, p in target.named_parameters() if n not in leave_out]
        first = [p for n, p in named if p.ndim >= 2 or n == "inp.bias"]  # inp.bias moves to group 0
        rest = [p for n, p in named if p.ndim < 2 and n != "inp.bias"]
        return torch.optim.AdamW([{"params": first}, {"params": rest, "weight_decay": 0.0}], lr=1e-2)

    model2, _, _ = _setup(1, _adamw, torch.float32)
    optimizer2 = regrouped(model2)
    load_checkpoint(tmp_path, model=model2, optimizer=optimizer2)
    loaded = dict(model2.named_parameters())
    for name, param in model.named_parameters():
        saved, restored = optimizer.state[param], optimizer2.state[loaded[name]]
        assert saved.keys() == restored.keys() and all(torch.equal(saved[k], restored[k]) for k in saved)

    with pytest.raises(ValueError, match=r"only in the checkpoint's: \['out.bias'\]"):
        load_checkpoint(tmp_path, model=model2, optimizer=regrouped(model2, leave_out={"out.bias"}))


# ------------------------------------------------------------------------------------------------
# Resharding: save at world 4 / ep_size 4, load at world 2 / ep_size 2 and at world 1


def _fixed_input():
    return torch.randn(10, 6, generator=torch.Generator().manual_seed(99))


def _per_expert_state(model, optimizer):
    """``{name or name.expert.g: {"param": tensor, state key: tensor}}`` of this rank."""
    names = {id(p): n for n, p in model.named_parameters()}
    experts = {
        f"{prefix}.{pn}": m.first_expert
        for prefix, m in model.named_modules()
        if isinstance(m, GroupedExperts)
        for pn, _ in m.named_parameters()
    }
    found = {}
    for p in model.parameters():
        name = names[id(p)]
        state = {"param": p.detach(), **{k: v for k, v in optimizer.state[p].items() if k != "step"}}
        if name in experts:
            for local in range(p.shape[0]):
                found[f"{name}.expert.{experts[name] + local}"] = {
                    k: v[local].clone() for k, v in state.items()
                }
        else:
            found[name] = {k: v.clone() for k, v in state.items()}
    return found


def _portable(value):
    """Worker results as bytes: tensors put on a multiprocessing queue travel as shared file
    descriptors, which vanish when the worker exits before the parent reads them."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _unportable(results):
    return [torch.load(io.BytesIO(raw), weights_only=False) for raw in results]


def save_world4_worker(rank, world, local_world, directory):
    ctx = ParallelContext(ep_size=4, local_world_size=local_world)
    torch.manual_seed(7)
    model = Net(ctx, jitter=0.0)
    ddp = wrap_data_parallel(model, ctx)
    reducer = ExpertGradReducer(model, ctx)
    optimizer = _adamw(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        F.mse_loss(ddp(torch.randn(8, 6, generator=g)), torch.randn(8, 3, generator=g)).backward()
        reducer.reduce()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    torch.manual_seed(100 + rank)
    save_checkpoint(
        directory,
        2,
        model=ddp,
        optimizer=optimizer,
        scheduler=scheduler,
        extra_state={"rank": rank},
        parallel=ctx,
    )
    rng_after_save = torch.rand(3)
    model.eval()
    with torch.no_grad():
        out = model(_fixed_input())
    return _portable((out, _per_expert_state(model, optimizer), rng_after_save))


def load_worker(rank, world, local_world, directory, damaged_directory, world1_directory, ep_size):
    ctx = ParallelContext(ep_size=ep_size, local_world_size=local_world)
    torch.manual_seed(8)  # other initial weights
    model = Net(ctx, jitter=0.0)
    optimizer = _adamw(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    # A world-1 checkpoint: rank 1 did not exist then (rank 0's extra state, no RNG restored).
    from_world1 = load_checkpoint(world1_directory, model=model, parallel=ctx)
    try:  # only rank 1 checksums the damaged file: every rank must raise, none may hang
        load_checkpoint(damaged_directory, model=model, optimizer=optimizer, parallel=ctx)
        damaged_error = None
    except CheckpointError as error:
        damaged_error = str(error)
    info = load_checkpoint(directory, model=model, optimizer=optimizer, scheduler=scheduler, parallel=ctx)
    rng_after_load = torch.rand(3)
    model.eval()
    with torch.no_grad():
        out = model(_fixed_input())
    info["path"] = str(info["path"])
    info["damaged_error"] = damaged_error
    info["from_world1"] = {k: from_world1[k] for k in ("extra_state", "extra_state_rank", "rng_restored")}
    return _portable(
        (out, _per_expert_state(model, optimizer), rng_after_load, info, scheduler.get_last_lr())
    )


@pytest.mark.timeout(240)
def test_save_world4_ep4_load_world2_ep2_and_world1(tmp_path):
    saved = _unportable(run_distributed(save_world4_worker, 4, 2, str(tmp_path)))
    reference_out = saved[0][0]
    reference_state = {}
    for _, state, _ in saved:
        reference_state.update(state)
    assert sum(".expert." in k for k in reference_state) == 2 * EXPERTS  # w1, w2 of 4 experts

    def check(out, state):
        torch.testing.assert_close(out, reference_out, rtol=1e-6, atol=1e-6)
        for name, values in state.items():
            for key, value in values.items():
                assert torch.equal(value, reference_state[name][key]), (name, key)

    # A copy with one byte flipped in a file that, at world 2, rank 1 verifies (files are shared
    # round-robin in name order: .metadata, __0_0, __1_0, __2_0, __3_0).
    damaged = tmp_path / "damaged"
    shutil.copytree(tmp_path / "step_00000002", damaged / "step_00000002")
    victim = damaged / "step_00000002" / "__2_0.distcp"
    raw = bytearray(victim.read_bytes())
    raw[-10] ^= 0xFF
    victim.write_bytes(bytes(raw))

    world1 = tmp_path / "world1"
    save_checkpoint(world1, 5, model=Net(), extra_state={"rank": 0})

    loaded = _unportable(run_distributed(load_worker, 2, 2, str(tmp_path), str(damaged), str(world1), 2))
    for rank, (out, state, rng, info, lr) in enumerate(loaded):
        check(out, state)
        assert len([k for k in state if ".expert." in k]) == EXPERTS  # 2 experts x (w1, w2) per rank
        assert info["step"] == 2 and info["saved_world_size"] == 4 and info["saved_ep_size"] == 4
        assert info["extra_state"] == {"rank": rank} and info["extra_state_rank"] == rank
        assert info["rng_restored"] == ["torch_cpu", "python"]
        assert "__2_0.distcp: corrupt" in info["damaged_error"]
        assert info["damaged_error"].startswith("rank 1: ") == (rank == 0)
        assert info["from_world1"] == {
            "extra_state": {"rank": 0},
            "extra_state_rank": 0,
            "rng_restored": ["torch_cpu", "python"] if rank == 0 else [],
        }
        assert torch.equal(rng, saved[rank][2])  # the saving rank's RNG continues here
        assert lr == pytest.approx([0.0025, 0.0025])  # 1e-2 * 0.5**2

    # World 1, no process group: one process holds all experts.
    torch.manual_seed(9)
    model = Net(jitter=0.0)
    optimizer = _adamw(model)
    info = load_checkpoint(tmp_path, model=model, optimizer=optimizer)
    model.eval()
    with torch.no_grad():
        out = model(_fixed_input())
    state = _per_expert_state(model, optimizer)
    check(out, state)
    assert state.keys() == reference_state.keys()
    assert info["extra_state"] == {"rank": 0}


# ------------------------------------------------------------------------------------------------
# Mismatches, integrity, atomicity, retention


def _small_checkpoint(directory, step=1, **model_options):
    torch.manual_seed(0)
    model = Net(**model_options)
    optimizer = _adamw(model)
    _train(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0), 1)
    return save_checkpoint(directory, step, model=model, optimizer=optimizer), model


def test_missing_expert_and_shape_mismatch_name_the_key_and_parameter(tmp_path):
    _small_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=r"'model/moe\.experts\.w1_EDF\.expert\.4'"):
        load_checkpoint(tmp_path, model=Net(num_experts=8))
    with pytest.raises(ValueError, match=r"holds 4 experts, this model has 2"):
        load_checkpoint(tmp_path, model=Net(num_experts=2))
    with pytest.raises(
        ValueError, match=r"parameter 'moe\.experts\.w1_EDF' \(expert 0\): shape \(8, 16\) here"
    ):
        load_checkpoint(tmp_path, model=Net(d_ff=16))
    model = Net()
    model.out = nn.Linear(D_MODEL, 5)
    with pytest.raises(ValueError, match=r"parameter 'out\.weight': shape \(5, 8\) here, \(3, 8\)"):
        load_checkpoint(tmp_path, model=model)
    with pytest.raises(ValueError, match=r"already exists"):
        _small_checkpoint(tmp_path)


@pytest.mark.parametrize("damage", ["truncate", "flip", "manifest"])
def test_damaged_checkpoint_raises_naming_the_file(tmp_path, damage):
    path, model = _small_checkpoint(tmp_path)
    data = max((p for p in path.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    before = [p.detach().clone() for p in model.parameters()]
    if damage == "truncate":
        data.write_bytes(data.read_bytes()[:-100])
        expected = rf"{data.name}: truncated"
    elif damage == "flip":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        data.write_bytes(bytes(raw))
        expected = rf"{data.name}: corrupt"
    else:
        manifest = path / ckpt.MANIFEST
        manifest.write_text(manifest.read_text().replace('"step": 1', '"step": 2'))
        expected = r"manifest\.json: corrupt manifest"
    with pytest.raises(CheckpointError, match=expected):
        load_checkpoint(tmp_path, model=model)
    for p, q in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach(), q)  # nothing was loaded


def test_large_checkpoints_show_hashing_progress(tmp_path, monkeypatch, progress_log):
    stream = progress_log()
    monkeypatch.setattr(ckpt.integrity, "PROGRESS_MIN_BYTES", 1)  # every checkpoint counts as large
    path, model = _small_checkpoint(tmp_path)
    load_checkpoint(tmp_path, model=model)
    err = stream.getvalue()
    assert "checkpoint: hashing (rank 0's share, MiB)" in err
    assert "checkpoint: verifying (rank 0's share, MiB)" in err


@pytest.mark.parametrize("fail_in", ["write_manifest", "publish"])
def test_failure_mid_save_leaves_the_previous_checkpoint_latest(tmp_path, monkeypatch, fail_in):
    first, model = _small_checkpoint(tmp_path, step=1)
    written = []

    def fail(directory, *args, **kwargs):
        written.append(sorted(p.name for p in Path(directory).iterdir()))
        raise RuntimeError("simulated failure")

    monkeypatch.setattr(ckpt.save, fail_in, fail)
    with pytest.raises(CheckpointError, match=r"step 2 could not be written .*simulated failure.* intact"):
        save_checkpoint(tmp_path, 2, model=model)
    assert ".metadata" in written[0]  # DCP had written when it failed
    assert not (tmp_path / "step_00000002.tmp").exists()  # the partial files were removed
    assert latest_checkpoint(tmp_path) == first
    assert load_checkpoint(tmp_path, model=model)["step"] == 1
    with pytest.raises(FileNotFoundError, match=r"no complete checkpoint for step 2 .* \[1\]"):
        load_checkpoint(tmp_path, model=model, step=2)

    monkeypatch.undo()
    (tmp_path / "step_00000002.tmp").mkdir()  # debris of a crashed save (a kill leaves it) is replaced
    second = save_checkpoint(tmp_path, 2, model=model)
    assert latest_checkpoint(tmp_path) == second
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001", "step_00000002"]


def test_keep_last_deletes_older_checkpoints(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        load_checkpoint(tmp_path, model=Net())
    model = Net()
    (tmp_path / "step_00000000.tmp").mkdir()  # debris of an old crash
    for step in (10, 20, 30, 40):
        save_checkpoint(tmp_path, step, model=model, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000030", "step_00000040"]
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [30, 40]
    assert load_checkpoint(tmp_path, model=model, step=30)["step"] == 30
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="keep_last must be an integer >= 1 or None"):
            save_checkpoint(tmp_path, 50, model=model, keep_last=bad)
    with pytest.raises(ValueError, match="step must be an integer >= 0"):
        save_checkpoint(tmp_path, -3, model=model)


# ------------------------------------------------------------------------------------------------
# Asynchronous saves


def test_async_save_writes_the_state_of_the_call_while_training_changes_the_weights(tmp_path, monkeypatch):
    model, optimizer, scheduler = _setup(0, _adamw, torch.float32)
    _train(model, optimizer, scheduler, 2)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    released = threading.Event()
    original = ckpt.save._SaveJob._dcp_save

    def held_back(job):  # the background write starts only after the weights changed
        released.wait(timeout=30)
        return original(job)

    monkeypatch.setattr(ckpt.save._SaveJob, "_dcp_save", held_back)
    writer = ckpt.CheckpointWriter(tmp_path, asynchronous=True)
    path = writer.save(2, model=model, optimizer=optimizer, scheduler=scheduler, extra_state={"pos": 1})
    assert writer.in_flight and not path.exists()
    _train(model, optimizer, scheduler, 1)  # the next step updates the weights in place
    released.set()
    result = writer.wait()
    assert result.path == path and path.is_dir() and 0 < result.blocking_s <= result.total_s
    fresh = Net()
    load_checkpoint(tmp_path, model=fresh)
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, expected[name]), name
    writer.close()


def test_async_save_failure_is_raised_by_wait_and_cleans_up(tmp_path, monkeypatch):
    first, model = _small_checkpoint(tmp_path, step=1)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "step_00000002.tmp"))

    monkeypatch.setattr(ckpt.save, "write_manifest", disk_full)
    writer = ckpt.CheckpointWriter(tmp_path, asynchronous=True)
    writer.save(2, model=model)
    with pytest.raises(CheckpointError, match=r"step 2 could not be written .*: no space left on device"):
        writer.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]
    assert latest_checkpoint(tmp_path) == first


@pytest.mark.parametrize("phase", ["before-write", "before-manifest", "before-publish"])
def test_kill_during_an_async_save_never_leaves_a_complete_looking_checkpoint(tmp_path, phase):
    script = ROOT / "tests" / "scripts" / "killed_async_save.py"
    child = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), phase],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert child.stdout.readline().strip() == "READY"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000001"
    assert [p.name for p in ckpt.debris(tmp_path)] == ["step_00000002.tmp"]
    net = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    assert load_checkpoint(tmp_path, model=net)["step"] == 1
    assert ckpt.remove_debris(tmp_path) and ckpt.debris(tmp_path) == []


def test_a_checkpoint_with_non_finite_weights_is_never_written_and_the_last_good_one_stays(tmp_path):
    first, model = _small_checkpoint(tmp_path, step=1)
    with torch.no_grad():
        model.out.weight[0, 0] = float("nan")
    with pytest.raises(CheckpointError, match=r"step 2 not written: non-finite .* in model/out\.weight"):
        save_checkpoint(tmp_path, 2, model=model, keep_last=1)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [1] and ckpt.debris(tmp_path) == []
