"""Adam / AdamW on fp32 CPU master weights, stepped by the fused C++ kernel ``ops.adam_step_``.

One pass over memory per parameter: the kernel reads the gradient (fp32, bf16 or fp16), the fp32
master weight and both fp32 moments, and writes the weight, the moments and optionally a
low-precision copy of the updated weight (the tensor the training device needs back). Per element,
with t the step count after this update (all math in fp32)::

    g = grad / grad_scale  (+ weight_decay * p                      Adam: L2 in the gradient)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    p = p * (1 - lr * weight_decay)                                  (AdamW: decoupled decay)
    p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    copy_out = p cast to copy_out's dtype (round to nearest even)

which is ``torch.optim.Adam`` / ``torch.optim.AdamW`` with ``foreach=False`` up to float rounding
(about an ulp of the weight per step; the moments follow torch's operation order).
Tensors here are flat or any shape, but contiguous, on the CPU, and of equal numel.
"""

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from moetrain._ext import ops
from moetrain.validation import require_nonneg_float, require_numbers

GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def adam_step_(
    param_fp32: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw: bool,
    grad_scale: float = 1.0,
    param_copy_out: torch.Tensor | None = None,
) -> None:
    """One fused Adam (``adamw=False``) or AdamW (``adamw=True``) step, in place.

    Args:
        param_fp32: fp32 master weight, updated in place.
        grad: gradient of the same numel, fp32, bf16 or fp16; it is multiplied by ``1 / grad_scale``
            (the unscaling of fp16 loss scaling) inside the same pass. Not modified.
        exp_avg, exp_avg_sq: fp32 first and second moments, updated in place.
        step: the step count including this update (1 on the first call), as in torch's
            ``state["step"]`` after its increment.
        lr, beta1, beta2, eps, weight_decay: as in ``torch.optim.AdamW``.
        grad_scale: loss scale the gradient still carries (> 0; 1.0 for none).
        param_copy_out: when given, receives the updated weight cast to its dtype (fp32, bf16 or
            fp16, round to nearest even), written in the same pass.

    All tensors: contiguous CPU tensors with the same numel. Runs on ``torch.get_num_threads()``
    OpenMP threads and releases the GIL.
    """
    ops.adam_step_(
        param_fp32,
        grad,
        exp_avg,
        exp_avg_sq,
        step=step,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        adamw=adamw,
        grad_scale=grad_scale,
        param_copy_out=param_copy_out,
    )


def group_hyperparameters(group: dict) -> dict:
    """The keyword arguments of :func:`adam_step_` / :func:`adam_step_multi_` from a torch-style
    Adam param group (``lr``, ``betas``, ``eps``, ``weight_decay``, ``decoupled_weight_decay``)."""
    beta1, beta2 = group["betas"]
    return {
        "lr": float(group["lr"]),
        "beta1": float(beta1),
        "beta2": float(beta2),
        "eps": float(group["eps"]),
        "weight_decay": float(group["weight_decay"]),
        "adamw": bool(group["decoupled_weight_decay"]),
    }


def adam_step_multi_(
    params_fp32: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    steps: Sequence[int],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw: bool,
    grad_scale: float = 1.0,
    param_copies_out: Sequence[torch.Tensor | None] | None = None,
) -> None:
    """``adam_step_`` over lists of tensors in one call; the threads share the chunks of all of them.

    ``steps[i]`` is the step count of ``params_fp32[i]``; the other hyper-parameters are shared.
    ``param_copies_out`` is None or one entry (a tensor, or None for no copy) per param.
    """
    ops.adam_step_multi_(
        list(params_fp32),
        list(grads),
        list(exp_avgs),
        list(exp_avg_sqs),
        steps=[int(step) for step in steps],
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        adamw=adamw,
        grad_scale=grad_scale,
        param_copies_out=None if param_copies_out is None else list(param_copies_out),
    )


