"""Pipeline stages, round 4: a checkpoint saved without stages resumes under ``pp_size 2`` with
every stage of the pipeline on one data stream; a tied parameter cut across pipeline ranks is
refused; the layout errors name the keys and the values allowed."""

from __future__ import annotations

import pytest
import torch

from moe_lm import LMConfig, MoETransformerLM, default_lm_strategy
from moetrain import MoEConfig, ParallelConfig, ParallelContext, parallelize
from moetrain.parallel import check_sizes
from moetrain.pipeline import balance_layers, stage_layers
from tests.distributed.test_pipeline import _approx, _engine_config, _metrics, _train
from tests.helpers.dist_utils import run_distributed


def resume_worker(rank, world, out_dir):
    """Resumes ``out_dir``'s checkpoint under pp_size 2: the first batch this rank draws after
    resuming, then the metrics of the steps it trains."""
    from moetrain.config import TrainConfig, config_from_dict
    from moetrain.engine import Trainer

    trainer = Trainer(config_from_dict(TrainConfig, _engine_config(out_dir, world)))
    try:
        trainer.maybe_resume()
        inputs, targets = trainer.batches.next()
        history = trainer.train()  # resumes again: the batch drawn above is not skipped
        return inputs, targets, _metrics(history)
    finally:
        trainer.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_checkpoint_without_stages_resumes_under_pp2_on_one_data_stream(tmp_path):
    """pp 1 to step 2, then pp 2 on two ranks from its checkpoint: both stages draw the same next
    batch (the saved position of the pipeline's first stage), and steps 3-4 equal the run that was
    never interrupted."""
    straight = _train(_engine_config(tmp_path / "straight"))
    _train(_engine_config(tmp_path / "resumed"), until=2)
    ranks = run_distributed(resume_worker, 2, str(tmp_path / "resumed"), timeout=100)
    (inputs_0, targets_0, history), (inputs_1, targets_1, _) = ranks
    assert torch.equal(inputs_0, inputs_1) and torch.equal(targets_0, targets_1)
    _approx(history, straight[2:])


LM = LMConfig(
    vocab_size=64,
    d_model=32,
    num_layers=4,
    num_heads=2,
    max_seq_len=8,
    moe=MoEConfig(d_model=32, d_ff=32, num_experts=4, top_k=2, capacity_factor=None),
)


def tied_worker(rank, world):
    """pp_size 2 on a model whose head is its embedding's matrix (one on each stage): the error of
    this rank; then a tie inside rank 0's stage (blocks 0 and 1, cut at layer 2): accepted."""
    parallel = ParallelContext(ParallelConfig(pp_size=2, pp_schedule="gpipe", pp_layers=[2]))
    tied = MoETransformerLM(LM, seed=1)
    tied.head.weight = tied.embed.weight
    try:
        parallelize(tied, parallel, default_lm_strategy(LM, 1, 2))
        error = None
    except ValueError as caught:
        error = str(caught)
    inside = MoETransformerLM(LM, seed=1)
    inside.blocks[1].attn_norm.weight = inside.blocks[0].attn_norm.weight
    trained = parallelize(inside, parallel, default_lm_strategy(LM, 1, 2))
    return error, trained.pipeline is not None


@pytest.mark.timeout(60)
def test_a_tied_parameter_cut_across_pipeline_ranks_is_refused_on_every_rank():
    for error, built in run_distributed(tied_worker, 2, timeout=50):
        assert error is not None and "\n" not in error
        assert "parameters embed.weight, head.weight are one tied tensor" in error, error
        assert "pipeline ranks [0, 1] (parallel.pp_size = 2)" in error and "parallel.pp_size = 1" in error
        assert built


def test_layout_errors_name_the_keys_and_the_values_allowed():
    with pytest.raises(ValueError) as caught:
        check_sizes(2, 2, pp_size=2)
    assert str(caught.value) == (
        "ep_size = 2 must divide the ranks of one pipeline stage = 1 (world size 2 / pp_size 2) "
        "(possible: [1])"
    )
    with pytest.raises(
        ValueError, match=r"^pp_size = 4 must divide the world size = 6 \(possible: \[1, 2, 3, 6\]\)$"
    ):
        check_sizes(6, 1, pp_size=4)
    with pytest.raises(
        ValueError, match=r"^ep_size = 3 must divide the world size = 4 \(possible: \[1, 2, 4\]\)$"
    ):
        check_sizes(4, 3)  # without stages: as before
    too_few = r"^parallel.pp_size \* parallel.pp_virtual = 2 stages must be <= model.num_layers = 1 "
    with pytest.raises(ValueError, match=too_few):
        balance_layers([1.0], 2)
    with pytest.raises(ValueError, match=too_few):
        stage_layers(1, 2, [1])
    for boundaries in ([0], [4], [2, 3]):
        with pytest.raises(ValueError, match=r"^parallel.pp_layers = .* increasing layer indices in 1..3 \("):
            stage_layers(4, 2, boundaries)
