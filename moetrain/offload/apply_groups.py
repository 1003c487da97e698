"""Apply groups: the cut of many parameters into contiguous element ranges stepped one range at a time.

The parameters of all param groups, in order, are flattened and concatenated; the concatenation
(``total`` elements) is cut into contiguous element ranges, so a large parameter (an expert weight
``[E, D, F]``) may be split between two groups::

    num_apply_groups = G:   group k holds elements [k * total // G, (k + 1) * total // G)
    group_bytes = B:        groups of B // 4 elements (B bytes of fp32 master weight), the last shorter
"""

from __future__ import annotations

from collections.abc import Sequence

from moetrain.validation import require_int

MASTER_BYTES_PER_ELEMENT = 4  # the unit of ``group_bytes``


def check_apply_groups(num_apply_groups: int | None, group_bytes: int | None) -> None:
    """At most one of the two; ``num_apply_groups`` >= 1; ``group_bytes`` >= 4 (one fp32 element)."""
    if num_apply_groups is not None and group_bytes is not None:
        raise ValueError(
            "num_apply_groups and group_bytes: give at most one of them, got "
            f"num_apply_groups={num_apply_groups!r} and group_bytes={group_bytes!r}"
        )
    require_int("num_apply_groups", num_apply_groups, 1, allow_none=True)
    require_int("group_bytes", group_bytes, MASTER_BYTES_PER_ELEMENT, allow_none=True)


def plan_apply_groups(
    numels: Sequence[int], *, num_apply_groups: int | None = None, group_numel: int | None = None
) -> list[list[tuple[int, int, int]]]:
    """Cuts the concatenation of P flat tensors of ``numels`` elements into contiguous ranges.

    Returns one list per non-empty group of ``(tensor index, start, end)`` segments (element range
    ``[start, end)`` of that tensor), in order. With ``num_apply_groups = G`` group k covers the
    concatenation's elements ``[k * total // G, (k + 1) * total // G)`` (fewer than G groups when
    ``total < G``); with ``group_numel = n`` every group but the last has n elements; with neither,
    one group holds everything. Work and memory grow with ``min(G, total)``, not with G.
    """
    total = sum(numels)
    if num_apply_groups is not None:
        # With G >= total every non-empty group is one element: the groups of G = total.
        count = max(1, min(num_apply_groups, total))
        bounds = [k * total // count for k in range(count + 1)]
    elif group_numel is not None:
        bounds = [*range(0, total, group_numel), total]
    else:
        bounds = [0, total]
    starts = [0]
    for numel in numels:
        starts.append(starts[-1] + numel)
    groups: list[list[tuple[int, int, int]]] = []
    index = 0
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        segments = []
        while index < len(numels) and starts[index] < hi:
            start, end = max(lo, starts[index]) - starts[index], min(hi, starts[index + 1]) - starts[index]
            if end > start:
                segments.append((index, start, end))
            if starts[index + 1] <= hi:
                index += 1
            else:
                break
        if segments:
            groups.append(segments)
    return groups
