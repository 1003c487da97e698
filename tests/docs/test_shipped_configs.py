"""Every configuration we ship trains, in every precision layout.

Every config file of the repository (``configs/``, ``models/*/``, any yaml under ``scripts/``) and
every model preset (a config ``{"model": {"name": ..., "preset": ...}}``) is shrunk in size only,
through the same ``--set`` overrides users have (layers, widths, experts, image size, sequence
length, vocabulary, data, steps, ``ep_size`` to what 2 gloo ranks hold, a positive recompute
budget to one that plans a partial recompute of the shrunk model, the exact updates before the
delayed optimizer update to 1); everything else is kept: precision, ``param_dtype``, optimizer and
its overlap, recompute on or off, all-to-all algorithm, prototypes, capacity, ``moe_every``. Each
is crossed with the precision layouts below and runs two training steps, a checkpoint, a resume
that restores the exact weights, and one more step. A new config file or preset is covered
without editing this file; a new model needs a shrink rule in ``SHRINK`` (the test for it fails
until it has one).

Cases with ``ep_size > 1`` run in one 2-rank gloo job per session (each case reported on its own).
"""

from __future__ import annotations

import contextlib
import logging
import logging.handlers
import math
import sys
from pathlib import Path

import pytest
import torch

from moetrain.config import TrainConfig, config_from_dict, model_config_classes, preset_names
from moetrain.config.files import apply_overrides, build_train_config, load_config_file
from tests.helpers.dist_utils import run_distributed
from tests.helpers.paths import ROOT

CONFIG_FILES = sorted(
    {*ROOT.glob("configs/*.yaml"), *ROOT.glob("models/*/*.yaml"), *ROOT.glob("scripts/**/*.yaml")}
)
PRESETS = [(name, preset) for name, cls in model_config_classes().items() for preset in preset_names(cls)]

LAYOUTS = {
    "fp32": ["precision=fp32", "param_dtype=fp32"],
    "bf16-autocast": ["precision=bf16", "param_dtype=fp32"],
    "fp16-autocast": ["precision=fp16", "param_dtype=fp32"],  # + the engine's loss scaling
    "bf16-weights": ["precision=bf16", "param_dtype=bf16", "optim.name=offload"],
    "fp16-weights": ["precision=fp16", "param_dtype=fp16", "optim.name=offload"],
}

# MiB, for a config's positive budget (a partial plan, as the planner's for the full model): between
# the shrunk m6_1t's least activation memory (every block recomputed: 0.06-0.13 MiB in the layouts
# below) and its activations without recompute (0.25-0.37 MiB)
RECOMPUTE_BUDGET_MB = 0.19
DELAYED = "later are delayed by one step"  # the offload optimizer's INFO line when its delayed update starts


def _shrink_m6(model: dict) -> list[str]:
    experts = model.get("moe", {}).get("num_experts", 4)
    return [
        "model.d_model=32",
        "model.num_heads=2",
        "model.d_ff=64",
        f"model.num_layers={min(model.get('num_layers', 4), 2)}",
        "model.max_text_len=32",
        "model.image_size=16",
        "model.patch_size=8",
        "model.stem_channels=[8]",
        "model.vocab_size=300",  # the byte tokenizer's 275 ids fit
        "model.moe.d_ff=32",
        f"model.moe.num_experts={experts if experts <= 4 else 4}",
        "data.seq_len=12",
    ]


def _shrink_lm(model: dict) -> list[str]:
    experts = model.get("moe", {}).get("num_experts", 4)
    return [
        "model.d_model=32",
        "model.num_heads=2",
        f"model.num_layers={min(model.get('num_layers', 2), 2)}",
        "model.max_seq_len=16",
        "model.moe.d_ff=32",
        f"model.moe.num_experts={experts if experts <= 4 else 4}",
        "data.seq_len=16",
    ]