def _check_hyperparameters(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """Raises ValueError naming the first out-of-range hyper-parameter: ``lr``, ``eps`` and
    ``weight_decay`` finite numbers >= 0, ``betas`` two numbers in [0, 1) (NaN and inf are out of
    range; a bool is not a number)."""
    require_nonneg_float("CPUAdam: lr", lr)
    require_numbers("CPUAdam: betas", betas, count=2, low=0, high=1, high_open=True)
    require_nonneg_float("CPUAdam: eps", eps)
    require_nonneg_float("CPUAdam: weight_decay", weight_decay)


class CPUAdam(torch.optim.Optimizer):
    """Adam / AdamW over fp32 CPU master weights, each step one fused C++ pass per parameter.

    Equivalent to ``torch.optim.AdamW`` (``adamw_mode=True``, decoupled weight decay) or
    ``torch.optim.Adam`` (``adamw_mode=False``, L2 weight decay) with ``foreach=False``, within
    float rounding. Parameters must be contiguous fp32 CPU tensors. Gradients may be fp32, bf16 or
    fp16: torch only lets ``param.grad`` hold another dtype after ``param.grad_dtype = None``
    (or the gradient's dtype) is set on the parameter.

    The state has torch's Adam format (per parameter: ``step`` as a 0-dim fp32 tensor,
    ``exp_avg``, ``exp_avg_sq``), and each param group stores the mode under torch's key
    ``decoupled_weight_decay``, so state dicts load both ways between this class and
    ``torch.optim.Adam`` / ``torch.optim.AdamW``. AMSGrad and ``maximize`` are not supported.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
    ) -> None:
        _check_hyperparameters(lr, betas, eps, weight_decay)
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "decoupled_weight_decay": bool(adamw_mode),
        }
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a group after checking that its params are contiguous fp32 CPU tensors; a group
        refused (ValueError) is not kept."""
        super().add_param_group(param_group)
        try:
            self._check_group(len(self.param_groups) - 1)
        except ValueError:
            self.param_groups.pop()
            raise

    def _check_group(self, index: int) -> None:
        group = self.param_groups[index]
        _check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        for position, param in enumerate(group["params"]):
            if param.dtype != torch.float32 or param.device.type != "cpu" or not param.is_contiguous():
                raise ValueError(
                    f"CPUAdam: param {position} of param group {index} must be a "
                    f"contiguous float32 CPU tensor (the fp32 master weight), got dtype {param.dtype}, "
                    f"device {param.device}, contiguous={param.is_contiguous()}"
                )

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("decoupled_weight_decay", self.defaults["decoupled_weight_decay"])

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, *, grad_scale: float = 1.0) -> float | None:
        """Updates every parameter that has a gradient; returns ``closure()``'s loss if given.

        ``grad_scale``: the loss scale the gradients still carry; they are divided by it inside the
        fused pass (fp16 loss scaling). Non-finite gradients are not skipped here.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group_index, group in enumerate(self.param_groups):
            if group.get("amsgrad", False) or group.get("maximize", False):
                raise ValueError(
                    f"CPUAdam: param group {group_index} asks for amsgrad or maximize (unsupported)"
                )
            params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad
                if grad.is_sparse:
                    raise ValueError("CPUAdam: sparse gradients are not supported")
                if grad.dtype not in GRAD_DTYPES:
                    raise ValueError(f"CPUAdam: gradients must be one of {GRAD_DTYPES}, got {grad.dtype}")
                state = self.state[param]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.contiguous_format)
                params.append(param)
                grads.append(grad.contiguous())
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                steps.append(int(state["step"].item()) + 1)
            if not params:
                continue
            adam_step_multi_(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                steps=steps,
                grad_scale=grad_scale,
                **group_hyperparameters(group),
            )
            for param in params:  # counted once the kernel has updated them (it checks before writing)
                self.state[param]["step"] += 1
        return loss
