"""Gradient synchronisation under DP x EP (x TP), and clipping by the true global norm.

With ``data_count = dp * ep`` data streams (tensor-parallel ranks share one), each rank computing
the mean loss of its own micro-batch, the single-process gradient of the global batch is
``(1 / data_count) * sum_streams grad(loss_s)``:

- replicated parameters: DDP averages their gradients over the dense group (the ``dp * ep`` ranks
  with this rank's tp index; ``wrap_data_parallel``, with PyTorch's bf16/fp16 compression hooks as
  an option);
- expert parameters: after the backward all-to-all, a rank's expert gradient already sums the
  contributions of every rank in its EP group, so the gradient is the SUM over the
  expert-data-parallel group divided by ``dp * ep`` (not by the group size, and not averaged over
  the world: the bug DeepSpeed and Tutel shipped). ``ExpertGradReducer`` does this in flat buckets.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from moetrain._torch_compat import ddp_ignore_parameters
from moetrain.layers.experts import GroupedExperts, local_tensor
from moetrain.layers.router import TopKRouter
from moetrain.validation import require_positive_float

DDP_COMM_HOOKS = (None, "bf16", "fp16")


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The experts' parameters of every expert-parallel MoELayer (:func:`shard_experts` applied:
    its gradients sum its EP group's tokens); a MoELayer left whole is a replicated module."""
    from moetrain.layers.moe_layer import MoELayer

    return [
        p
        for m in model.modules()
        if isinstance(m, MoELayer) and m.parallel is not None
        for p in m.experts.parameters()
    ]


def dense_parameters(model: nn.Module) -> list[nn.Parameter]:
    experts = {id(p) for p in expert_parameters(model)}
    return [p for p in model.parameters() if id(p) not in experts]


