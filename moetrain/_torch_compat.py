"""The torch APIs moetrain uses that torch does not promise to keep, each behind one wrapper.

Every other module calls these wrappers, never the private names, and
``tests/unit/foundation/test_torch_compat.py`` checks each wrapper's behaviour, so a torch release
that renames or changes one fails that test (and the wrapper's call raises a RuntimeError naming
the torch version) instead of breaking somewhere deep in a training run.

- :func:`current_graph_task_id`: ``torch._C._current_graph_task_id`` (no public equivalent): tells
  a forward that runs inside a backward pass (an activation-checkpoint recompute) from a plain one.
- :func:`storage_use_count`: ``torch._C._storage_Use_Count`` (no public equivalent): how many
  owners a storage has, so a gradient buffer is reused only when nothing else holds it.
- :func:`grouped_mm`: ``torch.nn.functional.grouped_mm`` where it exists (public since torch 2.9),
  else the private ``torch._grouped_mm`` it wraps.
- :func:`ddp_ignore_parameters`: ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``
  (no public equivalent): DDP leaves the named parameters alone (experts, reduced over their own
  group; DTensor shards of split layers, which DDP cannot hold).
- :func:`assume_constant_result`: what ``torch.compiler.assume_constant_result`` does (it sets one
  marker on the function) without importing ``torch._dynamo``, which costs about a second at
  ``import moetrain`` for programs that never compile.
- :func:`tree_map` / :func:`tree_flatten`: ``torch.utils._pytree`` (torch has no public pytree
  module yet): map over / flatten the tensors of nested tuples, lists and dicts.
- :class:`TorchDispatchMode`: ``torch.utils._python_dispatch.TorchDispatchMode``, the base class of
  a mode that sees every aten operator (the planner's peak-memory measurement); documented in
  torch's extending notes but exported from a private module only.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F


def _missing(name: str) -> RuntimeError:
    return RuntimeError(
        f"torch {torch.__version__} has no {name}, which moetrain relies on (see moetrain/_torch_compat.py); "
        "use a torch version that tests/unit/foundation/test_torch_compat.py passes with"
    )


_GRAPH_TASK_ID = getattr(torch._C, "_current_graph_task_id", None)
_STORAGE_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)
_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _private_module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


_PYTREE = _private_module("torch.utils._pytree")
_PYTHON_DISPATCH = _private_module("torch.utils._python_dispatch")


def ddp_ignore_parameters(model: torch.nn.Module, names: list[str]) -> None:
    """Makes a ``DistributedDataParallel`` built on ``model`` afterwards skip the parameters and
    buffers ``names`` (no broadcast, no gradient reduction)."""
    from torch.nn.parallel import DistributedDataParallel

    ignore = getattr(DistributedDataParallel, "_set_params_and_buffers_to_ignore_for_model", None)
    if ignore is None:
        raise _missing("DistributedDataParallel._set_params_and_buffers_to_ignore_for_model")
    ignore(model, names)


def current_graph_task_id() -> int:
    """-1 outside a backward pass; inside one (a hook, or a checkpoint's recompute) the id of the
    running backward, the same for every node it runs."""
    if _GRAPH_TASK_ID is None:
        raise _missing("torch._C._current_graph_task_id")
    return _GRAPH_TASK_ID()


def in_backward_pass() -> bool:
    """True while autograd's engine runs a backward pass on this thread."""
    return current_graph_task_id() != -1


def storage_use_count(storage: torch.UntypedStorage) -> int:
    """Owners of ``storage``'s memory: tensors and storage objects referring to it (the ``storage``
    object passed in counts as one)."""
    if _STORAGE_USE_COUNT is None:
        raise _missing("torch._C._storage_Use_Count")
    return _STORAGE_USE_COUNT(storage._cdata)


def grouped_mm_available() -> bool:
    return _GROUPED_MM is not None


def grouped_mm(x_NI: torch.Tensor, w_EIO: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """``out[rows_e] = x[rows_e] @ w[e]`` with expert e owning rows ``[offsets[e-1], offsets[e])``
    (``offsets``: int32 cumulative row counts). torch's kernel, which has layout and dtype limits
    (on CUDA: bf16, 16-byte aligned strides, compute capability >= 8.0; on CPU: forward only)."""
    if _GROUPED_MM is None:
        raise _missing("torch.nn.functional.grouped_mm (or torch._grouped_mm)")
    return _GROUPED_MM(x_NI, w_EIO, offs=offsets_E)


def assume_constant_result(fn):
    """Marks ``fn`` as ``torch.compiler.assume_constant_result`` would: dynamo calls it while
    tracing and bakes its result into the graph."""
    fn._dynamo_marked_constant = True
    return fn


def tree_map(fn, tree):
    """``tree`` (nested tuples, lists, dicts) with every leaf replaced by ``fn(leaf)``."""
    if getattr(_PYTREE, "tree_map", None) is None:
        raise _missing("torch.utils._pytree.tree_map")
    return _PYTREE.tree_map(fn, tree)


def tree_flatten(tree) -> list:
    """The leaves of ``tree`` (nested tuples, lists, dicts), in order."""
    if getattr(_PYTREE, "tree_flatten", None) is None:
        raise _missing("torch.utils._pytree.tree_flatten")
    return _PYTREE.tree_flatten(tree)[0]


class _MissingDispatchMode:
    """Stands in for ``TorchDispatchMode`` when torch has none: subclasses still import, using one
    raises."""

    def __enter__(self):
        raise _missing("torch.utils._python_dispatch.TorchDispatchMode")

    def __exit__(self, *exc) -> None:
        return None


TorchDispatchMode = getattr(_PYTHON_DISPATCH, "TorchDispatchMode", None) or _MissingDispatchMode
