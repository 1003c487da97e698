"""Checkpoints across strategies: a tp2 x ep2 checkpoint (world 4, split layers as DTensors, experts
by global index) loads at world 1 and at ep4 (world 4, tp 1) with equal weights and optimizer
state, and a world-1 checkpoint loads into tp2 x ep2; FSDP2 (sharded DTensors, experts by the rows
each rank holds) round-trips too."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_lm import MoETransformerLM, default_lm_strategy, lm_loss
from moetrain import ParallelConfig, ParallelContext, parallelize
from moetrain.checkpoint import load_checkpoint, save_checkpoint
from tests.distributed.test_parallelize import LM, _tokens, full
from tests.helpers.dist_utils import run_distributed


def _train_one_step(trained, parallel, model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    inputs, targets = _tokens(parallel.data_index if parallel is not None else 0)
    out = trained(inputs)
    with trained.loss_context(out):
        lm_loss(out, targets).backward()
    trained.reduce_gradients()
    optimizer.step()
    return optimizer


def _state(model, optimizer, parallel) -> dict[str, torch.Tensor]:
    """Every weight and Adam moment as this rank holds it, made whole where it is a DTensor;
    experts keyed by global index."""
    values = {}
    for name, param in model.named_parameters():
        tensors = {"w": param.detach()}
        tensors.update({k: v for k, v in optimizer.state[param].items() if k != "step"})
        for key, value in tensors.items():
            value = full(value)
            if ".experts." in name:
                first = param_first_expert(model, name)
                for row in range(value.shape[0]):
                    values[f"{key}/{name}/{first + row}"] = value[row].clone()
            else:
                values[f"{key}/{name}"] = value.clone()
    return values


def param_first_expert(model, name: str) -> int:
    module = model.get_submodule(name.rpartition(".")[0])
    return module.first_expert


def save_worker(rank, world, directory, ep, tp, replica, lm=LM):
    parallel = ParallelContext(ParallelConfig(ep_size=ep, tp_size=tp, replica=replica))
    torch.manual_seed(0)
    model = MoETransformerLM(lm, seed=3)
    trained = parallelize(model, parallel, default_lm_strategy(lm, tp))
    optimizer = _train_one_step(trained, parallel, model)
    save_checkpoint(directory, 1, model=model, optimizer=optimizer, parallel=parallel)
    return _state(model, optimizer, parallel)


def load_worker(rank, world, directory, ep, tp, replica, lm=LM):
    parallel = ParallelContext(ParallelConfig(ep_size=ep, tp_size=tp, replica=replica))
    torch.manual_seed(9)  # other weights: everything must come from the checkpoint
    model = MoETransformerLM(lm, seed=4)
    trained = parallelize(model, parallel, default_lm_strategy(lm, tp))
    optimizer = _train_one_step(trained, parallel, model)  # other optimizer state, to be replaced
    load_checkpoint(directory, model=model, optimizer=optimizer, parallel=parallel)
    return _state(model, optimizer, parallel)


def _merged(per_rank: list[dict]) -> dict:
    merged = {}
    for state in per_rank:
        for key, value in state.items():
            if key in merged:  # replicated entries: equal on every rank holding them
                torch.testing.assert_close(merged[key], value, rtol=0, atol=0)
            merged[key] = value
    return merged


def _assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_tp2_ep2_checkpoint_loads_at_world1_and_ep4_and_world1_loads_into_tp2_ep2(tmp_path):
    saved = _merged(run_distributed(save_worker, 4, str(tmp_path / "tp2ep2"), 2, 2, "ddp"))
    assert any(k.startswith("exp_avg/") for k in saved)

    # world 1: plain tensors, every expert
    torch.manual_seed(9)
    model = MoETransformerLM(LM, seed=4)
    single = parallelize(model, ParallelContext(), default_lm_strategy(LM))
    optimizer = _train_one_step(single, None, model)
    load_checkpoint(tmp_path / "tp2ep2", model=model, optimizer=optimizer)
    _assert_same(_state(model, optimizer, None), saved)

    # world 4 at ep 4, tp 1: the experts spread over four ranks, dense layers whole
    _assert_same(_merged(run_distributed(load_worker, 4, str(tmp_path / "tp2ep2"), 4, 1, "ddp")), saved)

    # a world-1 checkpoint into tp2 x ep2
    save_checkpoint(tmp_path / "world1", 1, model=model, optimizer=optimizer)
    world1 = _state(model, optimizer, None)
    _assert_same(_merged(run_distributed(load_worker, 4, str(tmp_path / "world1"), 2, 2, "ddp")), world1)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_fsdp_checkpoint_round_trips_and_loads_at_world1(tmp_path):
    """dp2 x ep2 under FSDP2: dense DTensors sharded over ep (HSDP), each expert weight sharded over
    dp (each rank saves the expert rows it holds); the checkpoint loads back into the same layout
    and into one process."""
    saved = _merged(run_distributed(save_worker, 4, str(tmp_path / "fsdp"), 2, 1, "fsdp"))
    _assert_same(_merged(run_distributed(load_worker, 4, str(tmp_path / "fsdp"), 2, 1, "fsdp")), saved)
    torch.manual_seed(9)
    model = MoETransformerLM(LM, seed=4)
    single = parallelize(model, ParallelContext(), default_lm_strategy(LM))
    optimizer = _train_one_step(single, None, model)
    load_checkpoint(tmp_path / "fsdp", model=model, optimizer=optimizer)
    _assert_same(_state(model, optimizer, None), saved)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_fsdp_ranks_holding_no_expert_rows_round_trip_and_load_at_world1(tmp_path):
    """World 4 under FSDP2 at ep 1 with 2 experts: each expert weight has 2 rows over 4 shards, so
    ranks 2 and 3 hold none (they take the state keys and the step from expert 0's entries). The
    checkpoint loads back into the same layout and into one process, bit for bit."""
    lm = dataclasses.replace(LM, moe=dataclasses.replace(LM.moe, num_experts=2, top_k=1))
    directory = str(tmp_path / "fsdp_rowless")
    saved = _merged(run_distributed(save_worker, 4, directory, 1, 1, "fsdp", lm, timeout=300))
    assert any(k.startswith("exp_avg/") and ".experts." in k for k in saved)
    _assert_same(_merged(run_distributed(load_worker, 4, directory, 1, 1, "fsdp", lm, timeout=300)), saved)
    torch.manual_seed(9)
    model = MoETransformerLM(lm, seed=4)
    single = parallelize(model, ParallelContext(), default_lm_strategy(lm))
    optimizer = _train_one_step(single, None, model)
    load_checkpoint(directory, model=model, optimizer=optimizer)
    _assert_same(_state(model, optimizer, None), saved)
