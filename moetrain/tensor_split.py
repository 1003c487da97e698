"""Tensor parallelism of the modules a strategy marks ``split`` / ``split.row`` / ``split.head``
(see :mod:`moetrain.parallelize`): the checks that ``tp`` ranks can split them (even shapes, whole
attention heads), the ``ParallelStyle`` of each ``nn.Linear`` / ``nn.Embedding`` for
``parallelize_module``, and Megatron's MLP split of a :class:`~moetrain.layers.experts.DenseFFN`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from moetrain.layers.experts import DenseFFN

if TYPE_CHECKING:
    from moetrain.parallelize import Assignment

SPLIT_KINDS = ("split", "split.row", "split.head")


def check_split(assignments: list[Assignment], model: nn.Module, tp: int) -> None:
    """Shapes that ``tp`` ranks cannot split evenly, and attention whose heads they would cut."""
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
