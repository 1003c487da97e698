"""Which implementation of each op a call runs: ``kernels: auto | custom | torch``.

- ``custom``: the C++/CUDA kernel (``torch.ops.moetrain.<op>``) on every device.
- ``torch``: the torch-native twin (:mod:`moetrain.kernels.native`), on every device.
- ``auto`` (default): the custom kernel on the CPU and on ``meta`` (the C++ CPU kernels are tested
  against the twins in CI); on a CUDA device the custom kernel only after it has matched the twin
  on that device: the first call of each op on each GPU of the process runs both on small random
  inputs on that GPU (:data:`SAMPLES`: four dtypes, packet and element paths, weighted and not,
  padded plans, top-10) and compares values and gradients. A mismatch or an error logs one warning
  naming the op and selects the twin for the rest of the run on that GPU (no GPU has run the CUDA
  kernels in this project's CI: this keeps a user's first GPU run from trusting code no test
  executed). A trusted CUDA kernel still hands a call with more than :data:`CUDA_MAX_CHOICES`
  choices per token to the twin (:func:`custom_kernel_takes`); ``custom`` passes it to the kernel,
  which refuses it.

Under ``torch.compile`` the choice is made while tracing (the check runs eagerly then, as for
``torch.compiler.assume_constant_result``) and baked into the graph.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from moetrain._torch_compat import assume_constant_result
from moetrain.config import KERNEL_CHOICES
from moetrain.kernels import native
from moetrain.kernels.registration import most_kept_rows
from moetrain.validation import require_choice

logger = logging.getLogger("moetrain.kernels")

__all__ = [
    "CUDA_MAX_CHOICES",
    "DEVICE_OPS",
    "KERNEL_CHOICES",
    "VERIFIER",
    "KernelVerifier",
    "compare_on_sample",
    "custom_kernel_takes",
    "kernel",
]
# Ops with a CUDA kernel in csrc/ (the CPU Adam ops run on host tensors only).
DEVICE_OPS = (
    "build_dispatch_plan",
    "permute_rows",
    "unpermute_rows",
    "unpermute_weight_grad",
    "transpose_chunks",
    "pack_scaled_fp16",
    "unpack_scaled_fp16",
)


def _custom_ops() -> dict[str, Callable]:
    return {name: getattr(torch.ops.moetrain, name) for name in DEVICE_OPS}


def _torch_ops() -> dict[str, Callable]:
    ops = {name: native.NATIVE_OPS[name] for name in DEVICE_OPS}
    ops["build_dispatch_plan"] = torch.ops.moetrain.sort_dispatch_plan  # one opaque step when compiled
    return ops


class KernelVerifier:
    """Checks each custom op once per process and device against its torch-native twin, on that
    device (verdicts by op and ``str(device)``: each GPU index on its own).

    ``custom`` / ``native``: the implementations by op name (default: the extension's operators
    and the twins); ``checked_device_types``: where a custom kernel must earn trust ("cuda").
    Tests build verifiers with a deliberately wrong ``custom`` entry and ``("cpu",)``.
    """

    def __init__(
        self,
        custom: dict[str, Callable] | None = None,
        native_ops: dict[str, Callable] | None = None,
        checked_device_types: tuple[str, ...] = ("cuda",),
    ):
        self.custom = {**_custom_ops(), **(custom or {})}
        self.native = {**_torch_ops(), **(native_ops or {})}
        self.checked_device_types = checked_device_types
        self.verdicts: dict[tuple[str, str], bool] = {}

    def trusts(self, op: str, device: torch.device | str) -> bool:
        """Whether ``op``'s custom kernel may run on ``device`` (checked on its first use there, with
        the samples on ``device``; a device without an index is the current one)."""
        device = torch.device(device)
        if device.type not in self.checked_device_types:
            return True
        key = (op, str(device))
        if key not in self.verdicts:
            problem = self._problem(op, device)
            self.verdicts[key] = problem is None
            if problem is not None:
                logger.warning(
                    "moetrain kernel %s on %s: the custom kernel %s; using the torch-native implementation "
                    "for the rest of this run",
                    op,
                    device,
                    problem,
                )
        return self.verdicts[key]

    def _problem(self, op: str, device: torch.device) -> str | None:
        try:
            return compare_on_sample(op, self.custom[op], self.native[op], device)
        except Exception as error:  # a launch error, an unsupported device: anything counts  # noqa: BLE001
            return f"raised {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


VERIFIER = KernelVerifier()


@assume_constant_result
def _trusted(op: str, device_type: str, device_index: int | None) -> bool:
    return VERIFIER.trusts(op, torch.device(device_type, device_index))


# The most choices per token (K) the CUDA unpermute kernels take (csrc/permute_cuda.cu
# kMaxChoices); permute_rows' backward runs unpermute_rows with its k.
CUDA_MAX_CHOICES = 256
# The choices per token of a call, from its arguments, for the ops whose CUDA kernels are limited.
_CHOICES_OF_CALL = {
    "permute_rows": lambda args: args[2],  # (x, slot_of_row, k, weights)
    "unpermute_rows": lambda args: args[1].shape[1],  # (y, row_of_slot [T, K], weights)
    "unpermute_weight_grad": lambda args: args[2].shape[1],  # (grad, y, row_of_slot [T, K])
}


def custom_kernel_takes(op: str, device_type: str, choices: int) -> bool:
    """Whether ``op``'s custom kernel on ``device_type`` runs a call with ``choices`` (K) choices
    per token, forward and backward: on CUDA the row ops take at most :data:`CUDA_MAX_CHOICES`."""
    return device_type != "cuda" or op not in _CHOICES_OF_CALL or choices <= CUDA_MAX_CHOICES


def _custom_within_choice_limit(op: str, custom: Callable, twin: Callable, *args):
    """``custom(*args)`` on CUDA tensors, or ``twin(*args)`` when the call has more choices per
    token than the CUDA kernel takes."""
    fits = custom_kernel_takes(op, "cuda", _CHOICES_OF_CALL[op](args))
    return custom(*args) if fits else twin(*args)


def kernel(op: str, device: torch.device, choice: str = "auto") -> Callable:
    """The implementation of ``op`` for tensors on ``device`` under ``choice`` (one of
    :data:`KERNEL_CHOICES`). Under ``auto`` a trusted CUDA row op comes wrapped so that calls with
    more than :data:`CUDA_MAX_CHOICES` choices per token run the twin."""
    require_choice("kernels", choice, KERNEL_CHOICES)
    if choice == "torch":
        return VERIFIER.native[op]
    if choice == "custom":
        return VERIFIER.custom[op]
    if not _trusted(op, device.type, device.index):
        return VERIFIER.native[op]
    if device.type == "cuda" and op in _CHOICES_OF_CALL:
        return functools.partial(_custom_within_choice_limit, op, VERIFIER.custom[op], VERIFIER.native[op])
    return VERIFIER.custom[op]


# ------------------------------------------------------------------------------------------------
# The start-up check.
# ------------------------------------------------------------------------------------------------

# The samples each op is checked on: the weighted fp32 packet path with top-2 and a capacity cut;
# bf16 rows of odd width (the element path), top-3 (choices grouped by 8), unweighted, dropless;
# fp16 rows with top-6, padded (rows of slot -1, as a compiled graph's plan has); fp64 rows (fp64
# weights and sums, an fp64 wire codec); fp32 top-10 (a second group of 8 choices), padded. Small:
# the check runs on the first use of each op.
SAMPLES = tuple(
    {
        "tokens": t,
        "k": k,
        "experts": e,
        "hidden": h,
        "capacity": c,
        "dtype": dtype,
        "weighted": weighted,
        "padded": padded,
    }
    for t, k, e, h, c, dtype, weighted, padded in (
        (37, 2, 5, 24, 9, torch.float32, True, False),
        (29, 3, 6, 7, -1, torch.bfloat16, False, False),
        (16, 6, 8, 40, 12, torch.float16, True, True),
        (23, 2, 4, 9, 5, torch.float64, True, False),
        (19, 10, 16, 12, 10, torch.float32, True, True),
    )
)


def _sample_rows(sample: dict) -> int | None:
    """``num_rows`` of the sample's plan: the most rows it can keep when padded (the kept rows
    come first, then rows of slot -1), else None (the kept rows)."""
    if not sample["padded"]:
        return None
    return most_kept_rows(sample["tokens"], sample["k"], sample["experts"], sample["capacity"])


def _sample_plan(sample: dict, device: torch.device, generator: torch.Generator):
    tokens, k, experts = sample["tokens"], sample["k"], sample["experts"]
    expert_ids_TK = torch.rand(tokens, experts, generator=generator).topk(k, dim=-1).indices
    plan = native.build_dispatch_plan(expert_ids_TK, None, experts, sample["capacity"], _sample_rows(sample))
    return expert_ids_TK.to(device), [t.to(device) for t in plan]


def _sample_inputs(op: str, sample: dict, device: torch.device) -> tuple[tuple, tuple[int, ...]]:
    """(arguments, positions of the differentiable ones) for one call of ``op`` on ``device``."""
    generator = torch.Generator().manual_seed(20261123)
    tokens, k, hidden, dtype = sample["tokens"], sample["k"], sample["hidden"], sample["dtype"]
    expert_ids_TK, (row_of_slot_TK, slot_of_row_N, _, _) = _sample_plan(sample, device, generator)
    rows = slot_of_row_N.shape[0]

    def randn(*shape, dtype=dtype):
        return torch.randn(*shape, generator=generator).to(device, dtype)

    weight_dtype = native.accumulate_dtype(dtype)
    wire_dtype = torch.float64 if dtype == torch.float64 else torch.float32  # the codec's row dtypes

    if op == "build_dispatch_plan":
        order_S = torch.randperm(tokens * k, generator=generator).to(device)
        return (expert_ids_TK, order_S, sample["experts"], sample["capacity"], _sample_rows(sample)), ()
    if op == "permute_rows":
        if not sample["weighted"]:
            return (randn(tokens, hidden), slot_of_row_N, k, None), (0,)
        return (randn(tokens, hidden), slot_of_row_N, k, randn(tokens * k, dtype=weight_dtype)), (0, 3)
    if op == "unpermute_rows":
        if not sample["weighted"]:
            return (randn(rows, hidden), row_of_slot_TK, None), (0,)
        return (randn(rows, hidden), row_of_slot_TK, randn(tokens, k, dtype=weight_dtype)), (0, 2)
    if op == "unpermute_weight_grad":
        return (randn(tokens, hidden), randn(rows, hidden), row_of_slot_TK), (0, 1)
    if op == "transpose_chunks":
        sizes_AB = torch.randint(0, 4, (3, 5), generator=generator)
        return (randn(int(sizes_AB.sum()), hidden), sizes_AB), (0,)
    if op == "pack_scaled_fp16":
        return (randn(rows, hidden, dtype=wire_dtype) * 1e3,), ()
    if op == "unpack_scaled_fp16":
        return (native.pack_scaled_fp16(randn(rows, hidden, dtype=wire_dtype) * 1e-3), wire_dtype), ()
    raise ValueError(f"no sample input for op {op!r}")


def _flatten(result) -> list[torch.Tensor]:
    return list(result) if isinstance(result, (tuple, list)) else [result]


def compare_on_sample(op: str, custom: Callable, twin: Callable, device: torch.device) -> str | None:
    """Runs ``custom`` and ``twin`` on the same inputs on ``device``, each of :data:`SAMPLES`, with
    gradients on whatever the caller's grad mode (a first call under ``no_grad`` must not skip
    them); returns what differs (values, or the gradients of the differentiable inputs for a random
    upstream gradient, in which sample), or None when they agree (integer and bit-pattern outputs
    exactly, floats within 1e-5, 16-bit floats within 1e-2)."""
    with torch.inference_mode(False), torch.enable_grad():
        for index, sample in enumerate(SAMPLES):
            problem = _compare_one(op, custom, twin, device, sample)
            if problem is not None:
                return f"{problem} (sample {index}: {_describe(sample)})"
    return None


def _describe(sample: dict) -> str:
    dtype = str(sample["dtype"]).removeprefix("torch.")
    padded = ", padded" if sample["padded"] else ""
    return f"{dtype}, {sample['tokens']} tokens, top-{sample['k']}, hidden {sample['hidden']}{padded}"


def _compare_one(op: str, custom: Callable, twin: Callable, device: torch.device, sample: dict) -> str | None:
    args, differentiable = _sample_inputs(op, sample, device)
    results = []
    for implementation in (custom, twin):
        call_args = [
            a.detach().clone().requires_grad_(True) if i in differentiable else a for i, a in enumerate(args)
        ]
        outputs = _flatten(implementation(*call_args))
        grads = []
        if differentiable and not outputs[0].requires_grad:
            grads = [None] * len(differentiable)  # the output is cut off from its inputs
        elif differentiable:
            upstream = torch.randn(outputs[0].shape, generator=torch.Generator().manual_seed(7)).to(device)
            inputs = [call_args[i] for i in differentiable]
            grads = list(torch.autograd.grad(outputs[0], inputs, upstream, allow_unused=True))
        results.append(([o.detach() for o in outputs], grads))
    (got, got_grads), (want, want_grads) = results
    for name, a_list, b_list in (("output", got, want), ("gradient", got_grads, want_grads)):
        if len(a_list) != len(b_list):
            return f"returned {len(a_list)} {name}s instead of {len(b_list)}"
        for index, (a, b) in enumerate(zip(a_list, b_list, strict=True)):
            if a is None or b is None:
                if (a is None) != (b is None):
                    return f"gives no {name} {index}" if a is None else f"gives an extra {name} {index}"
                continue
            if a.shape != b.shape or a.dtype != b.dtype:
                return f"{name} {index} is {a.dtype} {tuple(a.shape)} instead of {b.dtype} {tuple(b.shape)}"
            exact = not a.dtype.is_floating_point
            if exact and not torch.equal(a, b):
                return f"{name} {index} differs from the torch-native result"
            tolerance = 1e-2 if a.element_size() == 2 else 1e-5
            if not exact and not torch.allclose(a, b, rtol=tolerance, atol=tolerance, equal_nan=True):
                error = (a.double() - b.double()).abs().max().item()
                return f"{name} {index} differs from the torch-native result by up to {error:.3g}"
    return None
