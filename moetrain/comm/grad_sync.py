"""Gradient synchronisation under DP x EP, and clipping by the true global norm.

With W ranks each computing the mean loss of its own micro-batch, the single-process gradient of
the global batch is ``(1/W) * sum_r grad(loss_r)``:

- dense parameters: every rank holds them; DDP averages their gradients over the world
  (``wrap_data_parallel``, with PyTorch's bf16/fp16 compression hooks as an option);
- expert parameters: after the backward all-to-all, a rank's expert gradient already sums the
  contributions of every rank in its EP group, so the gradient is the SUM over the
  expert-data-parallel group divided by W (not by the group size, and not averaged over the world:
  the bug DeepSpeed and Tutel shipped). ``ExpertGradReducer`` does this in flat buckets.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from moetrain.layers.experts import GroupedExperts
from moetrain.validation import require_positive_float

DDP_COMM_HOOKS = (None, "bf16", "fp16")


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters of every GroupedExperts module (sharded over the EP group)."""
    return [p for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()]


def dense_parameters(model: nn.Module) -> list[nn.Parameter]:
    experts = {id(p) for p in expert_parameters(model)}
    return [p for p in model.parameters() if id(p) not in experts]


def wrap_data_parallel(model: nn.Module, parallel, comm_hook: str | None = None, **ddp_options) -> nn.Module:
    """DDP over the data-parallel group for the dense parameters only (experts are left to
    :class:`ExpertGradReducer`). ``comm_hook``: None, "bf16" or "fp16" gradient compression."""
    if comm_hook not in DDP_COMM_HOOKS:
        raise ValueError(f"comm_hook must be one of {DDP_COMM_HOOKS}, got {comm_hook!r}")
    if parallel.world_size == 1:
        return model
    if comm_hook == "bf16" and dist.get_backend(parallel.dp_group) != "nccl":
        raise ValueError(
            f"comm_hook 'bf16' uses PyTorch's bf16_compress_hook, which needs the nccl backend; this run "
            f"uses {dist.get_backend(parallel.dp_group)!r}: use comm_hook='fp16' or None"
        )
    expert_ids = {id(p) for p in expert_parameters(model)}
    ignored = [name for name, p in model.named_parameters() if id(p) in expert_ids]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    ddp = DistributedDataParallel(model, process_group=parallel.dp_group, **ddp_options)
    if comm_hook is not None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = default_hooks.bf16_compress_hook if comm_hook == "bf16" else default_hooks.fp16_compress_hook
        ddp.register_comm_hook(parallel.dp_group, hook)
    return ddp


class ExpertGradReducer:
    """Sums expert gradients over the expert-data-parallel group and divides by the world size,
    in flat buckets of about ``bucket_bytes`` (one all-reduce per bucket, not per tensor)."""

    def __init__(self, model: nn.Module, parallel, bucket_bytes: int = 32 * 2**20):
        self.parallel = parallel
        self.params = expert_parameters(model)
        self.bucket_bytes = bucket_bytes

    def _buckets(self, grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        buckets, current, size = [], [], 0
        for grad in grads:
            if current and (
                size + grad.numel() * grad.element_size() > self.bucket_bytes
                or grad.dtype != current[0].dtype
            ):
                buckets.append(current)
                current, size = [], 0
            current.append(grad)
            size += grad.numel() * grad.element_size()
        return buckets + ([current] if current else [])

    @torch.no_grad()
    def reduce(self) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        scale = 1.0 / self.parallel.world_size
        if self.parallel.expert_dp_size == 1:
            for grad in grads:
                grad.mul_(scale)
            return
        for bucket in self._buckets(grads):
            flat = torch.cat([grad.reshape(-1) for grad in bucket])
            dist.all_reduce(flat, group=self.parallel.expert_dp_group)
            flat.mul_(scale)
            pieces = flat.split([grad.numel() for grad in bucket])
            for grad, reduced in zip(bucket, pieces, strict=True):
                grad.copy_(reduced.view_as(grad))


@torch.no_grad()
def global_grad_norm(model: nn.Module, parallel=None) -> torch.Tensor:
    """L2 norm of the full model's gradient, each parameter counted once: dense gradients (equal
    on every rank after DDP) locally, expert gradients summed over the EP group (which holds every
    expert exactly once). Squares are summed in fp64 straight from each gradient's dtype (an fp64
    gradient is never rounded to fp32 first); the norm is an fp64 scalar. Call after the
    gradients are synchronised."""

    device = next(model.parameters()).device  # NCCL reduces device tensors only

    def sum_of_squares(params):
        grads = [p.grad.detach() for p in params if p.grad is not None]
        if not grads:
            return torch.zeros((), dtype=torch.float64, device=device)
        return sum(torch.linalg.vector_norm(g, dtype=torch.float64) ** 2 for g in grads)

    dense = sum_of_squares(dense_parameters(model))
    expert = sum_of_squares(expert_parameters(model))
    if parallel is not None and parallel.ep_size > 1:
        expert = expert.clone()
        dist.all_reduce(expert, group=parallel.ep_group)
    return torch.sqrt(dense + expert)


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, parallel=None) -> torch.Tensor:
    """Scales every gradient by ``min(1, max_norm / (norm + 1e-6))`` with the true global norm;
    returns the norm before clipping."""
    require_positive_float("max_norm", max_norm)
    norm = global_grad_norm(model, parallel)
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norm)
    return norm
