"""``OffloadOptimizer``: Adam / AdamW whose fp32 master weights and moments live in host memory while
the model keeps its weights, in their training dtype (fp32, bf16 or fp16), on its device (CPU or
one CUDA GPU). Apply groups: :mod:`moetrain.offload.apply_groups`; the device <-> host copies of a
step: :mod:`moetrain.offload.transfers`; ``GroupwiseApply``: :mod:`moetrain.offload.groupwise`.

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
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch

from moetrain.offload.apply_groups import MASTER_BYTES_PER_ELEMENT, check_apply_groups, plan_apply_groups
from moetrain.offload.cpu_adam import GRAD_DTYPES, adam_step_multi_, group_hyperparameters
from moetrain.offload.transfers import Segment, Transfers
from moetrain.validation import require_bool, require_nonneg_float, require_numbers

PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PARAM_DEVICE_TYPES = ("cpu", "cuda")
STATE_KEYS = ("step", "exp_avg", "exp_avg_sq", "master")
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


# ------------------------------------------------------------------------------------------------
# Validation


def _check_group_options(where: str, group: dict[str, Any]) -> None:
    """ValueError naming the first bad hyper-parameter of a param group (NaN is out of range)."""
    for key in ("lr", "eps", "weight_decay"):
        require_nonneg_float(f"{where}: {key}", group[key])
    require_numbers(f"{where}: betas", group["betas"], count=2, low=0, high=1, high_open=True)
    decoupled = group["decoupled_weight_decay"]
    require_bool(f"{where}: decoupled_weight_decay", decoupled, note="(True: AdamW, False: Adam)")
    for key in ("amsgrad", "maximize"):
        if group.get(key, False):
            raise ValueError(f"{where}: {key} must be False (not supported), got {group[key]!r}")


# ------------------------------------------------------------------------------------------------
# Apply groups


class OffloadOptimizer(torch.optim.Optimizer):
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
    ) -> None:
        check_apply_groups(num_apply_groups, group_bytes)
        require_bool("OffloadOptimizer: adamw_mode", adamw_mode)
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "decoupled_weight_decay": adamw_mode,
        }
        _check_group_options("OffloadOptimizer", defaults)
        self.num_apply_groups = num_apply_groups
        self.group_bytes = group_bytes
        self.device: torch.device | None = None  # of the model's parameters, set by add_param_group
        super().__init__(params, defaults)
        # Whether gradients and weight copies go through host staging buffers: always for a CUDA
        # model. (Tests set it on a CPU model, before the first step, to run that code path.)
        self._staged = self.device.type != "cpu"

    def __getstate__(self) -> dict[str, Any]:
        return {
            **super().__getstate__(),
            "num_apply_groups": self.num_apply_groups,
            "group_bytes": self.group_bytes,
            "device": self.device,
            "_staged": self._staged,
        }

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
        _check_group_options(where, {**self.defaults, **param_group})
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
            return loss
        grad_scale = getattr(self, "grad_scale", None)
        grad_scale = 1.0 if grad_scale is None else float(grad_scale)

        for index, group in enumerate(self.param_groups):
            _check_group_options(f"OffloadOptimizer param group {index}", group)
        flat_grads = self._flat_grads()
        if not flat_grads:
            return loss
        steps = {}
        for param in flat_grads:
            state = self.state[param]
            if not state:
                self._init_state(param)
            state["step"] += 1
            steps[param] = int(state["step"].item())

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
        """The param itself for an fp32 CPU model, else a new (uninitialised) fp32 host tensor."""
        if not self._staged and param.dtype == torch.float32:
            return param.detach()
        return torch.empty(param.shape, dtype=torch.float32)

    def _init_state(self, param: torch.Tensor) -> None:
        state = self.state[param]
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros(param.shape, dtype=torch.float32)
        state["exp_avg_sq"] = torch.zeros(param.shape, dtype=torch.float32)
        state["master"] = self._new_master(param)
        if not _is_same_memory(state["master"], param):
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
    ) -> None:
        """One fused C++ pass per param group over this apply group's segments (host tensors)."""
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
            seg_copies.append(None if _is_same_memory(state["master"], seg.param) else copy_N)
        for index, (masters, seg_grads, exp_avgs, exp_avg_sqs, seg_steps, seg_copies) in lists.items():
            adam_step_multi_(
                masters,
                seg_grads,
                exp_avgs,
                exp_avg_sqs,
                steps=seg_steps,
                grad_scale=grad_scale,
                param_copies_out=seg_copies,
                **group_hyperparameters(self.param_groups[index]),
            )

    # -- state dict ---------------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict of this class, or of ``torch.optim.Adam`` / ``AdamW`` / ``CPUAdam``.

        Every tensor is copied into this optimizer's own host buffers (nothing of ``state_dict`` is
        kept). A param's ``master`` (taken from the param when the dict has none, as torch's do) is
        also written, cast, into the model's parameter, so that weights equal the cast master.
        Params without an entry in ``state_dict["state"]`` lose their state (fresh moments).
        Everything is checked before anything changes. Load-state-dict hooks run as in torch.
        """
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            hook_result = pre_hook(self, state_dict)
            if hook_result is not None:
                state_dict = hook_result
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"OffloadOptimizer.load_state_dict: param_groups must have {len(self.param_groups)} "
                f"groups like this optimizer, got {len(saved_groups)}"
            )
        id_to_param, new_groups = {}, []
        for index, (group, saved) in enumerate(zip(self.param_groups, saved_groups, strict=True)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"OffloadOptimizer.load_state_dict: param group {index} must have "
                    f"{len(group['params'])} params, got {len(saved['params'])}"
                )
            id_to_param.update(zip(saved["params"], group["params"], strict=True))
            new_group = {key: _deep_copy(value) for key, value in saved.items() if key != "params"}
            new_group.setdefault("decoupled_weight_decay", group["decoupled_weight_decay"])
            new_group["params"] = group["params"]
            _check_group_options(f"OffloadOptimizer.load_state_dict: param group {index}", new_group)
            new_groups.append(new_group)

        loaded = {}
        for param_id, values in state_dict["state"].items():
            where = f"OffloadOptimizer.load_state_dict: state of param id {param_id!r}"
            if param_id not in id_to_param:
                raise ValueError(f"{where}: the id must be one of the param groups' params")
            param = id_to_param[param_id]
            unknown = sorted(set(values) - set(STATE_KEYS))
            missing = [key for key in ("step", "exp_avg", "exp_avg_sq") if key not in values]
            if unknown or missing:
                raise ValueError(
                    f"{where}: keys must be {STATE_KEYS} ('master' optional), got {sorted(values)}"
                )
            for key in ("exp_avg", "exp_avg_sq", "master"):
                if key in values and tuple(values[key].shape) != tuple(param.shape):
                    raise ValueError(
                        f"{where}: {key} must have the param's shape {tuple(param.shape)}, "
                        f"got {tuple(values[key].shape)}"
                    )
            loaded[param] = values

        new_state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        for param, values in loaded.items():
            state = self.state.get(param) or {}
            if not state:
                state = {
                    "exp_avg": torch.empty(param.shape, dtype=torch.float32),
                    "exp_avg_sq": torch.empty(param.shape, dtype=torch.float32),
                    "master": self._new_master(param),
                }
            state["step"] = torch.tensor(float(values["step"]), dtype=torch.float32)
            state["exp_avg"].copy_(values["exp_avg"])
            state["exp_avg_sq"].copy_(values["exp_avg_sq"])
            master = state["master"]
            if _is_same_memory(master, param):
                if "master" in values:
                    master.copy_(values["master"])  # writes the param
            else:
                master.copy_(values["master"] if "master" in values else param.detach())
                param.detach().copy_(master)
            new_state[param] = state
        self.state = new_state
        self.param_groups[:] = new_groups
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)


def _is_same_memory(master: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether ``master`` is the parameter's own memory (an fp32 CPU model)."""
    return master.device == param.device and master.data_ptr() == param.data_ptr()


def _deep_copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_deep_copy(item) for item in value)
    if isinstance(value, dict):
        return {key: _deep_copy(item) for key, item in value.items()}
    return value