SHRINK = {
    "m6_moe": _shrink_m6,
    "moe_lm": _shrink_lm,
    "my_moe_classifier": lambda model: ["model.moe.d_ff=16"],  # scripts/examples/own_model: tiny already
    "hf_moefy": lambda model: [],  # scripts/examples/hf_moefy: a tiny GPT-2 built from its config already
}


def _load(path: Path) -> dict:
    """A config file as users load it: modules under ``imports`` are looked up beside it."""
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    return load_config_file(str(path))


def _sources() -> list[tuple[str, dict]]:
    found = [(path.relative_to(ROOT).as_posix(), _load(path)) for path in CONFIG_FILES]
    found += [
        (f"preset {name}/{preset}", {"model": {"name": name, "preset": preset}}) for name, preset in PRESETS
    ]
    return found


def _effective_model(data: dict) -> dict:
    """The model section with a preset's values filled in (what the shrink rule reads)."""
    from moetrain.config import preset_as_dict

    model = dict(data["model"])
    if "preset" in model:
        cls = model_config_classes()[model["name"]]
        model = {**preset_as_dict(cls, model["preset"]), **model}
    return model


def _ep_size(data: dict) -> int:
    return min(data.get("parallel", {}).get("ep_size", 1), 2)


def shrunk_overrides(data: dict, layout: str, out_dir: Path, manifest: Path) -> list[str]:
    model = _effective_model(data)
    name = model["name"]
    assert name in SHRINK, f"model {name!r} has no shrink rule: add one to SHRINK in {__file__}"
    overrides = SHRINK[name](model)
    ep = _ep_size(data)
    overrides += [
        f"parallel.ep_size={ep}",
        "data.micro_batch_size=2",
        "steps=2",
        "log_every=1",
        "threads=1",
        "device=cpu",
        f"out_dir={out_dir}",
    ]
    if name == "m6_moe":
        overrides.append(f"data.source={manifest}")  # a small manifest in place of any corpus
    if data.get("parallel", {}).get("all_to_all") == "hierarchical" and ep > 1:
        overrides.append("parallel.local_world_size=1")  # 2 emulated nodes: the 2-D exchange runs
    if data.get("recompute_budget_mb") is not None:  # 0 (the least activation memory) stays 0
        overrides.append(f"recompute_budget_mb={RECOMPUTE_BUDGET_MB if data['recompute_budget_mb'] else 0}")
    if data.get("optim", {}).get("overlap_after_steps", 0) > 1:
        overrides.append("optim.overlap_after_steps=1")  # one exact update, then the delayed ones
    return overrides + LAYOUTS[layout]


def _config(data: dict, overrides: list[str]) -> TrainConfig:
    return config_from_dict(TrainConfig, apply_overrides(data, overrides))


def run_case(data: dict, layout: str, out_dir: Path, manifest: Path) -> dict:
    """Two steps, checkpoint, resume into a new Trainer (weights must be restored exactly), one more
    step. Returns what the test checks."""
    from moetrain.engine import Trainer

    config = _config(data, shrunk_overrides(data, layout, out_dir, manifest))
    with _records("moetrain.offload") as records:
        first = Trainer(config)
        history = first.train()
        first.close()
        saved = {k: v.detach().clone() for k, v in first.model.state_dict().items()}
        resumed_config = _config(data, [*shrunk_overrides(data, layout, out_dir, manifest), "steps=3"])
        second = Trainer(resumed_config)
        second.maybe_resume()
        restored = all(torch.equal(v, saved[k]) for k, v in second.model.state_dict().items())
        more = second.train()
        second.close()
    plan = first.recompute_plan
    memory = None if plan is None else [plan.min_activation_bytes, plan.activation_bytes, plan.baseline_bytes]
    return {
        "precision": config.precision,
        "param_dtype": config.param_dtype,
        "losses": [m["loss"] for m in history] + [m["loss"] for m in more],
        "grad_norms": [m["grad_norm"] for m in history + more if not m.get("skipped", False)],
        "resumed_at": history[-1]["step"] if history else None,
        "restored": restored,
        "steps": [m["step"] for m in history + more],
        "recompute": None if plan is None else sorted(plan.recomputed),
        "recompute_bytes": memory,  # least, kept with the plan, without recompute
        "delayed": any(DELAYED in record.getMessage() for record in records),
    }


