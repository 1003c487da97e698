"""Turn the FFNs of an existing model into MoELayers, optionally upcycled from their weights.

:func:`moefy` replaces every matched FFN module with a :class:`~moetrain.MoELayer` of the same
``d_model`` and hidden size. With ``upcycle=True`` (sparse upcycling) every expert starts as a copy
of the dense FFN, weights and biases: with the gates of each token normalised to sum to 1 and no
token dropped (dropless, the default here), the layer's output at step 0 is exactly the dense
FFN's, whatever the router says, ``sum_j g_j * FFN(x) = FFN(x)``.

FFN shapes it reads (duck-typed, so no model library is imported):

- ``nn.Sequential(nn.Linear(D, F), activation, nn.Linear(F, D)[, nn.Dropout])``, activation
  ``nn.ReLU`` or ``nn.GELU`` (exact or ``approximate="tanh"``);
- Hugging Face GPT-2's MLP: ``c_fc`` / ``c_proj`` (``Conv1D``, weights stored ``[in, out]``, with
  biases), ``act`` (``gelu_new``: the tanh GELU), ``dropout``;
- Llama / Mistral / Qwen-style gated MLPs: ``gate_proj``, ``up_proj``, ``down_proj``
  (``nn.Linear``, biases if present) and a SiLU ``act_fn``: SwiGLU experts.

A trailing dropout is kept after the MoE layer (``nn.Sequential(moe, dropout)``).

Hugging Face round trip: when the model has a Hugging Face config (``model.config`` with
``to_json_string``), :func:`moefy` records what it did under ``model.config.moetrain_moefy``
(``RECORD_KEY``): per call, the swapped modules, ``num_experts``, ``top_k`` and every other
resolved :class:`~moetrain.MoEConfig` option, so ``model.save_pretrained(path)`` writes it into
``config.json``. :func:`from_pretrained` reads it back: builds the model class from the config,
replays the recorded ``moefy`` calls and loads the safetensors weights strictly. Nothing in the
folder is executed (JSON and safetensors only). Transformers' own ``from_pretrained`` cannot know
the record: it rebuilds the dense FFNs with random weights and only warns (its LOAD REPORT lists
the experts as UNEXPECTED and the FFN weights as MISSING), see docs/moefy.md.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moetrain.config import MoEConfig, config_from_dict
from moetrain.layers.experts import experts_on_meta
from moetrain.layers.moe_layer import MoELayer

log = logging.getLogger(__name__)

_GELU_TANH_CLASSES = {"NewGELUActivation", "GELUTanh", "PytorchGELUTanh", "FastGELUActivation"}
_GELU_CLASSES = {"GELUActivation"}
_SILU_CLASSES = {"SiLU", "SiLUActivation"}

RECORD_KEY = "moetrain_moefy"  # the entry of a Hugging Face config (config.json) recording moefy calls
RECORD_FORMAT = 1
# MoEConfig fields a call gives or the FFN decides: not part of a call's recorded ``options``.
_NOT_OPTIONS = ("d_model", "d_ff", "activation", "expert_bias", "num_experts", "top_k")


@dataclass
class DenseWeights:
    """An FFN as ``act(x @ w1_DH + b1_H) @ w2_FD + b2_D``; for SwiGLU ``H = 2F``, the gate's columns
    first, then the up projection's (``silu(h[:, :F]) * h[:, F:]``). ``after``: a module applied to
    the output (a dropout), kept."""

    w1_DH: torch.Tensor
    b1_H: torch.Tensor | None
    w2_FD: torch.Tensor
    b2_D: torch.Tensor | None
    activation: str
    after: nn.Module | None = None

    @property
    def d_model(self) -> int:
        return self.w1_DH.shape[0]

    @property
    def d_ff(self) -> int:
        return self.w2_FD.shape[0]


def _activation_name(module, gated: bool = False) -> str | None:
    name = type(module).__name__
    if gated:
        return "swiglu" if name in _SILU_CLASSES or module is torch.nn.functional.silu else None
    if isinstance(module, nn.ReLU):
        return "relu"
    if isinstance(module, nn.GELU):
        return "gelu_tanh" if module.approximate == "tanh" else "gelu"
    if name in _GELU_TANH_CLASSES:
        return "gelu_tanh"
    if name in _GELU_CLASSES:
        return "gelu"
    return None


def _linear(module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(weight [in, out], bias [out] or None)`` of an ``nn.Linear`` or a GPT-2 ``Conv1D``."""
    if isinstance(module, nn.Linear):
        return module.weight.detach().t(), None if module.bias is None else module.bias.detach()
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return module.weight.detach(), None if module.bias is None else module.bias.detach()
    return None


