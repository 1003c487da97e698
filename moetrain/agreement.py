"""The start-up check that every rank was started alike, before any process group is built.

Ranks started with different configs (another ``ep_size``, another ``steps``, another model) build
different process groups or stop at different steps, and the others wait in a collective until
they time out. Here, right after the ranks meet, every rank contributes a digest of its world size
and its whole config (one small all-gather); when they differ, the configs are gathered and every
rank raises one ``ValueError`` naming the first differing key and its values.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch.distributed as dist

from moetrain.run_dir import flatten


def start_description(config: dict, world_size: int) -> dict[str, Any]:
    """What must be equal on every rank: the world size and every config key (dotted)."""
    return {"world_size": world_size, **flatten(json.loads(json.dumps(config, default=str)))}


def check_same_start(config: dict, world_size: int) -> None:
    """Raises ``ValueError`` on every rank when the ranks' start descriptions differ."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    mine = start_description(config, world_size)
    digest = hashlib.sha256(json.dumps(mine, sort_keys=True).encode()).hexdigest()
    digests: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    if len(set(digests)) == 1:
        return
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    reference = everyone[0]
    for rank, theirs in enumerate(everyone):
        differing = sorted(k for k in set(reference) | set(theirs) if reference.get(k) != theirs.get(k))
        if differing:
            key = differing[0]
            more = f" (and {len(differing) - 1} more keys)" if len(differing) > 1 else ""
            raise ValueError(
                f"the ranks were started with different settings: {key} = {theirs.get(key)!r} on rank "
                f"{rank}, {reference.get(key)!r} on rank 0{more}; every rank must get the same config and "
                "launch"
            )
