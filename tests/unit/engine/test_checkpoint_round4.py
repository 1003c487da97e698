"""Checkpoints across an ``optim.name`` switch, interrupted debris removal, and crafted manifests:

- an ``offload`` checkpoint resumed with ``adamw`` / ``groupwise`` writes each param's ``master``
  (cast) into its weight, the update a delayed run still had pending included, and keeps neither
  ``master`` nor ``pending`` in the torch optimizer's state, so switching back to ``offload`` later
  resumes from the torch run's weights (not the first run's stale master);
- a kill while removing debris leaves ``step_X.tmp.deleting``, which the next start removes;
- a manifest file name the filesystem cannot hold is one line on every rank, not an ``OSError`` on
  one and a broken collective on the other.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from moetrain.checkpoint import CheckpointError, debris, load_checkpoint, remove_debris, save_checkpoint
from moetrain.checkpoint.integrity import manifest_digest
from moetrain.config import TrainConfig, config_from_dict
from moetrain.engine import Trainer
from moetrain.offload import OffloadOptimizer
from tests.helpers.dist_utils import run_distributed
from tests.unit.engine.test_engine import tiny

DELAYED = {"optim.name": "offload", "optim.overlap": "delayed", "optim.overlap_after_steps": 2}
BF16_OFFLOAD = {"precision": "bf16", "param_dtype": "bf16"}  # bf16 weights, fp32 masters


def _trainer(config: dict) -> Trainer:
    return Trainer(config_from_dict(TrainConfig, config))


def _train(config: dict, until=None) -> dict[str, torch.Tensor]:
    trainer = _trainer(config)
    try:
        trainer.train(until=until)
        return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    finally:
        trainer.close()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_delayed_offload_checkpoint_resumed_with_adamw_holds_the_pending_update(tmp_path, precision):
    offload = {**DELAYED, **(BF16_OFFLOAD if precision == "bf16" else {})}
    _train(tiny(tmp_path, **offload), until=5)  # stopped with the step-5 update pending
    reader = _trainer(tiny(tmp_path, **offload))
    try:
        reader.maybe_resume()
        assert reader.step == 5 and reader.optimizer.has_pending
        masters = {n: reader.optimizer.state[p]["master"].clone() for n, p in reader.model.named_parameters()}
    finally:
        reader.close()
    adamw = {"optim.name": "adamw", "precision": precision}
    trainer = _trainer(tiny(tmp_path, **adamw))
    try:
        trainer.maybe_resume()
        assert trainer.step == 5
        differing = [
            name
            for name, p in trainer.model.named_parameters()
            if not torch.equal(p.detach(), masters[name].to(p.dtype))
        ]
        kept = sorted({key for state in trainer.optimizer.state.values() for key in state})
    finally:
        trainer.close()
    assert not differing, differing
    assert kept == ["exp_avg", "exp_avg_sq", "step"]


@pytest.mark.parametrize("between", ["adamw", "groupwise"])
def test_offload_then_torch_then_offload_resumes_from_the_torch_runs_weights(tmp_path, between):
    _train(tiny(tmp_path, **{"optim.name": "offload"}), until=4)
    after_torch = _train(tiny(tmp_path, **{"optim.name": between}))  # steps 5 to 8, saved at 8
    trainer = _trainer(tiny(tmp_path, steps=12, **{"optim.name": "offload"}))
    try:
        trainer.maybe_resume()
        assert trainer.step == 8
        differing = [
            n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), after_torch[n])
        ]
    finally:
        trainer.close()
    assert not differing, differing


class _MasterSGD(torch.optim.SGD):
    """An optimizer whose own state has a ``master`` key (a copy of the param)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["master"] = p.detach().clone() + 1
        return loss