def read_dense_ffn(module: nn.Module) -> DenseWeights | None:
    """The weights of a supported FFN (see the module docstring); None for anything else."""
    if all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        gate, up, down = _linear(module.gate_proj), _linear(module.up_proj), _linear(module.down_proj)
        activation = _activation_name(module.act_fn, gated=True)
        if None in (gate, up, down) or activation is None:
            return None
        biases = (gate[1], up[1])
        b1 = (
            None
            if all(b is None for b in biases)
            else torch.cat([_or_zeros(b, w) for b, (w, _) in zip(biases, (gate, up), strict=True)])
        )
        return DenseWeights(torch.cat([gate[0], up[0]], dim=1), b1, down[0], down[1], activation)
    if all(hasattr(module, name) for name in ("c_fc", "c_proj", "act")):
        fc, proj, activation = _linear(module.c_fc), _linear(module.c_proj), _activation_name(module.act)
        if None in (fc, proj) or activation is None:
            return None
        return DenseWeights(fc[0], fc[1], proj[0], proj[1], activation, getattr(module, "dropout", None))
    if isinstance(module, nn.Sequential) and len(module) in (3, 4):
        fc, proj, activation = _linear(module[0]), _linear(module[2]), _activation_name(module[1])
        after = module[3] if len(module) == 4 else None
        if (
            None in (fc, proj)
            or activation is None
            or (after is not None and not isinstance(after, nn.Dropout))
        ):
            return None
        return DenseWeights(fc[0], fc[1], proj[0], proj[1], activation, after)
    return None


def _or_zeros(bias: torch.Tensor | None, weight_DF: torch.Tensor) -> torch.Tensor:
    return bias if bias is not None else weight_DF.new_zeros(weight_DF.shape[1])


def _matcher(match) -> Callable[[str, nn.Module], bool]:
    if isinstance(match, str):
        return lambda name, module: fnmatch.fnmatchcase(name, match)
    if isinstance(match, type) or (isinstance(match, tuple) and all(isinstance(t, type) for t in match)):
        return lambda name, module: isinstance(module, match)
    if callable(match):
        return match
    raise ValueError(
        f"match must be a module name pattern (str), a module type or tuple of types, or a callable "
        f"(name, module) -> bool, got {match!r}"
    )


def upcycle_into(layer: MoELayer, dense: DenseWeights) -> None:
    """Copies the dense FFN into every (local) expert of ``layer``."""
    experts = layer.experts
    with torch.no_grad():
        experts.w1_EDF.copy_(dense.w1_DH.unsqueeze(0).expand_as(experts.w1_EDF))
        experts.w2_EFD.copy_(dense.w2_FD.unsqueeze(0).expand_as(experts.w2_EFD))
        if experts.b1_EF is not None:
            experts.b1_EF.copy_(_or_zeros(dense.b1_H, dense.w1_DH).unsqueeze(0).expand_as(experts.b1_EF))
            b2 = dense.b2_D if dense.b2_D is not None else dense.w2_FD.new_zeros(dense.d_model)
            experts.b2_ED.copy_(b2.unsqueeze(0).expand_as(experts.b2_ED))