@contextlib.contextmanager
def _records(name: str):
    """The INFO and higher records of logger ``name`` (and its children) while in the block."""
    logger, handler = logging.getLogger(name), logging.handlers.BufferingHandler(capacity=10**6)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler.buffer
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


CASES = [(label, layout) for label, _ in _sources() for layout in LAYOUTS]
_DATA = dict(_sources())


@pytest.fixture(scope="session")
def manifest(tmp_path_factory) -> Path:
    from m6_moe import ensure_synthetic_dataset

    directory = tmp_path_factory.mktemp("shipped_data")
    data = ensure_synthetic_dataset(directory / "data", num_train=24, num_heldout=2, size=16, progress=False)
    return data / "train.jsonl"


def _two_rank_worker(rank: int, world: int, cases: list, root: str, manifest: str) -> dict:
    results = {}
    for label, layout in cases:
        out_dir = Path(root) / f"{label.replace('/', '_').replace(' ', '_')}-{layout}"
        try:
            results[(label, layout)] = run_case(_DATA[label], layout, out_dir, Path(manifest))
        except Exception as error:  # noqa: BLE001 - reported per case
            results[(label, layout)] = {"error": f"{type(error).__name__}: {error}"}
    return results


@pytest.fixture(scope="session")
def two_rank_results(tmp_path_factory, manifest) -> dict:
    cases = [(label, layout) for label, layout in CASES if _ep_size(_DATA[label]) > 1]
    if not cases:
        return {}
    root = tmp_path_factory.mktemp("shipped_ep2")
    per_rank = run_distributed(_two_rank_worker, 2, cases, str(root), str(manifest), timeout=600)
    return per_rank[0]


def test_every_shipped_file_and_preset_is_covered():
    labels = {label for label, _ in _sources()}
    assert {"configs/m6_1t.yaml", "configs/tiny_lm.yaml", "models/m6_moe/tiny.yaml"} <= labels
    assert {"preset m6_moe/tiny", "preset m6_moe/1T"} <= labels
    for label, data in _sources():  # the unshrunk file or preset is itself a valid config
        if "preset" not in data["model"]:
            build_train_config(str(ROOT / label), [])


@pytest.mark.slow
@pytest.mark.parametrize("label,layout", CASES, ids=[f"{label}-{layout}" for label, layout in CASES])
def test_shipped_config_trains(label, layout, tmp_path, manifest, two_rank_results):
    data = _DATA[label]
    if _ep_size(data) > 1:
        result = two_rank_results[(label, layout)]
    else:
        result = run_case(data, layout, tmp_path / "run", manifest)
    assert "error" not in result, result.get("error")
    assert result["precision"] == LAYOUTS[layout][0].split("=")[1]
    assert result["steps"] == [1, 2, 3] and result["restored"], result
    # fp16 may skip a step whose scaled gradients overflow (the loss scaler's calibration)
    assert result["grad_norms"] and all(math.isfinite(x) for x in result["losses"] + result["grad_norms"]), (
        result
    )
    if data.get("recompute_budget_mb") is not None:
        assert result["recompute"], "recompute was configured but nothing is recomputed"
    if data.get("recompute_budget_mb"):  # a positive budget: fewer blocks recomputed than at the least
        least, kept, none = result["recompute_bytes"]
        assert least < kept < none, f"not a partial recompute plan: {result['recompute_bytes']}"
    if data.get("optim", {}).get("overlap") == "delayed":
        assert result["delayed"], "optim.overlap is delayed but no update was delayed"