def is_dtensor(tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def wrap_data_parallel(
    model: nn.Module, parallel, comm_hook: str | None = None, ignore=(), **ddp_options
) -> nn.Module:
    """DDP over the dense group for the plain replicated parameters only: experts are left to
    :class:`ExpertGradReducer`, DTensor parameters (split layers) and the parameters in ``ignore``
    to their own reduction. ``comm_hook``: None, "bf16" or "fp16" gradient compression. Returns
    ``model`` itself when the dense group has one rank. The routers' ``load_E`` counts are each
    rank's own (summed over ranks when the score biases are updated): DDP does not broadcast them
    from rank 0 before each forward as it does the other buffers."""
    if comm_hook not in DDP_COMM_HOOKS:
        raise ValueError(f"comm_hook must be one of {DDP_COMM_HOOKS}, got {comm_hook!r}")
    if parallel.data_count == 1:
        return model
    group = parallel.dense_group
    if comm_hook == "bf16" and dist.get_backend(group) != "nccl":
        raise ValueError(
            f"comm_hook 'bf16' uses PyTorch's bf16_compress_hook, which needs the nccl backend; this run "
            f"uses {dist.get_backend(group)!r}: use comm_hook='fp16' or None"
        )
    skipped = {id(p) for p in expert_parameters(model)} | {id(p) for p in ignore}
    ignored = [name for name, p in model.named_parameters() if id(p) in skipped or is_dtensor(p)]
    if len(ignored) == len(list(model.parameters())):
        return model  # nothing left for DDP to synchronise
    ddp_ignore_parameters(model, ignored + _per_rank_buffers(model))
    ddp = DistributedDataParallel(model, process_group=group, **ddp_options)
    if comm_hook is not None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = default_hooks.bf16_compress_hook if comm_hook == "bf16" else default_hooks.fp16_compress_hook
        ddp.register_comm_hook(group, hook)
    return ddp


def _per_rank_buffers(model: nn.Module) -> list[str]:
    """Names of the buffers each rank keeps for itself: the routers' ``load_E`` (aux-loss-free
    balancing counts its own micro-batches' tokens; rank 0's copy broadcast over them would lose
    them)."""
    return [
        f"{name}.load_E" if name else "load_E"
        for name, module in model.named_modules()
        if isinstance(module, TopKRouter) and module.load_E is not None
    ]


class GradReducer:
    """Sums gradients over ``group`` and divides by ``divisor``, in flat buckets of about
    ``bucket_bytes`` (one all-reduce per bucket, not per tensor). DTensor gradients are reduced
    through their local shards (the same storage). An fp16 bucket is divided before the sum
    (``sum_r g_r / divisor``): its largest value is 65504, and the sum of 480 ranks' gradients
    overflows long before their mean does; wider dtypes divide after the sum."""

    def __init__(self, params: list[nn.Parameter], group, group_size: int, divisor: int,
                 bucket_bytes: int = 32 * 2**20):  # fmt: skip
        self.params = params
        self.group, self.group_size, self.divisor = group, group_size, divisor
        self.bucket_bytes = bucket_bytes

    def _buckets(self, grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        buckets, current, size = [], [], 0
        for grad in grads:
            if current and (
                size + grad.numel() * grad.element_size() > self.bucket_bytes
                or grad.dtype != current[0].dtype
                or grad.device != current[0].device
            ):
                buckets.append(current)
                current, size = [], 0
            current.append(grad)
            size += grad.numel() * grad.element_size()
        return buckets + ([current] if current else [])

    @torch.no_grad()
    def reduce(self) -> None:
        grads = [local_tensor(p.grad) for p in self.params if p.grad is not None]
        scale = 1.0 / self.divisor
        if self.group_size == 1:
            for grad in grads:
                grad.mul_(scale)
            return
        for bucket in self._buckets(grads):
            flat = torch.cat([grad.reshape(-1) for grad in bucket])
            divide_first = flat.dtype == torch.float16
            if divide_first:
                flat.mul_(scale)
            dist.all_reduce(flat, group=self.group)
            if not divide_first:
                flat.mul_(scale)
            pieces = flat.split([grad.numel() for grad in bucket])
            for grad, reduced in zip(bucket, pieces, strict=True):
                grad.copy_(reduced.view_as(grad))


class ExpertGradReducer(GradReducer):
    """Sums expert gradients over the expert-data-parallel group and divides by the number of
    data streams ``dp * ep``, in flat buckets of about ``bucket_bytes``."""

    def __init__(self, model: nn.Module, parallel, bucket_bytes: int = 32 * 2**20):
        super().__init__(
            expert_parameters(model), parallel.expert_dp_group, parallel.expert_dp_size, parallel.data_count,
            bucket_bytes,
        )  # fmt: skip
        self.parallel = parallel


def shard_count(tensor: torch.Tensor) -> int:
    """Into how many distinct pieces a DTensor is cut (the product of the sizes of the mesh
    dimensions it is sharded over); 1 for a plain tensor or a replicated DTensor."""
    if not is_dtensor(tensor):
        return 1
    count = 1
    for dim, placement in enumerate(tensor.placements):
        if not (placement.is_replicate() or placement.is_partial()):  # Shard, and FSDP+TP's strided shard
            count *= tensor.device_mesh.size(dim)
    return count


def expert_shares(model: nn.Module) -> dict[int, int]:
    """``{id(param): total_experts / local experts}`` of every expert parameter: into how many
    slices its layer's experts are cut (the EP size for a sharded layer, 1 for a full one)."""
    shares = {}
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            for param in module.parameters(recurse=False):
                shares[id(param)] = module.total_experts // module.num_experts
    return shares


@torch.no_grad()
def global_grad_norm(model: nn.Module, parallel=None) -> torch.Tensor:
    """L2 norm of the full model's gradient, each element counted once, whatever its layout:
    ``sqrt(sum_ranks sum_p local_sumsq(p) / replication(p))`` in one fp64 all-reduce over the
    world, where ``replication(p) = world / pieces(p)`` (``world``: the ranks of one pipeline stage,
    each stage's parameters being its own) and ``pieces`` is the number of distinct
    slices ``p`` is cut into (expert slices over the EP group times DTensor shards; 1 for a plain
    replicated tensor). Squares are summed in fp64 straight from each gradient's dtype (an fp64
    gradient is never rounded to fp32 first); the norm is an fp64 scalar. Call after the
    gradients are synchronised (equal on every rank holding the same piece)."""
    device = local_tensor(next(model.parameters())).device  # NCCL reduces device tensors only
    ranks = 1 if parallel is None else parallel.world_size
    world = ranks // getattr(parallel, "pp_size", 1)  # the ranks of one pipeline stage hold its parameters
    shares = expert_shares(model)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for param in model.parameters():
        if param.grad is None:
            continue
        grad = local_tensor(param.grad.detach())
        squares = torch.linalg.vector_norm(grad, dtype=torch.float64) ** 2
        pieces = shares.get(id(param), 1) * shard_count(param.grad)
        total += squares.to(device) * (pieces / world) if pieces != world else squares.to(device)
    if ranks > 1:
        dist.all_reduce(total)
    return torch.sqrt(total)


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, parallel=None) -> torch.Tensor:
    """Scales every gradient by ``min(1, max_norm / (norm + 1e-6))`` with the true global norm;
    returns the norm before clipping."""
    require_positive_float("max_norm", max_norm)
    norm = global_grad_norm(model, parallel)
    scale_grads_(model, (max_norm / (norm + 1e-6)).clamp(max=1.0))
    return norm


@torch.no_grad()
def scale_grads_(model: nn.Module, factor: torch.Tensor) -> None:
    """Multiplies every gradient (each DTensor's local shard) by the scalar tensor ``factor``."""
    for param in model.parameters():
        if param.grad is not None:
            grad = local_tensor(param.grad)
            grad.mul_(factor.to(grad.device, grad.dtype))
