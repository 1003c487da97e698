"""M6 cut into pipeline stages (:meth:`m6_moe.model.M6Model.pipeline_stage`) on real gloo ranks
against one process: world 4 as pp2 x ep2 (GPipe) and pp2 x dp2 (1F1B, and interleaved 1F1B with
two stages per rank). Between the stages travel the hidden states, the real positions (bool) and
the target mask; the losses, every gradient (MoE aux losses included), the global norm over both
stages and the aux losses summed over the stages equal one process accumulating the same
micro-batches. Also: batches padded to one shape change no loss, and ``tie_embeddings`` is refused
under pp."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from m6_moe.config import M6Config
from m6_moe.model import M6Model, default_m6_strategy
from m6_moe.tasks import IGNORE_INDEX, m6_loss
from moetrain import ParallelConfig, ParallelContext
from tests.distributed.test_pipeline import _check
from tests.helpers.dist_utils import run_distributed
from tests.helpers.pipeline_reference import pipeline_step_report, rel_error

CONFIG = M6Config(
    d_model=32, num_layers=4, num_heads=2, d_ff=32, max_text_len=24, image_size=16, patch_size=8,
    stem_channels=(4,), moe_every=1, tie_embeddings=False,
    moe={"d_ff": 32, "num_experts": 4, "top_k": 2, "num_prototypes": 2, "capacity_factor": None,
         "aux_loss_coef": 0.01, "z_loss_coef": 1e-3},
)  # fmt: skip
MICRO = 2  # micro-batches per step (>= stages for 1F1B)
PREFIX, TARGET = 5, 6


def _batch(index: int, batch: int = 2):
    """A micro-batch of fixed shape with padding in the prefix and the target and one sample
    without its image."""
    g = torch.Generator().manual_seed(200 + index)
    prefix_mask = torch.arange(PREFIX)[None] < torch.randint(1, PREFIX + 1, (batch, 1), generator=g)
    target_mask = torch.arange(TARGET)[None] < torch.randint(2, TARGET + 1, (batch, 1), generator=g)
    size = CONFIG.image_size
    inputs = {
        "prefix_ids": torch.randint(0, 256, (batch, PREFIX), generator=g),
        "prefix_mask": prefix_mask,
        "target_ids": torch.randint(0, 256, (batch, TARGET), generator=g),
        "target_mask": target_mask,
        "images": torch.rand(batch, 3, size, size, generator=g) * 2 - 1,
        "image_mask": torch.arange(batch) != index % batch,
    }
    labels = torch.randint(0, 256, (batch, TARGET), generator=g).masked_fill(~target_mask, IGNORE_INDEX)
    return inputs, labels


def m6_pipeline_worker(rank, world, layouts):
    reports = []
    for ep, schedule, virtual in layouts:
        config = ParallelConfig(ep_size=ep, pp_size=2, pp_schedule=schedule, pp_virtual=virtual)
        parallel = ParallelContext(config)
        torch.manual_seed(0)
        model = M6Model(CONFIG, seed=3)
        strategy = default_m6_strategy(CONFIG, 1, parallel.pp_size)
        report = pipeline_step_report(model, parallel, strategy, MICRO, _batch, m6_loss, _m6_loss_of)
        reports.append({"layout": (ep, schedule, virtual), **report})
    return reports


def _m6_loss_of(net, inputs, labels):
    return m6_loss(net(**inputs), labels)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_m6_pp2_ep2_gpipe_and_pp2_dp2_1f1b_and_interleaved_equal_one_process():
    """Interleaved 1F1B too: rank 0's second stage is not given the keyword inputs (M6's are a dict)."""
    layouts = [(2, "gpipe", 1), (1, "1f1b", 1), (1, "interleaved_1f1b", 2)]
    results = run_distributed(m6_pipeline_worker, 4, layouts)
    world_params = {name for name, _ in M6Model(CONFIG).named_parameters()}
    _check(results, world_params)
    first = {name for r in results for name in r[0]["params"] if r[0]["stage"] == 0}
    assert "stem.patchify.weight" in first and "text_embed.weight" in first and "head.weight" not in first


def test_m6_fixed_length_padding_changes_no_loss_or_gradient():
    """The pipeline pads every batch to ``L = T = seq_len``: the same loss and gradients."""
    model = M6Model(CONFIG, seed=1)
    inputs, labels = _batch(7)
    loss = m6_loss(model(**inputs), labels)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    pad = 4
    padded = {
        "prefix_ids": torch.nn.functional.pad(inputs["prefix_ids"], (0, pad)),
        "prefix_mask": torch.nn.functional.pad(inputs["prefix_mask"], (0, pad)),
        "target_ids": torch.nn.functional.pad(inputs["target_ids"], (0, pad)),
        "target_mask": torch.nn.functional.pad(inputs["target_mask"], (0, pad)),
        "images": inputs["images"],
        "image_mask": inputs["image_mask"],
    }
    padded_labels = torch.nn.functional.pad(labels, (0, pad), value=IGNORE_INDEX)
    padded_loss = m6_loss(model(**padded), padded_labels)
    padded_loss.backward()
    assert float(padded_loss) == pytest.approx(float(loss), rel=1e-5)
    for name, param in model.named_parameters():
        assert rel_error(param.grad, grads[name]) < 1e-4, name


def test_m6_collate_pads_to_seq_len_and_tied_embeddings_are_refused_under_pp():
    from m6_moe.tasks import Sample, collate
    from m6_moe.tokenizer import ByteTokenizer

    samples = [Sample(prefix=[5, 6], target=[7], image=None, task="denoise", record=0)]
    inputs, labels = collate(samples, ByteTokenizer(), (3, 16, 16), length=8)
    assert inputs["prefix_ids"].shape == (1, 8) and inputs["target_ids"].shape == (1, 8)
    assert labels.shape == (1, 8) and int((labels != IGNORE_INDEX).sum()) == 2
    with pytest.raises(ValueError, match="shorter than a sample"):
        collate(samples, ByteTokenizer(), (3, 16, 16), length=1)

    tied = M6Model(dataclasses.replace(CONFIG, tie_embeddings=True))
    with pytest.raises(ValueError, match=r"model\.tie_embeddings.*parallel\.pp_size"):
        tied.pipeline_stage([0, 1], True, False)
    assert default_m6_strategy(CONFIG, 1, 2)["blocks"] == "pipeline"
    assert "blocks" not in default_m6_strategy(CONFIG, 1, 1)


def test_build_m6_under_pp_pads_batches_to_seq_len_and_refuses_tied_embeddings(tmp_path):
    from m6_moe import build_m6
    from moetrain.config import DataConfig, TrainConfig
    from moetrain.registry import DataShard

    data = DataConfig(source="embedded", micro_batch_size=3, seq_len=12, num_workers=0)
    model = dataclasses.replace(CONFIG, tie_embeddings=True)
    tied = TrainConfig(
        model=model, data=data, parallel=ParallelConfig(pp_size=2), grad_accum=2, out_dir=str(tmp_path)
    )
    with pytest.raises(ValueError, match=r"model\.tie_embeddings: true .* parallel\.pp_size > 1"):
        build_m6(tied, DataShard())
    _, batches, _ = build_m6(dataclasses.replace(tied, model=CONFIG), DataShard())
    shapes = set()
    for _ in range(3):
        inputs, labels = batches.next()
        shapes.add(
            (tuple(inputs["prefix_ids"].shape), tuple(inputs["target_ids"].shape), tuple(labels.shape))
        )
    assert shapes == {((3, 12), (3, 12), (3, 12))}