def moefy(
    model: nn.Module,
    *,
    match,
    num_experts: int,
    top_k: int = 2,
    upcycle: bool = True,
    **moe_options,
) -> list[str]:
    """Replaces the FFNs of ``model`` that ``match`` selects with MoELayers, in place; returns their
    names.

    ``match``: a glob over module names (``"transformer.h.*.mlp"``), a module type (or a tuple of
    types), or ``callable(name, module) -> bool``. Each matched module must be a supported FFN (see
    the module docstring). ``num_experts``, ``top_k`` and any other :class:`~moetrain.MoEConfig`
    option (``moe_options``) configure the layers; ``d_model``, ``d_ff``, ``activation`` and
    ``expert_bias`` come from the FFN (passing them is an error). Defaults that differ from
    MoEConfig's: dropless routing in training and in evaluation (``capacity_factor=None``,
    ``eval_capacity_factor=None``) and, with ``upcycle``, normalised gates (``normalize_gates=True``,
    which the step-0 equality needs; with ``top_k=1`` the gate is then 1 and the router learns
    through the aux loss only). The new layers hold every expert and take the FFN's device, dtype
    and training or evaluation mode; expert parallelism is applied afterwards
    (:func:`moetrain.parallelize` with ``expert``, or :func:`moetrain.shard_experts`).

    A Hugging Face model (``model.config`` a ``PretrainedConfig``) gets the call recorded in
    ``model.config.moetrain_moefy`` (see the module docstring): ``save_pretrained`` then writes it
    to ``config.json`` and :func:`from_pretrained` gives the MoE model back. Call ``moefy`` on the
    model you will save (the recorded names are relative to it).
    """
    from_the_ffn = sorted(set(moe_options) & set(_NOT_OPTIONS))
    if from_the_ffn:
        raise ValueError(
            f"moefy: {', '.join(from_the_ffn)} come from the FFN (or are moefy's own arguments), not from "
            "moe_options: the experts copy the FFN, and the recorded call rebuilds them from it"
        )
    accepts = _matcher(match)
    chosen = [(name, module) for name, module in model.named_modules() if name and accepts(name, module)]
    if not chosen:
        raise ValueError(f"match {match!r} selects no module of {type(model).__name__}")
    dropless = {"capacity_factor": None, "eval_capacity_factor": None}
    options = {**dropless, **({"normalize_gates": True} if upcycle else {}), **moe_options}
    layers = []  # every match read and its layer built before the model changes: an error leaves it whole
    for name, module in chosen:
        dense = read_dense_ffn(module)
        if dense is None:
            raise ValueError(
                f"module {name!r} ({type(module).__name__}) is not a supported FFN: nn.Sequential(Linear, "
                "ReLU/GELU, Linear[, Dropout]), a GPT-2 MLP (c_fc, act, c_proj) or a gated MLP (gate_proj, "
                "up_proj, down_proj, SiLU act_fn)"
            )
        has_bias = dense.b1_H is not None or dense.b2_D is not None
        config = config_from_dict(
            MoEConfig,
            {
                "d_model": dense.d_model,
                "d_ff": dense.d_ff,
                "num_experts": num_experts,
                "top_k": top_k,
                "activation": dense.activation,
                "expert_bias": has_bias,
                **options,
            },
            "moefy",
        )
        with experts_on_meta(False):  # every expert is the FFN's copy: built whole, here
            layer = MoELayer(config).to(device=dense.w1_DH.device, dtype=dense.w1_DH.dtype)
        if upcycle:
            upcycle_into(layer, dense)
        layer.train(module.training)  # an eval() model's new layer routes as in evaluation
        layers.append((name, layer if dense.after is None else nn.Sequential(layer, dense.after)))
    for name, replacement in layers:
        model.set_submodule(name, replacement)
    replaced = [name for name, _ in layers]
    resolved = {key: value for key, value in asdict(config).items() if key not in _NOT_OPTIONS}
    _record(model, {"modules": replaced, "num_experts": num_experts, "top_k": top_k, "options": resolved})
    log.info(
        "moefy: %d FFN(s) replaced by MoELayers of %d experts (upcycled: %s)",
        len(replaced),
        num_experts,
        upcycle,
    )
    return replaced


# ------------------------------------------------------------------------------------------------
# Hugging Face round trip: the record in the config, and loading a saved folder back.


