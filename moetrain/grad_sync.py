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
    its gradients sum its EP group's tokens), each once; a MoELayer left whole is a replicated
    module."""
    from moetrain.layers.moe_layer import MoELayer

    params = {}  # each once: layers may share one experts module (weights tied across layers)
    for m in model.modules():
        if isinstance(m, MoELayer) and m.parallel is not None:
            for p in m.experts.parameters():
                params.setdefault(id(p), p)
    return list(params.values())


def dense_parameters(model: nn.Module) -> list[nn.Parameter]:
    experts = {id(p) for p in expert_parameters(model)}
    return [p for p in model.parameters() if id(p) not in experts]


def is_dtensor(tensor) -> bool:
    if type(tensor) in (torch.Tensor, nn.Parameter):  # the common case, without the import
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def wrap_data_parallel(
    model: nn.Module, parallel, comm_hook: str | None = None, ignore=(), **ddp_options
) -> nn.Module:
    """DDP over the dense group for the plain replicated parameters only: experts are left to
    :class:`ExpertGradReducer`, DTensor parameters (split layers) and the parameters in ``ignore``
    to their own reduction. ``comm_hook``: None, "bf16" or "fp16" gradient compression;
    ``ddp_options``: passed to ``DistributedDataParallel`` (e.g. ``find_unused_parameters=True``
    when a forward may leave a parameter unused on some ranks). Returns ``model`` itself when the
    dense group has one rank, or when no parameter left to DDP requires a gradient (the experts
    fine-tuned alone: nothing to average, and DDP refuses such a module). The routers' ``load_E``
    counts are each rank's own (summed over ranks when the score biases are updated): DDP does not
    broadcast them from rank 0 before each forward as it does the other buffers."""
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
    ignored, trained = [], False
    for name, p in model.named_parameters():
        if id(p) in skipped or is_dtensor(p):
            ignored.append(name)
        else:
            trained = trained or p.requires_grad
    if not trained:
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
    ``bucket_bytes`` (one all-reduce per bucket, not per tensor). The buckets are laid out once,
    here, over the parameters of ``params`` that require a gradient (each once, in order; a new
    bucket where the dtype or device changes), so every rank runs the same all-reduces whatever
    gradients it holds: with ``group_size > 1``, a parameter whose gradient is None on this rank
    (its forward did not use it) contributes zeros and is given the reduced gradient (zeros when no
    rank had one); with ``group_size`` 1 nothing is communicated and a None gradient stays None.
    DTensor gradients are reduced through their local shards (the same storage). An fp16 bucket
    is divided before the sum (``sum_r g_r / divisor``): its largest value is 65504, and the sum of
    480 ranks' gradients overflows long before their mean does; wider dtypes divide after the
    sum."""

    def __init__(self, params: list[nn.Parameter], group, group_size: int, divisor: int,
                 bucket_bytes: int = 32 * 2**20):  # fmt: skip
        self.params = list({id(p): p for p in params if p.requires_grad}.values())
        self.group, self.group_size, self.divisor = group, group_size, divisor
        self.bucket_bytes = bucket_bytes
        self.buckets = self._buckets(self.params)
        self.dtensors = [any(is_dtensor(p) for p in bucket) for bucket in self.buckets]

    def _buckets(self, params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
        buckets, current, size, kind = [], [], 0, None
        for param in params:
            local = local_tensor(param)
            nbytes = local.numel() * local.element_size()
            if current and (size + nbytes > self.bucket_bytes or (local.dtype, local.device) != kind):
                buckets.append(current)
                current, size = [], 0
            current.append(param)
            size, kind = size + nbytes, (local.dtype, local.device)
        return buckets + ([current] if current else [])

    @torch.no_grad()
    def reduce(self) -> None:
        scale = 1.0 / self.divisor
        if self.group_size == 1:
            for param in self.params:
                if param.grad is not None:
                    local_tensor(param.grad).mul_(scale)
            return
        for bucket, dtensors in zip(self.buckets, self.dtensors, strict=True):
            grads = [param.grad for param in bucket]
            if dtensors or any(grad is None for grad in grads):
                grads = [_grad_or_zeros(param) for param in bucket]
            flat = torch.cat([grad.reshape(-1) for grad in grads])
            divide_first = flat.dtype == torch.float16
            if divide_first:
                flat.mul_(scale)
            dist.all_reduce(flat, group=self.group)
            if not divide_first:
                flat.mul_(scale)
            for grad, reduced in zip(grads, flat.split([grad.numel() for grad in grads]), strict=True):
                grad.copy_(reduced.view_as(grad))


def _grad_or_zeros(param: nn.Parameter) -> torch.Tensor:
    """The local part of ``param``'s gradient; a zero gradient first when it has none (unused by
    this rank's forward: it adds nothing to the sum)."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return local_tensor(param.grad)


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
    replicated tensor). The gradients are grouped by (device, dtype, pieces) and each group's
    squares summed at once (:func:`_sum_of_squares`: fp64 and fp32 gradients in their own dtype,
    so an fp64 gradient is never rounded to fp32; 16-bit ones per tensor in fp32), the groups'
    sums added in fp64; the norm is an fp64 scalar. Call after the gradients are synchronised
    (equal on every rank holding the same piece)."""
    return _global_norm(model, parallel, _gradients(model)[0])


def _gradients(
    model: nn.Module,
) -> tuple[dict[tuple, list[torch.Tensor]], list[nn.Parameter], list[torch.Tensor]]:
    """One pass over ``model``'s gradients: ``{(device, dtype, pieces): [local gradients]}`` (see
    :func:`global_grad_norm`), the parameters whose gradient is a plain tensor, and the local
    shards of the DTensor gradients."""
    shares = expert_shares(model)
    groups, plain, split = {}, [], []
    for param in model.parameters():
        grad = param.grad
        if grad is None:
            continue
        pieces = shares.get(id(param), 1)
        if is_dtensor(grad):
            pieces *= shard_count(grad)
            grad = local_tensor(grad)
            split.append(grad)
        else:
            plain.append(param)
        groups.setdefault((grad.device, grad.dtype, pieces), []).append(grad)
    return groups, plain, split


def _global_norm(model: nn.Module, parallel, groups: dict[tuple, list[torch.Tensor]]) -> torch.Tensor:
    device = local_tensor(next(model.parameters())).device  # NCCL reduces device tensors only
    ranks = 1 if parallel is None else parallel.world_size
    world = ranks // getattr(parallel, "pp_size", 1)  # the ranks of one pipeline stage hold its parameters
    total = torch.zeros((), dtype=torch.float64, device=device)
    for (_, _, pieces), grads in groups.items():
        squares = _sum_of_squares(grads).to(device)
        total += squares * (pieces / world) if pieces != world else squares
    if ranks > 1:
        dist.all_reduce(total)
    return torch.sqrt(total)


def _sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """``sum_g ||g||^2`` of tensors of one device and dtype, an fp64 scalar. fp64 / fp32: torch's
    foreach norm in their own dtype (a few kernels for the whole list), squared in fp64; 16-bit:
    each tensor's norm in fp32 (an fp16 norm overflows past 65504, and a bf16 one keeps 3
    digits), squared and summed in fp64."""
    if grads[0].dtype in (torch.float64, torch.float32):
        return torch.nn.utils.get_total_norm(grads, 2.0).double().square()
    norms = torch.stack([torch.linalg.vector_norm(grad, dtype=torch.float32) for grad in grads])
    return norms.double().square().sum()


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, parallel=None) -> torch.Tensor:
    """Scales every gradient by ``min(1, max_norm / (norm + 1e-6))`` with the true global norm
    (:func:`global_grad_norm`; plain gradients by ``torch.nn.utils.clip_grads_with_norm_``, a
    foreach multiply per device and dtype, DTensor gradients through their local shards); returns
    the norm before clipping."""
    require_positive_float("max_norm", max_norm)
    groups, plain, split = _gradients(model)
    norm = _global_norm(model, parallel, groups)
    torch.nn.utils.clip_grads_with_norm_(plain, max_norm, norm)
    factor = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    factors = {}
    for grad in split:
        key = (grad.device, grad.dtype)
        if key not in factors:
            factors[key] = factor.to(grad.device, grad.dtype)
        grad.mul_(factors[key])
    return norm
