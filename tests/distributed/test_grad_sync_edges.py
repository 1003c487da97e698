"""Gradient synchronisation edges on 2 gloo ranks, in fp64 against one process: experts shared
between MoE layers under ep 2, a gradient present on one rank only (expert reducer and DDP), and
the experts trained alone (every dense parameter frozen)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetrain import MoEConfig, MoELayer, ParallelContext, parallelize
from tests.helpers.dist_utils import run_distributed

VOCAB, D_MODEL, E = 32, 8, 4
CFG = MoEConfig(
    d_model=D_MODEL,
    d_ff=12,
    num_experts=E,
    top_k=2,
    capacity_factor=None,
    aux_loss_coef=0.0,
    router_jitter=0.0,
)


class Net(nn.Module):
    """Embedding, two MoE layers (sharing one experts module when ``shared``), an optional dense
    ``side`` layer, a head."""

    def __init__(self, shared: bool = False):
        super().__init__()
        torch.manual_seed(5)
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.moe1, self.moe2 = MoELayer(CFG), MoELayer(CFG)
        if shared:
            self.moe2.experts = self.moe1.experts
        self.side = nn.Linear(D_MODEL, D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)
        self.use_side = True

    def forward(self, tokens):
        x = self.embed(tokens)
        x = x + self.moe1(x)
        x = x + self.moe2(x)
        if self.use_side:
            x = torch.tanh(self.side(x))
        return self.head(x)


def _batch(count: int):
    tokens = torch.randint(0, VOCAB, (count, 7), generator=torch.Generator().manual_seed(3))
    return tokens[:, :-1], tokens[:, 1:]


def _loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _one_process_grads(
    rows: slice, shared: bool = False, frozen_dense: bool = False
) -> dict[str, torch.Tensor]:
    """The gradients of one process on ``rows`` of the batch (fp64, as the ranks run)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = Net(shared).double()
        _freeze_dense(model, frozen_dense)
        inputs, targets = _batch(8)
        _loss(model(inputs[rows]), targets[rows]).backward()
    finally:
        torch.set_default_dtype(default)
    return {n: p.grad for n, p in model.named_parameters(remove_duplicate=False) if p.grad is not None}


def _freeze_dense(model: nn.Module, frozen: bool) -> None:
    if frozen:
        for name, param in model.named_parameters():
            param.requires_grad_(".experts." in name)


def _train_step(rank: int, world: int, ep: int, shared: bool, frozen_dense: bool):
    torch.set_default_dtype(torch.float64)
    parallel = ParallelContext(ep_size=ep, local_world_size=world)
    model = Net(shared).double()
    _freeze_dense(model, frozen_dense)
    trained = parallelize(model, parallel)
    inputs, targets = _batch(8)
    _loss(trained(inputs[3 * rank : 3 * rank + 3]), targets[3 * rank : 3 * rank + 3]).backward()
    trained.reduce_gradients()
    local = parallel.local_experts(E)
    grads = {
        n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False) if p.grad is not None
    }
    return model.moe2.experts is model.moe1.experts, grads, (local.start, local.stop)


def _check_against_one_process(results, reference, ep: int) -> None:
    for rank, (_, grads, (start, stop)) in enumerate(results):
        assert sorted(grads) == sorted(reference), (rank, sorted(grads))
        for name, grad in grads.items():
            want = reference[name][start:stop] if ".experts." in name and ep > 1 else reference[name]
            error = float((grad - want).abs().max() / want.abs().max())
            assert error < 1e-12, (rank, name, error)


def test_experts_shared_between_layers_stay_shared_and_train_as_in_one_process_under_ep2():
    """Each layer was given its own slice (untied, halves of the gradient apart); tied again after
    sharding, the reducer divided the shared tensors twice."""
    results = run_distributed(_train_step, 2, 2, True, False, timeout=120)
    assert all(shared for shared, _, _ in results)
    _check_against_one_process(results, _one_process_grads(slice(0, 6), shared=True), ep=2)


def test_the_experts_trained_alone_under_dp2():
    """Every dense parameter frozen: DistributedDataParallel refused the model ("not needed when a
    module doesn't have any parameter that requires a gradient") and parallelize failed."""
    results = run_distributed(_train_step, 2, 1, False, True, timeout=120)
    _check_against_one_process(results, _one_process_grads(slice(0, 6), frozen_dense=True), ep=1)


def _missing_on_rank_1(rank: int, world: int):
    """Expert parameters (``GradReducer``, one bucket and one per tensor) with a gradient on rank 0
    only, then the next collective of a step (the global norm's all-reduce)."""
    import torch.distributed as dist

    from moetrain.grad_sync import GradReducer

    results = []
    for bucket_bytes in (2**20, 8):
        a, b = (
            nn.Parameter(torch.zeros(4, dtype=torch.float64)),
            nn.Parameter(torch.zeros(2, dtype=torch.float64)),
        )
        if rank == 0:
            a.grad = torch.full((4,), 3.0, dtype=torch.float64)
        b.grad = torch.full((2,), 10.0 * (rank + 1), dtype=torch.float64)
        GradReducer([a, b], dist.group.WORLD, world, world, bucket_bytes=bucket_bytes).reduce()
        after = torch.ones((), dtype=torch.float64)
        dist.all_reduce(after)
        results.append((a.grad.tolist(), b.grad.tolist(), float(after)))
    return results


def test_a_gradient_present_on_one_rank_only_is_averaged_with_zeros():
    """The buckets were built from the gradients present: the ranks all-reduced different sizes
    (gloo aborted) or different counts of buckets (a hang)."""
    for per_rank in run_distributed(_missing_on_rank_1, 2, timeout=60):
        assert per_rank == [([1.5] * 4, [15.0] * 2, 2.0)] * 2


def _dense_skipped_on_rank_1(rank: int, world: int):
    torch.set_default_dtype(torch.float64)
    parallel = ParallelContext(ep_size=1, local_world_size=world)
    model = Net().double()
    model.use_side = rank == 0  # e.g. a modality absent from rank 1's batches
    trained = parallelize(model, parallel, find_unused_parameters=True)
    inputs, targets = _batch(8)
    for step in range(2):
        model.zero_grad(set_to_none=True)
        rows = slice(4 * step + 2 * rank, 4 * step + 2 * rank + 2)
        _loss(trained(inputs[rows]), targets[rows]).backward()
        trained.reduce_gradients()
    return model.side.weight.grad.clone()


def test_a_dense_parameter_one_rank_skips_needs_find_unused_parameters_and_gets_their_mean():
    """parallelize had no way to ask DDP for find_unused_parameters: DDP waited for the skipped
    parameter's gradient (an error at the next step, or a hang)."""
    grads = run_distributed(_dense_skipped_on_rank_1, 2, timeout=60)
    want = _one_process_grads(slice(4, 6))["side.weight"] / 2  # rank 0's second step; rank 1 adds nothing
    for grad in grads:
        torch.testing.assert_close(grad, want, rtol=1e-12, atol=0)