def test_an_optimizer_with_its_own_master_key_keeps_it(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = _MasterSGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    save_checkpoint(tmp_path, 1, model=model, optimizer=optimizer)
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    loaded = nn.Linear(3, 2)
    into = _MasterSGD(loaded.parameters(), lr=0.1)
    load_checkpoint(tmp_path, model=loaded, optimizer=into)
    for name, p in loaded.named_parameters():
        assert torch.equal(p.detach(), saved[name])  # the weights, not the master
        assert torch.equal(into.state[p]["master"], saved[name] + 1)


def _offload_checkpoint(directory, overlap: str) -> tuple[dict, dict]:
    """Two steps of a bf16 model under OffloadOptimizer(overlap), saved; returns the saved weights
    and the fp32 masters."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4).to(torch.bfloat16)
    optimizer = OffloadOptimizer(model.parameters(), lr=0.1, overlap=overlap, overlap_after_steps=1)
    for _ in range(2):
        model(torch.ones(2, 4, dtype=torch.bfloat16)).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    save_checkpoint(directory, 2, model=model, optimizer=optimizer)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    masters = {n: optimizer.state[p]["master"].clone() for n, p in model.named_parameters()}
    return weights, masters


@pytest.mark.parametrize("overlap", ["delayed", "none"])
def test_adamw_takes_a_pending_master_in_full_and_otherwise_the_saved_weight(tmp_path, overlap):
    """Into an fp32 model: a pending update is the master itself; without one, the saved weight
    (the cast master) is the value, as in every other load."""
    weights, masters = _offload_checkpoint(tmp_path, overlap)
    loaded = nn.Linear(4, 4)
    load_checkpoint(tmp_path, model=loaded, optimizer=torch.optim.AdamW(loaded.parameters()))
    for name, p in loaded.named_parameters():
        if overlap == "delayed":  # the saved weight lacks the pending update
            assert not torch.equal(weights[name], masters[name].to(torch.bfloat16))
        expected = masters[name] if overlap == "delayed" else weights[name].float()
        assert torch.equal(p.detach(), expected), name


def test_debris_whose_removal_was_killed_is_removed_at_the_next_start(tmp_path):
    (tmp_path / "step_00000004.tmp").mkdir()
    (tmp_path / "step_00000004.tmp" / "__0_0.distcp").write_bytes(b"\0" * 64)
    (tmp_path / "step_00000006.tmp").mkdir()
    # the first start is killed after renaming step_00000004.tmp, before removing its files
    code = (
        "import os, shutil, sys; shutil.rmtree = lambda *a, **k: os._exit(9); "
        "from moetrain.checkpoint import remove_debris; remove_debris(sys.argv[1])"
    )
    killed = subprocess.run([sys.executable, "-c", code, str(tmp_path)], timeout=120, check=False)
    assert killed.returncode == 9
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004.tmp.deleting", "step_00000006.tmp"]
    (tmp_path / "step_00000006.tmp.deleting").mkdir()  # one killed earlier, its .tmp made again since
    assert [p.name for p in debris(tmp_path)] == [
        "step_00000004.tmp.deleting", "step_00000006.tmp", "step_00000006.tmp.deleting",
    ]  # fmt: skip
    remove_debris(tmp_path)
    assert list(tmp_path.iterdir()) == []


def _load_on_each_rank(rank: int, world: int, directory: str) -> str:
    try:
        load_checkpoint(directory, model=nn.Linear(4, 4))
    except CheckpointError as error:
        return str(error)
    return "loaded"


def test_a_manifest_file_name_too_long_for_the_filesystem_is_one_line_on_every_rank(tmp_path):
    checkpoint = save_checkpoint(tmp_path, 1, model=nn.Linear(4, 4))
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    name = "z" * (os.pathconf(tmp_path, "PC_NAME_MAX") + 1)  # sorts last: rank 1 verifies it
    manifest["files"][name] = {"bytes": 1, "sha256": "0"}
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    messages = run_distributed(_load_on_each_rank, 2, str(tmp_path), timeout=120)
    for message in messages:
        assert "\n" not in message and "corrupt manifest: file name 'zzz" in message, message
