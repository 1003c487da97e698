"""A loss averaged over a varying number of units (M6: its target tokens, ``loss_fn.loss_units``)
has, through the engine, the gradient of the mean over every unit of the step, whatever the
step's split into micro-batches (``grad_accum``), data streams (data / expert parallelism) or
pipeline micro-batches: ``sum_i n_i * loss_i / sum_i n_i`` with ``loss_i`` the mean over the
``n_i`` target tokens of micro-batch ``i``; the logged loss is that mean too."""

from __future__ import annotations

import copy

import pytest

from moetrain.cli import build_train_config
from moetrain.engine import Trainer
from moetrain.layers.experts import GroupedExperts
from tests.helpers.dist_utils import run_distributed
from tests.helpers.paths import ROOT

TINY = str(ROOT / "models/m6_moe/tiny.yaml")
EXACT = [
    "steps=1",
    "model.moe.capacity_factor=null",  # dropless: a token's expert does not depend on its batch
    "model.moe.aux_loss_coef=0.0",  # the balancing loss is not a mean over target tokens
    "model.moe.router_jitter=0.0",
    "model.dropout=0.0",
    "optim.grad_clip=0.0",
    "threads=1",
    "device=cpu",
]


def recorded_step(overrides: list[str]) -> dict:
    """One engine step of the tiny M6 model: the micro-batches it drew, its gradients (an expert
    parameter's with the global index of its first expert, None for the others), the logged loss."""
    trainer = Trainer(build_train_config(TINY, [*EXACT, *overrides]))
    drawn, draw = [], trainer.batches.next

    def next_batch():
        batch = draw()
        drawn.append(copy.deepcopy(batch))
        return batch

    trainer.batches.next = next_batch
    metrics = trainer.train_step()
    first = {
        f"{name}.{p}": module.first_expert
        for name, module in trainer.model.named_modules()
        if isinstance(module, GroupedExperts)
        for p, _ in module.named_parameters()
    }
    grads = {
        name: (first.get(name), p.grad.clone())
        for name, p in trainer.model.named_parameters()
        if p.grad is not None
    }
    return {"batches": drawn, "grads": grads, "loss": metrics["loss"]}


def token_mean_reference(out_dir, batches, overrides=()) -> tuple[dict, float]:
    """fp64, in this process, from the initial weights of a run with ``overrides`` (its
    ``parallel.*`` left out): the gradient and the value of ``sum_i n_i * loss_i / sum_i n_i``
    over ``batches``."""
    from m6_moe.tasks import count_target_tokens, m6_loss

    overrides = [o for o in overrides if not o.startswith("parallel.")]
    model = Trainer(build_train_config(TINY, [*EXACT, *overrides, f"out_dir={out_dir}"])).model.double()
    sums, tokens = [], []
    for inputs, labels in batches:
        inputs = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
        tokens.append(count_target_tokens(labels))
        sums.append(m6_loss(model(**inputs), labels) * tokens[-1])
    assert len(set(tokens)) > 1  # unequal target tokens: a mean of micro-batch means would be off
    loss = sum(sums) / sum(tokens)
    loss.backward()
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}, float(loss.detach())


def assert_token_mean(run: dict, reference: tuple[dict, float]) -> None:
    """Each gradient within 1e-4 of the fp64 reference's norm (fp32 sums), the logged loss too."""
    grads, loss = reference
    assert run["grads"], "the run has no gradients"
    for name, (first, grad) in run["grads"].items():
        want = grads[name] if first is None else grads[name][first : first + grad.shape[0]]
        error = float((grad.double() - want).norm()) / max(float(want.norm()), 1e-30)
        assert error < 1e-4, f"{name}: gradient {error:.3g} away from the token mean's (relative norm)"
    assert run["loss"] == pytest.approx(loss, rel=1e-5)


@pytest.mark.timeout(300)
def test_grad_accum_split_has_the_gradient_of_the_mean_over_every_target_token(tmp_path):
    """8 samples as micro-batch 8 x grad_accum 1 and as 4 x 2: both the token mean."""
    from m6_moe.tasks import count_target_tokens

    whole = recorded_step(["data.micro_batch_size=8", "grad_accum=1", f"out_dir={tmp_path / 'whole'}"])
    split = recorded_step(["data.micro_batch_size=4", "grad_accum=2", f"out_dir={tmp_path / 'split'}"])
    assert len(split["batches"]) == 2
    assert sum(count_target_tokens(labels) for _, labels in split["batches"]) == count_target_tokens(
        whole["batches"][0][1]
    )  # the same 8 samples
    reference = token_mean_reference(tmp_path / "one", split["batches"])
    assert_token_mean(whole, reference)
    assert_token_mean(split, reference)


def worker(rank, world, out_dir, overrides):
    return recorded_step([*overrides, f"out_dir={out_dir}"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "layout",
    [
        ["parallel.ep_size=1", "data.micro_batch_size=2", "grad_accum=2"],  # 2 data-parallel streams
        ["parallel.ep_size=2", "data.micro_batch_size=4", "grad_accum=1"],  # 2 expert-parallel streams
        [
            "parallel.ep_size=1",
            "parallel.pp_size=2",
            "data.micro_batch_size=2",
            "grad_accum=2",
            "model.tie_embeddings=false",
        ],  # one stream
    ],
    ids=["dp", "ep", "pp"],
)
def test_ranks_have_the_gradient_of_the_mean_over_every_target_token(tmp_path, layout):
    """2 gloo ranks, 8 samples in all (4 for the pipeline's one stream): every rank's gradient and
    the logged loss are those of one process's token mean over the micro-batches the ranks drew."""
    runs = run_distributed(worker, 2, str(tmp_path / "ranks"), layout, timeout=240.0)
    pipeline = "parallel.pp_size=2" in layout
    batches = runs[0]["batches"] if pipeline else [b for run in runs for b in run["batches"]]
    reference = token_mean_reference(tmp_path / "one", batches, layout)
    for run in runs:
        assert_token_mean(run, reference)