def _record(model: nn.Module, call: dict[str, Any]) -> None:
    """Appends ``call`` to ``model.config.moetrain_moefy`` when ``model`` has a Hugging Face config
    (a new dict each time: an earlier record is never mutated). Earlier calls whose modules are not
    MoE layers, or were FFNs until this call, are dropped with a warning: the model was rebuilt
    dense with the record in its config (a moefied folder loaded by plain transformers)."""
    config = getattr(model, "config", None)
    if not callable(getattr(config, "to_json_string", None)):
        return
    call = json.loads(json.dumps(call))  # plain JSON values, as config.json will hold them
    earlier = getattr(config, RECORD_KEY, None)
    calls = list(earlier["moefied"]) if isinstance(earlier, dict) and "moefied" in earlier else []
    just_swapped = set(call["modules"])  # FFNs until this call: an earlier record of them is stale

    def current(earlier_call) -> bool:
        names = earlier_call.get("modules", ()) if isinstance(earlier_call, dict) else ()
        return all(_holds_moe(model, name) and name not in just_swapped for name in names)

    kept = [earlier_call for earlier_call in calls if current(earlier_call)]
    if len(kept) < len(calls):  # e.g. a moefied folder loaded by plain transformers: dense again
        log.warning(
            "moefy: %s's config recorded %d moefy call(s) whose modules were not MoE layers; dropped from "
            "%s (the model was rebuilt dense, e.g. by plain transformers from_pretrained)",
            type(model).__name__, len(calls) - len(kept), RECORD_KEY,
        )  # fmt: skip
    setattr(config, RECORD_KEY, {"format": RECORD_FORMAT, "moefied": [*kept, call]})


def _holds_moe(model: nn.Module, name: str) -> bool:
    """Whether module ``name`` of ``model`` is what moefy puts in place of an FFN."""
    module = _submodule(model, name)
    if isinstance(module, nn.Sequential) and len(module) > 0:
        module = module[0]
    return isinstance(module, MoELayer)


def _record_problem(record: Any) -> str | None:
    """What is wrong with a ``moetrain_moefy`` record (None: its shape is right; the option values
    are checked by MoEConfig when the calls are replayed)."""
    if not isinstance(record, dict):
        return f"a mapping expected, got {type(record).__name__}"
    if record.get("format") != RECORD_FORMAT:
        return f"format {record.get('format')!r}, this moetrain reads format {RECORD_FORMAT}"
    calls = record.get("moefied")
    if not isinstance(calls, list) or not calls:
        return "'moefied' must be a non-empty list of moefy calls"
    for index, call in enumerate(calls):
        where = f"moefied[{index}]"
        if not isinstance(call, dict):
            return f"{where} must be a mapping, got {type(call).__name__}"
        missing = [key for key in ("modules", "num_experts", "top_k", "options") if key not in call]
        if missing:
            return f"{where} lacks {', '.join(missing)}"
        modules = call["modules"]
        if not isinstance(modules, list) or not modules or not all(isinstance(m, str) for m in modules):
            return f"{where}.modules must be a non-empty list of module names, got {modules!r}"
        if not isinstance(call["options"], dict):
            return f"{where}.options must be a mapping of MoEConfig options, got {call['options']!r}"
        clashing = sorted(set(call["options"]) & set(_NOT_OPTIONS))
        if clashing:
            return f"{where}.options may not set {', '.join(clashing)} (given by the call or the FFN)"
    return None


def read_moefy_record(path: str | os.PathLike) -> dict[str, Any]:
    """The ``moetrain_moefy`` record of the Hugging Face folder ``path`` (or of a ``config.json``
    file), read as JSON and checked; ``ValueError`` (one line naming the folder) when the folder
    has no config, the config has no record, or the record is malformed."""
    path = Path(path)
    file = path if path.is_file() else path / "config.json"
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: no config.json (not a Hugging Face model folder)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{file}: unreadable config ({type(error).__name__}: {error})") from None
    if not isinstance(config, dict) or RECORD_KEY not in config:
        raise ValueError(
            f"{path}: config.json has no {RECORD_KEY!r} entry, so the MoE options are unknown: the folder "
            "was not saved from a moetrain.moefy-ed model (load it with transformers' from_pretrained), or "
            "its config was rewritten without the entry"
        )
    problem = _record_problem(config[RECORD_KEY])
    if problem is not None:
        raise ValueError(f"{file}: invalid {RECORD_KEY!r} entry: {problem}")
    return config[RECORD_KEY]


