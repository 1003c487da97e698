"""``moetrain export-hf``: a ``moetrain train`` checkpoint of a moefied Hugging Face model as a
Hugging Face folder (``config.json`` with the ``moetrain_moefy`` entry, ``model.safetensors``),
which ``moetrain.moefy.from_pretrained`` loads back exactly.

    moetrain export-hf runs/hf_moefy/checkpoints runs/hf_moefy/hf
    moetrain export-hf runs/hf_moefy/checkpoints/step_00000010 out/ --config my_moefied_config/

The model is described by a Hugging Face config holding the ``moetrain_moefy`` entry that
:func:`moetrain.moefy` records (``--config``: a folder or its ``config.json``; by default the run's
``hf_config/``, which the example builder ``scripts/examples/hf_moefy`` writes at start). The
model is built from it with fresh weights (:func:`moetrain.moefy.build_moefied`), the checkpoint
is loaded into it by :func:`moetrain.checkpoint.load_checkpoint` (experts by global index, so a
checkpoint of any ``ep_size`` exports; nothing in it is unpickled) and ``save_pretrained`` writes
the folder. The way back to ``moetrain train``: a builder that loads the folder with
``moetrain.moefy.from_pretrained`` (the example does, given ``model.hf_model``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path
from typing import Any

from moetrain import checkpoint as checkpoints
from moetrain.checkpoint import MANIFEST, latest_checkpoint
from moetrain.moefy import RECORD_KEY, build_moefied

log = logging.getLogger(__name__)

HF_CONFIG_DIR = "hf_config"  # a run's moefied Hugging Face config, beside its checkpoints/


def checkpoint_location(path: str | os.PathLike) -> tuple[Path, Path]:
    """``(what load_checkpoint loads, the checkpoints directory)`` for ``path``: a checkpoint (a
    folder holding ``manifest.json``, whatever its name: ``.../step_00000010``, a set-aside
    ``step_00000010.rejected-...``, a copy) is loaded as it is, and the folder holding it is the
    checkpoints directory; a checkpoints directory (its latest complete checkpoint) or a run's
    ``out_dir`` (its ``checkpoints/``) is both. The run's ``hf_config/`` is looked for beside the
    checkpoints directory."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path, path.parent
    directory = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if not directory.is_dir():
        raise ValueError(f"{path}: no such checkpoint, checkpoints directory or run directory")
    if latest_checkpoint(directory) is None:
        raise ValueError(f"{path}: no complete checkpoint in {directory}")
    return directory, directory


def _hf_config_folder(config: str | os.PathLike | None, directory: Path) -> Path:
    if config is not None:
        folder = Path(config)
        return folder.parent if folder.is_file() else folder
    folder = directory.parent / HF_CONFIG_DIR
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"{directory}: no Hugging Face config beside these checkpoints ({folder / 'config.json'} does "
            f"not exist): give --config FOLDER, a folder whose config.json holds the {RECORD_KEY!r} entry "
            "(e.g. the moefied model's model.config.save_pretrained(FOLDER))"
        )
    return folder


def resolve_model_class(model_class: Any):
    """A transformers model class, given as the class or its name in ``transformers``
    (``"AutoModelForCausalLM"``, ``"GPT2LMHeadModel"``)."""
    if isinstance(model_class, str):
        import transformers

        found = getattr(transformers, model_class, None)
        if not isinstance(found, type) or not (
            callable(getattr(found, "from_config", None)) or hasattr(found, "config_class")
        ):
            raise ValueError(
                f"model class must name a transformers model class (AutoModelForCausalLM, GPT2LMHeadModel, "
                f"...), got {model_class!r}"
            )
        return found
    return model_class


