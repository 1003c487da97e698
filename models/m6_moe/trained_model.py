"""A trained M6 model in one process, from a training config and a checkpoint of any world size.

Checkpoints store experts by global index (``moetrain.checkpoint``), so a checkpoint saved by any
number of ranks and any ``ep_size`` loads into a single-process model holding every expert::

    config = build_train_config("run.yaml", [])
    model, loaded = load_trained_model(config, "runs/captions/checkpoints")  # the newest checkpoint
    model, loaded = load_trained_model(config, "runs/captions/checkpoints/step_00000500")

The whole model must fit one device: fine up to billions of parameters, not for the 100B / 1T
presets (their evaluation would have to run expert-parallel like training).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from m6_moe.config import M6Config
from m6_moe.model import M6Model
from m6_moe.tokenizer import load_tokenizer
from moetrain import checkpoint as checkpoints
from moetrain.checkpoint import MANIFEST, list_checkpoints

log = logging.getLogger(__name__)


def resolve_checkpoint(checkpoint: str | Path) -> tuple[Path, int | None]:
    """``(directory, step)`` for ``load_checkpoint``: a run's checkpoints directory gives ``(it,
    None)`` (its newest complete checkpoint), a complete checkpoint (a directory holding its
    manifest, whatever its name: ``step_XXXXXXXX``, a copy, a set-aside one) ``(it, None)``: that
    checkpoint itself. Anything else is a one-line ``ValueError`` saying what was found."""
    path = Path(checkpoint)
    if not path.exists():
        raise ValueError(f"checkpoint {path} does not exist")
    if not path.is_dir():
        raise ValueError(f"checkpoint {path} is not a directory")
    if (path / MANIFEST).is_file():
        return path, None
    if path.name.startswith("step_") and not (path / MANIFEST).is_file():
        raise ValueError(
            f"checkpoint {path} is incomplete (no {MANIFEST}): pick another step or the directory"
        )
    if list_checkpoints(path):
        return path, None
    if list_checkpoints(path / "checkpoints"):
        raise ValueError(
            f"{path} holds no checkpoint; it looks like a run's out_dir: use {path / 'checkpoints'}"
        )
    raise ValueError(
        f"no complete checkpoint in {path} (give a run's checkpoints directory or one step_XXXXXXXX "
        "directory)"
    )


def tokenizer_for(model_config: M6Config):
    """The tokenizer ``model_config.tokenizer`` names, checked to fit ``model_config.vocab_size``."""
    tokenizer = load_tokenizer(model_config.tokenizer)
    if tokenizer.vocab_size > model_config.vocab_size:
        raise ValueError(
            f"model.vocab_size = {model_config.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer.vocab_size} ids, tokenizer {model_config.tokenizer!r})"
        )
    return tokenizer


def resolve_eval_device(name: str) -> torch.device:
    """The training config's ``device`` for one process: ``"auto"`` is GPU 0 when torch sees one."""
    from moetrain.engine import resolve_device

    return resolve_device(name, 0, 1)


def load_trained_model(config, checkpoint: str | Path, device: torch.device | str | None = None):
    """``(model, loaded)``: an :class:`~m6_moe.model.M6Model` built from ``config.model`` (a
    ``TrainConfig``'s), its weights read from ``checkpoint`` (see :func:`resolve_checkpoint`),
    on ``device`` (None: the config's ``device``, ``"auto"`` = cuda when available) in eval
    mode; ``loaded`` is what ``moetrain.checkpoint.load_checkpoint`` returned (``step``, ``path``,
    ``saved_world_size``, ...). ``config.threads`` sets torch's CPU threads when given. The
    model is built on the meta device and materialised once on ``device`` (no random
    initialisation that the checkpoint would overwrite). As ``load_checkpoint`` does, this sets
    the process's RNG to the state rank 0 saved: seed a ``torch.Generator`` for sampling."""
    if not isinstance(config.model, M6Config):
        raise ValueError(f"model must be an M6Config (model.name: m6_moe), got {type(config.model).__name__}")
    directory, step = resolve_checkpoint(checkpoint)
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    device = resolve_eval_device(config.device) if device is None else torch.device(device)
    with torch.device("meta"):
        model = M6Model(config.model)
    model = model.to_empty(device=device)
    loaded = checkpoints.load_checkpoint(directory, model=model, step=step)  # DCP loads on first use
    log.info(
        "loaded %s (step %d, saved by %d rank(s), ep_size %d) into one process on %s",
        loaded["path"], loaded["step"], loaded["saved_world_size"], loaded["saved_ep_size"], device,
    )  # fmt: skip
    return model.eval(), loaded