def replay_moefy(model: nn.Module, record: dict[str, Any], source: str = "the record") -> list[str]:
    """Applies the ``moefy`` calls of ``record`` to ``model`` (the dense model they were made on),
    with freshly initialised experts (``upcycle=False``: the weights are loaded afterwards) and the
    recorded options; returns the replaced names. ``ValueError`` naming ``source`` when a recorded
    module is missing or the options are invalid."""
    problem = _record_problem(record)
    if problem is not None:
        raise ValueError(f"{source}: invalid {RECORD_KEY!r} entry: {problem}")
    replaced: list[str] = []
    for index, call in enumerate(record["moefied"]):
        wanted = list(call["modules"])
        absent = [name for name in wanted if _submodule(model, name) is None]
        if absent:
            raise ValueError(
                f"{source}: invalid {RECORD_KEY!r} entry: moefied[{index}] names module {absent[0]!r}, "
                f"which {type(model).__name__} does not have (another model class, or moefy was called on "
                "a submodule)"
            )
        chosen = set(wanted)
        try:
            replaced += moefy(
                model,
                match=lambda name, module, chosen=chosen: name in chosen,
                num_experts=call["num_experts"],
                top_k=call["top_k"],
                upcycle=False,
                **call["options"],
            )
        except (ValueError, TypeError) as error:
            message = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise ValueError(f"{source}: invalid {RECORD_KEY!r} entry: moefied[{index}]: {message}") from None
    return replaced