def _class_mismatch(model_class, name: str, folder: Path) -> str | None:
    """Why ``model_class`` (``--model-class`` ``name``) cannot build the model of ``folder``'s
    ``config.json``: a concrete class of another ``model_type``, or an Auto class with no model for
    it; None when the class fits or the config says no ``model_type``."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    file = folder / "config.json"
    try:
        model_type = json.loads(file.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None  # the error build_moefied raised names what is wrong with the file
    advice = f"give a class for {model_type!r} models (AutoModelForCausalLM, the default, for a causal LM)"
    takes = getattr(getattr(model_class, "config_class", None), "model_type", None)  # a concrete class's
    if takes and takes != model_type:
        return f"--model-class {name} builds {takes!r} models, {file} has model_type {model_type!r}; {advice}"
    mapping = getattr(model_class, "_model_mapping", None)  # an Auto class: the configs it has models for
    known = model_type in CONFIG_MAPPING  # else AutoConfig's own error stands
    if not takes and mapping is not None and known and CONFIG_MAPPING[model_type] not in mapping:
        return f"--model-class {name} has no model for the model_type {model_type!r} of {file}; {advice}"
    return None


def export_hf(
    checkpoint: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    config: str | os.PathLike | None = None,
    model_class: Any = "AutoModelForCausalLM",
) -> dict[str, Any]:
    """Writes the moefied model of ``checkpoint`` (see :func:`checkpoint_location`) as a Hugging
    Face folder ``out_dir`` (``save_pretrained``; an existing folder is written over). ``config``:
    the folder (or ``config.json``) with the ``moetrain_moefy`` entry; default: the run's
    ``hf_config/``. Returns ``step``, ``checkpoint`` (the checkpoint's folder), ``out_dir`` and
    ``model`` (the exported model, on the CPU). One-line ``ValueError`` / ``CheckpointError`` /
    ``FileNotFoundError`` for a missing checkpoint or config, an invalid entry, a ``model_class``
    of another model type than the config's, a checkpoint that does not fit the model the config
    describes, or ``out_dir`` an existing file (before anything is loaded); one-line ``OSError``
    naming ``out_dir`` when the folder cannot be written (a full disk)."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"OUT_DIR {out} is a file: give a folder (created if missing, written over if not)")
    source, directory = checkpoint_location(checkpoint)
    folder = _hf_config_folder(config, directory)
    name = model_class if isinstance(model_class, str) else getattr(model_class, "__name__", str(model_class))
    model_class = resolve_model_class(model_class)
    try:
        model = build_moefied(model_class, folder)
    except Exception:  # noqa: BLE001 - re-raised unless the class is of another model type
        problem = _class_mismatch(model_class, name, folder)
        if problem is None:
            raise
        raise ValueError(problem) from None
    try:
        loaded = checkpoints.load_checkpoint(source, model=model)  # DCP loads on first use
    except checkpoints.CheckpointError:  # a damaged checkpoint, not one of another model
        raise
    except (KeyError, RuntimeError) as error:  # entries that are not the model's
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(
            f"{source}: the checkpoint does not fit the model that {folder / 'config.json'} describes: "
            f"{message}"
        ) from None
    from safetensors import SafetensorError

    try:
        model.eval().save_pretrained(out)
    except (OSError, SafetensorError) as error:  # a full disk, no permission
        raise OSError(f"OUT_DIR {out}: the export could not be written: {error}") from error
    if not (out / "config.json").is_file():  # transformers logs some refusals and returns
        raise OSError(f"OUT_DIR {out}: the export was not written (no config.json there; see the log above)")
    log.info(
        "export-hf: step %d of %s written to %s (config: %s)", loaded["step"], loaded["path"], out, folder
    )
    return {"step": loaded["step"], "checkpoint": loaded["path"], "out_dir": out, "model": model}


def add_export_parser(subparsers) -> argparse.ArgumentParser:
    """Adds the ``export-hf`` command to an ``argparse`` sub-parser set; ``args.run`` is
    :func:`run_export`."""
    export = subparsers.add_parser(
        "export-hf",
        help="write a checkpoint of a moefied Hugging Face model as a Hugging Face folder",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    export.add_argument(
        "checkpoint",
        help="a checkpoint (a folder with manifest.json), a checkpoints directory (its latest) or an out_dir",
    )
    export.add_argument("out_dir", help="the Hugging Face folder to write (config.json, model.safetensors)")
    export.add_argument(
        "--config",
        metavar="FOLDER",
        help=f"folder or config.json with the {RECORD_KEY!r} entry (default: the run's {HF_CONFIG_DIR}/)",
    )
    export.add_argument(
        "--model-class",
        default="AutoModelForCausalLM",
        metavar="NAME",
        help="the transformers class to build (default AutoModelForCausalLM)",
    )
    export.set_defaults(run=run_export)
    return export


def run_export(args) -> int:
    """Runs ``moetrain export-hf``: prints where the step went and how to load it; returns 0."""
    result = export_hf(args.checkpoint, args.out_dir, config=args.config, model_class=args.model_class)
    print(
        f"exported step {result['step']} of {result['checkpoint']} to {result['out_dir']}: load it with "
        f"moetrain.moefy.from_pretrained({args.model_class}, {str(result['out_dir'])!r})"
    )
    return 0
