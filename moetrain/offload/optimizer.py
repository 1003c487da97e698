"""``OffloadOptimizer``: Adam / AdamW whose fp32 master weights and moments live in host memory while
the model keeps its weights, in their training dtype (fp32, bf16 or fp16), on its device (CPU or
one CUDA GPU). Apply groups: :mod:`moetrain.offload.apply_groups`; the device <-> host copies of a
step: :mod:`moetrain.offload.transfers`; the delayed update (worker thread, pending weights):
:mod:`moetrain.offload.delayed_update`; ``state_dict`` / ``load_state_dict``:
:mod:`moetrain.offload.optimizer_state`; ``GroupwiseApply``: :mod:`moetrain.offload.groupwise`.

Legend: N elements of one flat slice of a parameter (a *segment*); P parameters; G apply groups.

Apply groups. The parameters of all param groups, in order, are flattened and concatenated; the
concatenation (``total`` elements) is cut into contiguous element ranges, so a large parameter (an
expert weight ``[E, D, F]``) may be split between two groups:

    num_apply_groups = G:   group k holds elements [k * total // G, (k + 1) * total // G)
    group_bytes = B:        groups of B // 4 elements (B bytes of fp32 master weight), the last shorter

Per element, host memory holds 12 bytes of state (fp32 ``exp_avg``, ``exp_avg_sq``, ``master``),
except that an fp32 model on the CPU is its own master (8 bytes). One step, per apply group:
gradient slices -> host, one fused C++ Adam pass (``adam_step_multi_``: master, moments and the
copy of the updated weight in the model's dtype), the copy -> the model's parameter.

Temporary memory of a step (``staging``, pinned host memory): nothing for a CPU model (the kernel
reads the gradient in place and writes the weight copy straight into the parameter); for a CUDA
model, per group ``N * (grad bytes + weight bytes)`` in each of two slots, so that the copies of one
group (on two side streams, one per direction) overlap the CPU step of the next. Only the staging
is pinned: masters and moments never cross PCIe during a step, so they stay in pageable memory
(page-locked memory is scarce and slow to allocate).

Overlap (``overlap="delayed"``, ZeRO-Offload's one-step delayed parameter update, Ren et al. 2021):
after ``overlap_after_steps`` exact updates, ``step()`` of step t writes the update of step t - 1
into the parameters, copies step t's gradients to a host snapshot and returns; the C++ Adam of step t
runs on a worker thread while the device runs step t + 1's forward and backward, and its weights are
written at step t + 1's ``step()`` (before step t + 2's forward). Host memory: one more gradient
copy and one weight copy of every parameter (``P * (grad bytes + weight bytes)``, pinned for CUDA)
instead of the two groups of staging.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch

from moetrain.offload.apply_groups import MASTER_BYTES_PER_ELEMENT, check_apply_groups, plan_apply_groups
from moetrain.offload.cpu_adam import GRAD_DTYPES, adam_step_multi_, group_hyperparameters
from moetrain.offload.delayed_update import DelayedUpdateMixin
from moetrain.offload.optimizer_state import OptimizerStateMixin, check_group_options, is_same_memory
from moetrain.offload.transfers import Segment, Transfers
from moetrain.validation import require_bool, require_choice, require_int

log = logging.getLogger("moetrain.offload.optimizer")

PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PARAM_DEVICE_TYPES = ("cpu", "cuda")
OVERLAP_MODES = ("none", "delayed")
# Keys a param group given to OffloadOptimizer may have (``initial_lr``: added by LR schedulers;
# ``amsgrad`` / ``maximize``: accepted only as False, for state dicts of torch's Adam).
PARAM_GROUP_KEYS = (
    "params",
    "param_names",
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "decoupled_weight_decay",
    "initial_lr",
    "amsgrad",
    "maximize",
)


class OffloadOptimizer(DelayedUpdateMixin, OptimizerStateMixin, torch.optim.Optimizer):
    """Adam / AdamW with fp32 master weights and moments in host memory, stepped group by group.

    The model's parameters (fp32, bf16 or fp16; contiguous; all on one device, the CPU or one CUDA
    GPU) stay where they are. Per parameter the state (torch's Adam keys plus ``master``) is, on
    the host: ``step`` (0-dim fp32 tensor), ``exp_avg``, ``exp_avg_sq`` and ``master`` (fp32, the
    parameter's shape). It is created at the parameter's first step from the parameter's values; for
    an fp32 CPU model ``master`` *is* the parameter (no second copy). From then on the optimizer owns
    the weights: each step writes ``master`` cast to the parameter's dtype into the parameter
    (round to nearest even), so the model's weights always equal the cast master.

    The update is ``torch.optim.AdamW`` (``adamw_mode=True``) or ``torch.optim.Adam`` (``False``,
    L2 decay) with ``foreach=False`` on the fp32 master, fed ``grad.float() / grad_scale``, up to
    float rounding (see ``moetrain.offload.cpu_adam``). Param groups take ``lr``, ``betas``,
    ``eps``, ``weight_decay`` and ``decoupled_weight_decay`` (torch's name of the mode); torch's LR
    schedulers work on ``param_groups`` as usual.

    Groups (see the module docstring): ``num_apply_groups`` equal element ranges or ranges of
    ``group_bytes`` bytes of fp32 master weight; neither means one group. For a CUDA model the
    temporary pinned host memory of a step is two groups' gradients and weight copies.

    fp16 loss scaling: pass the optimizer to ``torch.amp.GradScaler.step``. The class sets
    ``_step_supports_amp_scaling``, so the scaler checks every gradient for inf / NaN itself and
    hands ``found_inf`` and ``grad_scale`` to this optimizer as attributes instead of unscaling: a
    step with ``found_inf`` is skipped entirely (no state changes; ``scaler.update()`` then lowers the
    scale) and otherwise the division by ``grad_scale`` happens inside the fused pass. After an
    explicit ``scaler.unscale_(optimizer)`` (e.g. for clipping) the scaler passes no scale.

    Without a scaler nothing checks the gradients: non-finite ones are applied, as by torch's Adam.

    Gradients may be fp32, bf16 or fp16 on the parameter's device; a non-contiguous gradient is
    copied to a contiguous one first. Sparse gradients, AMSGrad and ``maximize`` are not supported.

    ``overlap="delayed"`` (ZeRO-Offload's delayed parameter update): the first
    ``overlap_after_steps`` updates are exact; from then on ``step()`` of step t (1) waits for the
    update of step t - 1 and writes its weights into the parameters, (2) copies step t's gradients
    into a host snapshot and snapshots the hyper-parameters (so an LR scheduler stepping afterwards
    changes the next update only), (3) starts the C++ Adam of step t on a worker thread and returns.
    The forward and backward of step t + 1 thus run on weights without step t's update::

        weights seen by step t + 1 = W_0 - U(g_1) - ... - U(g_{t-1})     (exact: ... - U(g_t))

    i.e. the weights after step t equal an exact optimizer's fed the gradients shifted by one step
    (``g_{t-1}`` at step t, nothing at the first delayed step). The worker reads only the snapshot
    and writes only the host state and a host weight copy; the parameters are written on the
    calling thread. A step skipped by the ``GradScaler`` (``found_inf``) still writes the pending
    update and starts none of its own; so does :meth:`apply_pending`, which a trainer calls when
    it skips a step itself (non-finite gradient norm) and at the end of training.

    ``state_dict()`` waits for the worker (masters and moments then hold every issued update) and
    records the update still to be written: each param's entry gets ``pending`` (0-dim tensor, 1.0
    when its weight lacks the last update). Saved with the model's (stale) weights, that is exactly
    the running state: ``load_state_dict()`` of a dict with ``pending`` 1.0 leaves those params as
    they are and writes their cast ``master`` at the next ``step()`` / ``apply_pending()`` (an
    optimizer with ``overlap="none"`` writes it at once), so resuming equals never stopping.
    """

    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
        *,
        num_apply_groups: int | None = None,
        group_bytes: int | None = None,
        overlap: str = "none",
        overlap_after_steps: int = 0,
    ) -> None:
        check_apply_groups(num_apply_groups, group_bytes)
        require_choice("OffloadOptimizer: overlap", overlap, OVERLAP_MODES)
        require_int("OffloadOptimizer: overlap_after_steps", overlap_after_steps, 0)
        self.overlap = overlap
        self.overlap_after_steps = overlap_after_steps
        self._reset_overlap()
        require_bool("OffloadOptimizer: adamw_mode", adamw_mode)
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "decoupled_weight_decay": adamw_mode,
        }
        check_group_options("OffloadOptimizer", defaults)
        self.num_apply_groups = num_apply_groups
        self.group_bytes = group_bytes
        self.device: torch.device | None = None  # of the model's parameters, set by add_param_group
        super().__init__(params, defaults)
        # Whether gradients and weight copies go through host staging buffers: always for a CUDA
        # model. (Tests set it on a CPU model, before the first step, to run that code path.)
        self._staged = self.device.type != "cpu"

    def __getstate__(self) -> dict[str, Any]:
        self.wait_pending()
        return {
            **super().__getstate__(),
            "num_apply_groups": self.num_apply_groups,
            "group_bytes": self.group_bytes,
            "device": self.device,
            "_staged": self._staged,
            "overlap": self.overlap,
            "overlap_after_steps": self.overlap_after_steps,
            "_pending": self._pending,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        pending = state.pop("_pending", {})
        state.setdefault("overlap", "none")
        state.setdefault("overlap_after_steps", 0)
        super().__setstate__(state)
        self._reset_overlap()
        self._pending = pending

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a param group after checking its options and that its params are contiguous fp32 /
        bf16 / fp16 tensors on the CPU or CUDA, on the same device as the other groups'."""
        index = len(self.param_groups)
        where = f"OffloadOptimizer param group {index}"
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        unknown = sorted(set(param_group) - set(PARAM_GROUP_KEYS))
        if unknown:
            raise ValueError(
                f"{where}: option {unknown[0]!r} is unknown; allowed: {', '.join(PARAM_GROUP_KEYS)}"
            )
        check_group_options(where, {**self.defaults, **param_group})
        device = self.device
        for i, param in enumerate(params):
            if not isinstance(param, torch.Tensor):
                raise ValueError(f"{where}: param {i} must be a tensor, got {type(param).__name__}")
            if param.dtype not in PARAM_DTYPES:
                raise ValueError(f"{where}: param {i} dtype must be one of {PARAM_DTYPES}, got {param.dtype}")
            if param.device.type not in PARAM_DEVICE_TYPES:
                raise ValueError(
                    f"{where}: param {i} device must be one of {PARAM_DEVICE_TYPES}, got {param.device}"
                )
            if device is not None and param.device != device:
                raise ValueError(
                    f"{where}: param {i} device must be {device} (the device of the params before it), "
                    f"got {param.device}"
                )
            device = param.device
            if not param.is_contiguous():
                raise ValueError(f"{where}: param {i} must be contiguous")
        super().add_param_group({**param_group, "params": params})
        self.device = device

    # -- step ---------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Updates every parameter that has a gradient; returns ``closure()``'s loss if given.

        Skipped (nothing changes) when a ``torch.amp.GradScaler`` reports inf / NaN gradients.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)  # set by GradScaler.step for this call only
        if found_inf is not None and float(found_inf) != 0.0:
            self.apply_pending()  # the skipped step skips its own update only
            return loss
        grad_scale = getattr(self, "grad_scale", None)
        grad_scale = 1.0 if grad_scale is None else float(grad_scale)

        for index, group in enumerate(self.param_groups):
            check_group_options(f"OffloadOptimizer param group {index}", group)
        self.apply_pending()
        flat_grads = self._flat_grads()
        if not flat_grads:
            return loss
        issued = max((int(state["step"].item()) for state in self.state.values() if state), default=0)
        delayed = self.overlap == "delayed" and issued >= self.overlap_after_steps
        if delayed and issued == self.overlap_after_steps:
            log.info("offload optimizer: update %d and later are delayed by one step", issued + 1)
        steps = {}
        for param in flat_grads:
            state = self.state[param]
            if not state:
                self._init_state(param)
            state["step"] += 1
            steps[param] = int(state["step"].item())

        if delayed:
            self._start_delayed(flat_grads, steps, grad_scale)
            return loss
        start = time.perf_counter()
        work = self._segments(flat_grads)
        if not work:  # only empty params have gradients
            return loss
        transfers = Transfers(work, staged=self._staged, device=self.device)
        try:
            pending = transfers.fetch(0)
            for i in range(len(work)):
                grads, copies = pending
                if i + 1 < len(work):
                    pending = transfers.fetch(i + 1)
                transfers.wait(i)
                self._adam(work[i], grads, copies, steps, grad_scale)
                transfers.write_back(i, copies)
        finally:
            transfers.finish()
        self.last_update_s = time.perf_counter() - start
        return loss

    def _flat_grads(self) -> dict[torch.Tensor, torch.Tensor]:
        """``{param: flat contiguous gradient}`` for the params that have one, in param-group order."""
        flat_grads = {}
        for index, group in enumerate(self.param_groups):
            for i, param in enumerate(group["params"]):
                grad = param.grad
                if grad is None:
                    continue
                where = f"OffloadOptimizer param group {index}: gradient of param {i}"
                if grad.is_sparse:
                    raise ValueError(f"{where} must be dense, got a sparse tensor")
                if grad.dtype not in GRAD_DTYPES:
                    raise ValueError(f"{where} dtype must be one of {GRAD_DTYPES}, got {grad.dtype}")
                if grad.device != param.device or grad.shape != param.shape:
                    raise ValueError(
                        f"{where} must have the param's device {param.device} and shape "
                        f"{tuple(param.shape)}, got {grad.device} and {tuple(grad.shape)}"
                    )
                flat_grads[param] = grad.detach().contiguous().view(-1)
        return flat_grads

    def _new_master(self, param: torch.Tensor) -> torch.Tensor:
        """The param itself for an fp32 CPU model (``overlap="none"``), else a new (uninitialised)
        fp32 host tensor (a delayed update must not write the weights the device is reading)."""
        if not self._staged and param.dtype == torch.float32 and self.overlap == "none":
            return param.detach()
        return torch.empty(param.shape, dtype=torch.float32)

    def _init_state(self, param: torch.Tensor) -> None:
        state = self.state[param]
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros(param.shape, dtype=torch.float32)
        state["exp_avg_sq"] = torch.zeros(param.shape, dtype=torch.float32)
        state["master"] = self._new_master(param)
        if not is_same_memory(state["master"], param):
            state["master"].copy_(param.detach())

    def _segments(self, flat_grads: dict[torch.Tensor, torch.Tensor]) -> list[list[Segment]]:
        """The apply groups of this step: segments of the params that have a gradient."""
        params, group_of = [], []
        for index, group in enumerate(self.param_groups):
            params.extend(group["params"])
            group_of.extend([index] * len(group["params"]))
        plan = plan_apply_groups(
            [param.numel() for param in params],
            num_apply_groups=self.num_apply_groups,
            group_numel=None if self.group_bytes is None else self.group_bytes // MASTER_BYTES_PER_ELEMENT,
        )
        work = []
        for segments in plan:
            group_work = [
                Segment(
                    group_index=group_of[i],
                    param=params[i],
                    start=start,
                    end=end,
                    grad_N=flat_grads[params[i]][start:end],
                    param_N=params[i].detach().view(-1)[start:end],
                )
                for i, start, end in segments
                if params[i] in flat_grads
            ]
            if group_work:
                work.append(group_work)
        return work

    def _adam(
        self,
        segments: list[Segment],
        grads: list[torch.Tensor],
        copies: list[torch.Tensor | None],
        steps: dict[torch.Tensor, int],
        grad_scale: float,
        hyper: list[dict] | None = None,
    ) -> None:
        """One fused C++ pass per param group over this apply group's segments (host tensors);
        ``hyper``: each param group's hyper-parameters (default: the groups' current ones)."""
        lists: dict[int, tuple[list, ...]] = defaultdict(lambda: ([], [], [], [], [], []))
        for seg, grad_N, copy_N in zip(segments, grads, copies, strict=True):
            state = self.state[seg.param]
            masters, seg_grads, exp_avgs, exp_avg_sqs, seg_steps, seg_copies = lists[seg.group_index]
            masters.append(state["master"].view(-1)[seg.start : seg.end])
            seg_grads.append(grad_N)
            exp_avgs.append(state["exp_avg"].view(-1)[seg.start : seg.end])
            exp_avg_sqs.append(state["exp_avg_sq"].view(-1)[seg.start : seg.end])
            seg_steps.append(steps[seg.param])
            # Decided by the memory, not by the mode: a deep-copied optimizer has separate masters.
            seg_copies.append(None if is_same_memory(state["master"], seg.param) else copy_N)
        for index, (masters, seg_grads, exp_avgs, exp_avg_sqs, seg_steps, seg_copies) in lists.items():
            adam_step_multi_(
                masters,
                seg_grads,
                exp_avgs,
                exp_avg_sqs,
                steps=seg_steps,
                grad_scale=grad_scale,
                param_copies_out=seg_copies,
                **(hyper[index] if hyper is not None else group_hyperparameters(self.param_groups[index])),
            )
