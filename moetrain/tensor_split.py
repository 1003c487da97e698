"""Tensor parallelism of the modules a strategy marks ``split`` / ``split.row`` / ``split.head``
(see :mod:`moetrain.parallelize`): the checks that ``tp`` ranks can split them (even shapes, whole
attention heads), the ``ParallelStyle`` of each ``nn.Linear`` / ``nn.Embedding`` for
``parallelize_module``, Megatron's MLP split of a :class:`~moetrain.layers.experts.DenseFFN`, and the
re-tying of parameters several modules share (a tied embedding and head) after the split."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from moetrain.layers.experts import DenseFFN

if TYPE_CHECKING:
    from moetrain.parallelize import Assignment

SPLIT_KINDS = ("split", "split.row", "split.head")


def check_split(assignments: list[Assignment], model: nn.Module, tp: int) -> None:
    """Shapes that ``tp`` ranks cannot split evenly, and attention whose heads they would cut: a
    split module whose parent has ``num_heads`` not divisible by ``tp``, or has ``head_dim`` (an int)
    while the split dimension (a multiple of it) is not a multiple of ``head_dim * tp``."""
    parents = dict(model.named_modules())
    for a in assignments:
        if a.kind not in SPLIT_KINDS:
            continue
        module = a.module
        if isinstance(module, nn.Linear):
            dim, size = (
                ("in_features", module.in_features)
                if a.kind == "split.row"
                else ("out_features", module.out_features)
            )
        elif isinstance(module, nn.Embedding):
            dim, size = "num_embeddings", module.num_embeddings
        else:
            if module.activation == "swiglu":
                raise ValueError(
                    f"strategy {a.pattern!r}: 'split' of the swiglu DenseFFN {a.name!r} is not supported "
                    "(its gate and up projections are stored side by side); replicate it"
                )
            dim, size = "hidden size", module.w2_FD.shape[0]
        if size % tp:
            raise ValueError(
                f"strategy {a.pattern!r}: {a.kind!r} of {a.name!r} over tp_size = {tp} needs its {dim} = "
                f"{size} divisible by {tp}"
            )
        parent = parents.get(a.name.rpartition(".")[0])
        heads = getattr(parent, "num_heads", None)
        if isinstance(heads, int) and heads % tp:
            raise ValueError(
                f"strategy {a.pattern!r}: {a.kind!r} of {a.name!r} over tp_size = {tp} would cut heads: "
                f"{a.name.rpartition('.')[0]!r} has num_heads = {heads}, not divisible by {tp}"
            )
        # Hugging Face attention (Llama, Mistral, Qwen) keeps head_dim, not num_heads: a projection
        # of n heads (k / v: the key-value heads under GQA) needs n divisible by tp
        head_dim = getattr(parent, "head_dim", None)
        if isinstance(head_dim, int) and head_dim > 0 and size % head_dim == 0 and size % (head_dim * tp):
            count = size // head_dim
            raise ValueError(
                f"strategy {a.pattern!r}: {a.kind!r} of {a.name!r} over tp_size = {tp} would cut heads: "
                f"{count} head{'s' * (count != 1)} of head_dim {head_dim} ({dim} = {size}), not divisible "
                f"by {tp}"
            )


def split_styles(assignments: list[Assignment]) -> dict:
    """``{module name: ParallelStyle}`` for ``parallelize_module`` (Linear and Embedding)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for a in assignments:
        if isinstance(a.module, DenseFFN) or a.kind not in SPLIT_KINDS:
            continue
        if isinstance(a.module, nn.Embedding):
            plan[a.name] = RowwiseParallel(input_layouts=Replicate())  # vocabulary rows; output all-reduced
        elif a.kind == "split":
            plan[a.name] = ColwiseParallel()
        elif a.kind == "split.row":
            plan[a.name] = RowwiseParallel()
        else:
            plan[a.name] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    return plan


def split_dense_ffn(module: DenseFFN, mesh) -> None:
    """Megatron's MLP split of a DenseFFN over the 1-D ``mesh``: ``w1_DF`` by columns, ``w2_FD`` by
    rows; the input enters replicated, the output leaves all-reduced (plain tensors both)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor

    def partition(name, submodule, device_mesh):
        if submodule is not module:
            return
        for pname, placement in (("w1_DF", Shard(1)), ("w2_FD", Shard(0))):
            param = getattr(module, pname)
            sharded = nn.Parameter(
                distribute_tensor(param.data, device_mesh, [placement]), param.requires_grad
            )
            setattr(module, pname, sharded)

    def inputs(submodule, args, device_mesh):
        return tuple(
            DTensor.from_local(a, device_mesh, [Replicate()], run_check=False)
            if isinstance(a, torch.Tensor)
            else a
            for a in args
        )

    def outputs(submodule, output, device_mesh):
        return output.redistribute(device_mesh, [Replicate()]).to_local()

    distribute_module(module, mesh, partition, inputs, outputs)


def tied_parameters(model: nn.Module) -> list[list[str]]:
    """The names of each Parameter that several modules (or attributes) hold, one list per shared
    Parameter, in ``named_parameters`` order: e.g. ``["embed.weight", "head.weight"]`` for an
    embedding tied to its head. Found before splitting: ``parallelize_module`` gives each module
    its own DTensor, so afterwards the aliases are separate Parameters."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _kind(name: str, kinds: dict[str, str]) -> str:
    """The strategy kind of the module owning parameter ``name``: its own, else its nearest
    assigned ancestor's, else ``'replica'``."""
    module = name.rpartition(".")[0]
    while module not in kinds and module:
        module = module.rpartition(".")[0]
    return kinds.get(module, "replica")


def _layout(param: torch.Tensor):
    """``(mesh, placements)`` of a DTensor parameter, ``None`` for a whole (replicated) one."""
    from torch.distributed.tensor import DTensor

    return (param.device_mesh, tuple(param.placements)) if isinstance(param, DTensor) else None


def _describe(layout) -> str:
    """``'whole'``, or the placements of a DTensor layout: ``'Shard(dim=0)'``."""
    return "whole" if layout is None else ", ".join(map(repr, layout[1]))


def retie_parameters(model: nn.Module, tied: list[list[str]], kinds: dict[str, str]) -> None:
    """Ties again the parameters :func:`tied_parameters` found before splitting: when every alias
    was split the same way (same mesh, same placements: an embedding ``split`` and its head
    ``split.head`` both shard the ``[vocab, d]`` matrix by rows), each owning module is given the
    first alias's DTensor Parameter, so the model trains one matrix as the one-process model does.
    ``kinds`` maps module names to strategy kinds. Aliases split differently, or split and
    replicated, are a ``ValueError``: their copies would train apart, silently."""
    for names in tied:
        held = [model.get_parameter(name) for name in names]
        if all(param is held[0] for param in held):
            continue
        first = _layout(held[0])
        for name, param in zip(names[1:], held[1:], strict=True):
            layout = _layout(param)
            if layout != first:
                raise ValueError(
                    f"tied parameter {names[0]!r} ({_kind(names[0], kinds)!r}: {_describe(first)}) and "
                    f"{name!r} ({_kind(name, kinds)!r}: {_describe(layout)}) would train apart; split "
                    "both modules the same way (e.g. embedding 'split', head 'split.head') or untie them"
                )
        for name in names[1:]:
            module, _, attr = name.rpartition(".")
            setattr(model.get_submodule(module), attr, held[0])
