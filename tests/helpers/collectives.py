"""Counting what a rank sends through ``dist.all_to_all_single`` (the planner's traffic tests)."""

from __future__ import annotations


def counting_all_to_all(log: dict, local_world: int):
    """``dist.all_to_all_single`` that also adds to ``log`` its call (``calls``), its messages to
    other ranks (``intra_messages`` / ``inter_messages``) and their bytes (``intra`` / ``inter``),
    a node being ``local_world`` consecutive ranks. Missing keys start at 0."""
    import torch.distributed as dist

    original, me = dist.all_to_all_single, dist.get_rank()

    def add(key: str, value: int) -> None:
        log[key] = log.get(key, 0) + value

    def counting(output, tensor, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
        ranks = (
            dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        )
        rows = tensor.shape[0]
        splits = input_split_sizes or [rows // len(ranks)] * len(ranks)
        row_bytes = tensor.numel() // rows * tensor.element_size() if rows else 0
        for dest, count in zip(ranks, splits, strict=True):
            if dest != me:
                key = "intra" if dest // local_world == me // local_world else "inter"
                add(key, count * row_bytes)
                add(f"{key}_messages", 1)
        add("calls", 1)
        return original(output, tensor, output_split_sizes, input_split_sizes, group, **kw)

    return counting