def _submodule(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def build_moefied(model_class, path: str | os.PathLike, **config_kwargs) -> nn.Module:
    """The moefied model the Hugging Face folder ``path`` describes, with fresh weights: the config
    (``transformers.AutoConfig``, ``config_kwargs`` overriding its values), ``model_class`` built
    from it (``from_config`` for the ``AutoModel*`` classes, the constructor otherwise), then the
    recorded ``moefy`` calls replayed. Load weights into it afterwards (:func:`from_pretrained`
    does, and ``moetrain export-hf`` loads a moetrain checkpoint)."""
    import transformers

    path = Path(path)
    folder = path.parent if path.is_file() else path
    if config_kwargs.pop("trust_remote_code", False):
        raise ValueError(f"{folder}: trust_remote_code: moetrain never runs code from a model folder")
    record = read_moefy_record(folder)
    config = transformers.AutoConfig.from_pretrained(str(folder), trust_remote_code=False, **config_kwargs)
    delattr(config, RECORD_KEY)  # replaying the calls records them again, identically
    factory = getattr(model_class, "from_config", None)
    model = factory(config, trust_remote_code=False) if callable(factory) else model_class(config)
    replay_moefy(model, record, str(folder / "config.json"))
    return model


def _index_entry(folder: Path, index: Path, name: Any) -> Path:
    """The weight file ``name`` that ``index`` lists, in ``folder``: a plain file name (not absolute,
    no path separator, no ``..``), so the index cannot name a file elsewhere. A link the folder
    itself holds is followed (a Hugging Face hub snapshot links each shard to its blob). A one-line
    ``ValueError`` naming the index file and the entry otherwise."""
    plain = isinstance(name, str) and name not in ("", ".") and ".." not in name
    if not plain or os.path.isabs(name) or "/" in name or "\\" in name:
        raise ValueError(
            f"{index}: weight_map entry {name!r}: must be a file name in {folder} "
            "(not absolute, no path separator, no '..')"
        )
    return folder / name


def _safetensors_files(folder: Path) -> list[Path]:
    """The safetensors files of ``folder``: those ``model.safetensors.index.json`` lists (each checked
    by :func:`_index_entry`), else ``model.safetensors``. One-line ``ValueError`` otherwise."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as error:
            raise ValueError(f"{index}: not a safetensors index ({type(error).__name__}: {error})") from None
        return [_index_entry(folder, index, name) for name in sorted(names, key=str)]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise ValueError(
        f"{folder}: no model.safetensors or model.safetensors.index.json (moetrain.moefy.from_pretrained "
        "reads safetensors weights only, never pickles)"
    )


def _read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of safetensors ``file`` on the CPU; a file that is missing or not safetensors is a
    one-line ``ValueError`` naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(file), device="cpu")
    except (SafetensorError, OSError) as error:
        line = (str(error).strip().splitlines() or [""])[0]
        raise ValueError(
            f"{file}: not a readable safetensors file ({type(error).__name__}: {line})"
        ) from None


def load_safetensors_strictly(
    model: nn.Module, folder: str | os.PathLike, *, keep_saved_dtypes: bool = True
) -> None:
    """Loads the safetensors weights of ``folder`` into ``model``: every saved tensor must be one
    of the model's, of the same shape, and every entry of the model's state dict must be saved,
    except a parameter tied to a saved one (``lm_head.weight`` of a model with tied embeddings,
    which ``save_pretrained`` leaves out). ``keep_saved_dtypes``: each floating tensor takes the
    saved dtype (exact values); otherwise values are cast to the model's dtypes. Only files in
    ``folder`` are read: an index entry naming another place, or a file that is not safetensors,
    is a one-line ``ValueError`` naming it; so are weights that do not fit (the first offending keys)."""
    folder = Path(folder)
    saved: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(folder):
        saved.update(_read_safetensors(file))
    own = model.state_dict()
    unexpected = sorted(set(saved) - set(own))
    names_by_tensor: dict[int, set[str]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]:
        names_by_tensor.setdefault(id(tensor), set()).add(name)
    tied = {name for names in names_by_tensor.values() if names & set(saved) for name in names - set(saved)}
    missing = sorted(set(own) - set(saved) - tied)
    mismatched = [
        f"{name} {tuple(saved[name].shape)} vs {tuple(own[name].shape)}"
        for name in sorted(set(saved) & set(own))
        if saved[name].shape != own[name].shape
    ]
    if unexpected or missing or mismatched:
        parts = [
            f"{label} {', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''} ({len(keys)})"
            for label, keys in (("unexpected", unexpected), ("missing", missing), ("shape", mismatched))
            if keys
        ]
        raise ValueError(
            f"{folder}: the saved weights do not fit the moefied {type(model).__name__}: {'; '.join(parts)}"
        )
    if keep_saved_dtypes:
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            value = saved.get(name)
            if value is not None and value.is_floating_point() and tensor.dtype != value.dtype:
                tensor.data = tensor.data.to(value.dtype)
    model.load_state_dict(saved, strict=False)  # the tied entries were checked above


def from_pretrained(
    model_class,
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    **config_kwargs,
) -> nn.Module:
    """The moefied model that ``model.save_pretrained(path)`` saved, exactly: ``model_class`` (a
    transformers class such as ``AutoModelForCausalLM`` or ``GPT2LMHeadModel``) built from the
    folder's config, the ``moefy`` calls its ``moetrain_moefy`` entry records replayed, and the
    safetensors weights loaded strictly (every saved tensor used, none missing). In ``eval()``
    mode, as transformers returns models.

    ``path``: a local folder (nothing is downloaded, nothing in it is executed). ``dtype``: cast
    the model to it (default: each tensor keeps its saved dtype); ``device``: move it there;
    ``config_kwargs``: config values to override (``transformers.AutoConfig.from_pretrained``'s
    keyword arguments). ``ValueError`` with one line naming the folder when the config has no
    ``moetrain_moefy`` entry, when the entry is invalid, or when the weights do not fit.
    """
    folder = Path(path)
    model = build_moefied(model_class, folder, **config_kwargs)
    if dtype is not None:
        model.to(dtype)
    load_safetensors_strictly(model, folder, keep_saved_dtypes=dtype is None)
    if (folder / "generation_config.json").is_file() and hasattr(model, "generation_config"):
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(str(folder))
    if device is not None:
        model.to(device)
    log.info("moefy: loaded %s (%s) from %s", type(model).__name__, _describe(model), folder)
    return model.eval()


def _describe(model: nn.Module) -> str:
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    experts = sorted({layer.config.num_experts for layer in layers})
    return f"{len(layers)} MoELayers of {'/'.join(map(str, experts))} experts"


# ``moetrain.moefy`` is the function once the package is imported (``moetrain/__init__.py`` exports
# it under the module's name): the loader is reachable as ``moetrain.moefy.from_pretrained`` too.
moefy.from_pretrained = from_pretrained
