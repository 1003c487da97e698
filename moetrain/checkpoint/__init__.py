"""Training checkpoints through ``torch.distributed.checkpoint`` (DCP), experts stored by global index.

A checkpoint saved under one layout (world size, ``ep_size``) loads under any other whose expert
count matches: every expert parameter ``[E_local, ...]`` is split into one entry per GLOBAL expert,
and a rank loads exactly the experts it holds now. Works with or without an initialised process
group (one process: ``torch.distributed`` not initialised).

The modules, one job each:

- :mod:`~moetrain.checkpoint.directory`: names, completeness, publishing, pruning, debris;
- :mod:`~moetrain.checkpoint.integrity`: the manifest and the checksums of the files;
- :mod:`~moetrain.checkpoint.entries` / :mod:`~moetrain.checkpoint.restore`: what a rank saves
  and reads (the flat DCP state dict, experts split per global index);
- :mod:`~moetrain.checkpoint.objects` / :mod:`~moetrain.checkpoint.safe_dcp`: objects as JSON and
  reading without unpickling anything but DCP's own metadata classes (trust model:
  docs/checkpoint.md);
- :mod:`~moetrain.checkpoint.save` / :mod:`~moetrain.checkpoint.load`: the two collectives,
  saving atomically (optionally in the background) and loading all-or-nothing.

Under another world size, rank r restores the RNG saved by rank r where that rank existed (and
nothing where it did not), and gets rank r's ``extra_state``, or rank 0's where rank r did not
exist; :func:`load_checkpoint` reports both (``rng_restored``, ``extra_state_rank``).
"""

import importlib

from moetrain.checkpoint.directory import (
    MANIFEST,
    checkpoint_path,
    debris,
    latest_checkpoint,
    list_checkpoints,
    remove_debris,
    set_aside_newer,
)
from moetrain.checkpoint.ranks import CheckpointError

# The two collectives import DCP and DTensor with it (about a third of `moetrain`'s start-up on a
# small CPU): they load on first use, so a command that never saves or loads (`moetrain plan`,
# `moetrain launch`, a config refused) does not pay for them.
_LOADED_ON_USE = {
    "CheckpointWriter": "save",
    "SaveResult": "save",
    "save_checkpoint": "save",
    "load_checkpoint": "load",
    "verify_checkpoint": "load",
}


def __getattr__(name: str):
    module = _LOADED_ON_USE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "MANIFEST",
    "CheckpointError",
    "CheckpointWriter",
    "SaveResult",
    "checkpoint_path",
    "debris",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "remove_debris",
    "save_checkpoint",
    "set_aside_newer",
    "verify_checkpoint",
]
