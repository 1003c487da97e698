"""`make demo`'s config keeps learning the captions on more than one seed (issue #31).

The demo (``models/m6_moe/demo.yaml``: 2 ranks, the experts split between them) trains for
5 to 8 minutes on 2 cores, too long for the suite twice over. This test trains the same config on the
same 2 ranks with only the run shortened: ``SHORT_STEPS`` steps with the same warm-up and a cosine
decay that ends at the last step (the schedule's shape), on seeds 0 and 1, then captions held-out
images greedily as ``scripts/demo.py`` does and asserts the floors below. They sit under what the
short run reached when measured (2026-11-27, docs/m6.md "The demo's accuracy over seeds": seed 0
30.0% exact match, colour 100%, position 100%; seed 1 29.0%, colour 100%, position 99%; shape
30% on both; re-measured 2026-11-28, after the loss became token-weighted across ranks (a1dafde):
seed 0 37% exact, colour 97%, position 96%; seed 1 31%, colour 99%, position 98%), where with
the patch positions at their old ``N(0, 0.02)`` position was still at chance after 600 steps.
So a change that slows the demo's learning (its schedule, its batch, the image stem, the patch
positions' scale, the task mix) fails here.

``make test`` trains seed 0; seed 1 is marked ``extended``: CI's ``make test-extended`` step trains
it after ``make test`` (each seed takes its 2 ranks about 2 minutes on 2 cores, a sixth of the
suite's CPU time for both).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.dist_utils import run_distributed
from tests.helpers.paths import ROOT

DEMO = ROOT / "models" / "m6_moe" / "demo.yaml"
SHORT_STEPS = 600
HELD_OUT_IMAGES = 100
# floors (see the module docstring): per attribute, the share of held-out captions that state it
# rightly, and the exact-match accuracy
ATTRIBUTE_FLOORS = {"colour": 0.95, "position": 0.9}
EXACT_MATCH_FLOOR = 0.15


def _train(rank: int, world: int, out_dir: str, seed: int) -> None:
    from moetrain.cli import build_train_config
    from moetrain.engine import Trainer

    overrides = [
        f"out_dir={out_dir}", f"seed={seed}", f"steps={SHORT_STEPS}", f"checkpoint_every={SHORT_STEPS}",
        f"parallel.ep_size={world}",
    ]  # fmt: skip
    trainer = Trainer(build_train_config(str(DEMO), overrides))
    trainer.train()
    trainer.close()


def _caption_held_out(out_dir: Path) -> dict:
    """As ``scripts/demo.py`` evaluates: the checkpoint loaded into one process (the experts
    resharded from 2 ranks to 1), greedy captions of the first held-out images."""
    import torch

    from m6_moe import load_tokenizer
    from m6_moe.evaluate import evaluate_captioning
    from m6_moe.trained_model import load_trained_model
    from moetrain.cli import build_train_config

    # threads=null: the config's one thread per rank is not imposed on this test process
    config = build_train_config(str(DEMO), [f"out_dir={out_dir}", "threads=null"])
    model, _ = load_trained_model(config, out_dir / "checkpoints", device="cpu")
    with torch.no_grad():
        return evaluate_captioning(
            model, load_tokenizer(config.model.tokenizer), out_dir / "data", limit=HELD_OUT_IMAGES,
            num_examples=0, progress=False,
        )  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.extended)])
def test_the_demo_config_learns_the_captions_on_two_seeds(tmp_path, seed):
    run_distributed(_train, 2, str(tmp_path), seed, timeout=800)
    result = _caption_held_out(tmp_path)
    attributes = result["attribute_accuracy"]
    assert all(attributes[name] >= floor for name, floor in ATTRIBUTE_FLOORS.items()), attributes
    assert result["accuracy"] >= EXACT_MATCH_FLOOR, (result["accuracy"], attributes)
    assert result["accuracy"] > result["baseline_accuracy"]
