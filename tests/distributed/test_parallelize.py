"""``parallelize`` on real gloo ranks, each layout against one process running the same model on the
whole global batch: outputs, losses, gradients after synchronisation, the global gradient norm and
an optimizer step.

World 4 as dp2 x ep2, tp2 x dp2 and tp2 x ep2 on the LM; a classifier whose head is split with the
parallel cross-entropy (the logits stay vocabulary-sharded); M6 with its image stem replicated and
its head split; FSDP2 for replicated parameters and experts. Every rank builds the reference itself
from the same seed (the experts' initialisation depends only on the layer's seed and the global
expert index)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moe_lm import LMConfig, MoETransformerLM, default_lm_strategy, lm_loss
from moetrain import MoEConfig, MoELayer, ParallelConfig, ParallelContext, parallelize, set_aux_loss_scale
from moetrain.parallelize import resolve_strategy
from tests.helpers.dist_utils import run_distributed

LM = LMConfig(
    vocab_size=64,
    d_model=32,
    num_layers=2,
    num_heads=4,
    max_seq_len=16,
    moe=MoEConfig(d_model=32, d_ff=32, num_experts=4, top_k=2, capacity_factor=None, aux_loss_coef=0.01),
)


def _tokens(index: int, batch: int = 2, seq: int = 8):
    g = torch.Generator().manual_seed(100 + index)
    ids = torch.randint(0, LM.vocab_size, (batch, seq + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's global value (a collective), a plain tensor as it is."""
    return tensor.full_tensor() if type(tensor).__name__ == "DTensor" else tensor


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _compare(model, reference, parallel) -> dict[str, float]:
    """Largest relative error of each parameter's gradient (experts: this rank's slice)."""
    errors = {}
    ref = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        grad, want = full(param.grad), ref[name].grad
        if ".experts." in name and grad.shape != want.shape:
            local = parallel.local_experts(want.shape[0])
            want = want[local.start : local.stop]
        errors[name] = _rel(grad, want)
    return errors


def lm_worker(rank, world, layouts):
    reports = []
    for ep, tp, replica, *chunks in layouts:  # chunks: a2a_chunks (default 1)
        chunks = chunks[0] if chunks else 1
        parallel = ParallelContext(ParallelConfig(ep_size=ep, tp_size=tp, replica=replica, a2a_chunks=chunks))
        torch.manual_seed(0)
        model = MoETransformerLM(LM, seed=3)
        reference = copy.deepcopy(model)
        trained = parallelize(model, parallel, default_lm_strategy(LM, tp))
        inputs, targets = _tokens(parallel.data_index)
        out = trained(inputs)
        with trained.loss_context(out):
            loss = lm_loss(out, targets)
            loss.backward()
        trained.reduce_gradients()
        norm = trained.grad_norm()
        sharded_head = type(out).__name__ == "DTensor"

        set_aux_loss_scale(reference, 1.0 / parallel.data_count)
        losses = []
        for index in range(parallel.data_count):
            ref_in, ref_targets = _tokens(index)
            logits = reference(ref_in)
            if index == parallel.data_index:
                ref_out = logits.detach()
            losses.append(lm_loss(logits, ref_targets))
        (sum(losses) / len(losses)).backward()
        ref_norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in reference.parameters()))
        grads = _compare(model, reference, parallel)

        for m in (model, reference):  # one optimizer step each, then the loss of the next batch
            optimizer = torch.optim.AdamW(m.parameters(), lr=1e-2)
            optimizer.step()
        inputs2, targets2 = _tokens(parallel.data_index + 50)
        out2 = trained(inputs2)
        with trained.loss_context(out2):
            loss2 = full(lm_loss(out2, targets2)).item()
        ref_loss2 = lm_loss(reference(inputs2), targets2).item()
        reports.append(
            {
                "layout": (ep, tp, replica),
                "out": _rel(full(out).detach(), ref_out),
                "loss": abs(full(loss).item() - losses[parallel.data_index].item()),
                "grads": grads,
                "norm": (float(norm), float(ref_norm)),
                "loss2": (loss2, ref_loss2),
                "sharded_head": sharded_head,
            }
        )
    return reports


def _check_lm(results):
    for rank_reports in results:
        for r in rank_reports:
            assert r["out"] < 1e-5 and r["loss"] < 1e-5, r
            worst = max(r["grads"].items(), key=lambda item: item[1])
            assert worst[1] < 1e-4, (r["layout"], worst)
            assert r["norm"][0] == pytest.approx(r["norm"][1], rel=1e-5), r
            assert r["loss2"][0] == pytest.approx(r["loss2"][1], rel=1e-4), r
            assert r["sharded_head"] == (r["layout"][1] > 1)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lm_dp2_ep2_tp2dp2_tp2ep2_equal_one_process():
    """World 4 as dp2 x ep2, tp2 x dp2 and tp2 x ep2 (DDP replicas): logits, loss, every
    gradient after synchronisation, the global norm and the loss after one AdamW step equal one
    process on the global batch."""
    _check_lm(run_distributed(lm_worker, 4, [(2, 1, "ddp"), (1, 2, "ddp"), (2, 2, "ddp")]))


def test_rank_grid_puts_tp_innermost_then_ep_then_dp():
    from moetrain.parallel import grid_groups, rank_grid

    grid = rank_grid(8, ep_size=2, tp_size=2)
    assert grid.tolist() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]  # [dp][ep][tp]
    groups = grid_groups(grid)
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]  # expert-data-parallel: same ep and tp index
    assert groups["dense"] == [[0, 2, 4, 6], [1, 3, 5, 7]]  # replicas average here: same tp index
    spread = rank_grid(8, ep_size=2, tp_size=1, ep_layout="spread")
    assert grid_groups(spread)["ep"] == [[0, 4], [1, 5], [2, 6], [3, 7]]  # one rank every world / ep
    with pytest.raises(ValueError, match=r"ep_size x tp_size = 2 x 3 = 6 must divide the world size = 8"):
        rank_grid(8, ep_size=2, tp_size=3)


def test_strategy_errors_name_the_pattern_and_module():
    model = MoETransformerLM(LM)
    with pytest.raises(ValueError, match=r"strategy pattern 'blocks\.\*\.mlp' matches no module"):
        resolve_strategy(model, {"blocks.*.mlp": "expert"})
    with pytest.raises(
        ValueError, match=r"'expert' applies to MoELayers, module 'blocks.0.attn' is a CausalSelf"
    ):
        resolve_strategy(model, {"blocks.*.attn": "expert"})
    with pytest.raises(ValueError, match=r"'split.row' applies to Linear, module 'embed' is a Embedding"):
        resolve_strategy(model, {"embed": "split.row"})
    with pytest.raises(ValueError, match=r"strategy\['head'\] must be one of 'replica', 'expert'"):
        resolve_strategy(model, {"head": "tensor"})
    # first match wins: the head is claimed by the first pattern
    assignments = {a.name: a.kind for a in resolve_strategy(model, {"head": "split.head", "*": "replica"})}
    assert assignments["head"] == "split.head" and assignments["blocks.0.ffn"] == "replica"


def head_errors_worker(rank, world):
    parallel = ParallelContext(ParallelConfig(tp_size=world))
    wrapped = ParallelContext.from_mesh(ParallelContext(ParallelConfig(ep_size=2, tp_size=2)).mesh)
    mesh_facts = (wrapped.ep_size, wrapped.tp_size, wrapped.dp_size, wrapped.ep_ranks, wrapped.tp_ranks)
    messages = []
    for config, strategy in (
        (LMConfig(**{**LM.__dict__, "num_heads": 2}), {"blocks.*.attn.[qkv]": "split"}),
        (LM, {"blocks.*.ffn": "expert"}),
    ):
        try:
            parallelize(MoETransformerLM(config), parallel, strategy)
            messages.append(None)
        except ValueError as error:
            messages.append(str(error))
    return messages, mesh_facts


@pytest.mark.timeout(120)
def test_heads_not_divisible_by_tp_and_tp_without_split_are_errors():
    """Also: ParallelContext.from_mesh reads the sizes and groups back from a (dp, ep, tp) mesh."""
    results = run_distributed(head_errors_worker, 4)
    for rank, (_, facts) in enumerate(results):
        assert facts == (2, 2, 1, [rank % 2, rank % 2 + 2], [rank - rank % 2, rank - rank % 2 + 1])
    messages = results[0][0]
    assert "would cut heads: 'blocks.0.attn' has num_heads = 2, not divisible by 4" in messages[0]
    assert "tp_size = 4 but the strategy splits no module" in messages[1]


class Classifier(nn.Module):
    """A small feature extractor and a large head: ``[B, 16] -> [B, classes]``."""

    def __init__(self, classes: int = 96):
        super().__init__()
        self.features = nn.Sequential(nn.Linear(16, 24), nn.GELU(), nn.Linear(24, 24))
        self.head = nn.Linear(24, classes)

    def forward(self, x):
        return self.head(self.features(x))


def _samples(index: int):
    g = torch.Generator().manual_seed(7 + index)
    labels = torch.randint(0, 96, (6,), generator=g)
    labels[0] = -100  # ignored
    return torch.randn(6, 16, generator=g), labels


def classifier_worker(rank, world, tp):
    parallel = ParallelContext(ParallelConfig(tp_size=tp))
    torch.manual_seed(1)
    model = Classifier()
    reference = copy.deepcopy(model)
    trained = parallelize(model, parallel, {"head": "split.head"})
    x, labels = _samples(parallel.data_index)
    logits = trained(x)
    with trained.loss_context(logits):
        loss = F.cross_entropy(logits, labels, ignore_index=-100)
        loss.backward()
    trained.reduce_gradients()
    ref = [
        F.cross_entropy(reference(_samples(i)[0]), _samples(i)[1], ignore_index=-100)
        for i in range(parallel.data_count)
    ]
    (sum(ref) / len(ref)).backward()
    return {
        "placements": [repr(p) for p in logits.placements],
        "local_shape": tuple(logits.to_local().shape),
        "loss": (full(loss).item(), ref[parallel.data_index].item()),
        "grads": _compare(model, reference, parallel),
    }


@pytest.mark.timeout(120)
def test_split_head_keeps_logits_sharded_and_matches_one_process():
    """tp2 x dp2: the head's output is a DTensor sharded over the classes (each rank holds 48 of
    the 96 logits per sample: never gathered) and the parallel cross-entropy (ignore_index
    included) and every gradient equal one process."""
    for r in run_distributed(classifier_worker, 4, 2):
        assert r["placements"] == ["Shard(dim=1)"] and r["local_shape"] == (6, 48)
        assert r["loss"][0] == pytest.approx(r["loss"][1], rel=1e-6)
        assert max(r["grads"].values()) < 1e-5, r["grads"]


class TiedLM(nn.Module):
    """An embedding and a head that are one ``[64, 16]`` matrix (``tie_word_embeddings``)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 64, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.mid(self.embed(tokens))))


def _tied_step(trained, tokens, targets):
    """The loss of ``tokens`` (inside the head's loss context) and its backward."""
    logits = trained(tokens)
    with trained.loss_context(logits):
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
    return loss


def tied_worker(rank, world):
    parallel = ParallelContext(ParallelConfig(tp_size=world))
    torch.manual_seed(2)
    model = TiedLM()
    reference = copy.deepcopy(model)
    trained = parallelize(model, parallel, {"embed": "split", "head": "split.head"})
    tied = model.head.weight is model.embed.weight and len(list(model.parameters())) == 3
    placements = repr(model.embed.weight.placements)
    inputs, targets = _tokens(0)
    loss = _tied_step(trained, inputs, targets)
    trained.reduce_gradients()
    ref_loss = F.cross_entropy(reference(inputs).flatten(0, 1), targets.flatten())
    ref_loss.backward()
    grads = {n: _rel(full(model.get_parameter(n).grad), p.grad) for n, p in reference.named_parameters()}
    for m in (model, reference):  # one AdamW step each, then the loss of the next batch
        torch.optim.AdamW(m.parameters(), lr=1e-2).step()
        m.zero_grad()
    inputs2, targets2 = _tokens(1)
    loss2 = full(_tied_step(trained, inputs2, targets2)).item()
    ref_loss2 = F.cross_entropy(reference(inputs2).flatten(0, 1), targets2.flatten()).item()
    return {
        "tied": tied,
        "placements": placements,
        "loss": (full(loss).item(), ref_loss.item()),
        "grads": grads,
        "loss2": (loss2, ref_loss2),
        "weights": _rel(full(model.embed.weight).detach(), reference.embed.weight.detach()),
    }


@pytest.mark.timeout(120)
def test_split_tied_embedding_and_head_stay_one_parameter_and_match_one_process():
    """tp 2 on 2 ranks, embedding 'split' and head 'split.head' sharing their weight: after
    parallelize both modules hold the same vocabulary-sharded DTensor Parameter (splitting gave
    each its own, and the two copies trained apart), and the loss, the tied gradient (the sum of
    both uses) and the loss after one AdamW step equal one process."""
    for r in run_distributed(tied_worker, 2):
        assert r["tied"] and r["placements"] == "(Shard(dim=0),)", r
        assert r["loss"][0] == pytest.approx(r["loss"][1], rel=1e-6)
        assert max(r["grads"].values()) < 1e-5, r["grads"]
        assert r["loss2"][0] == pytest.approx(r["loss2"][1], rel=1e-5), r
        assert r["weights"] < 1e-5, r


def tied_fsdp_worker(rank, world):
    """dp 2 under FSDP2 with the tied embedding and head each named 'replica' (each would be an
    FSDP unit, and FSDP2 manages a Parameter in one unit only)."""
    torch.set_default_dtype(torch.float64)
    parallel = ParallelContext(ParallelConfig(replica="fsdp"))
    torch.manual_seed(2)
    model = TiedLM()
    reference = copy.deepcopy(model)
    trained = parallelize(model, parallel, {"embed": "replica", "head": "replica", "mid": "replica"})
    _tied_step(trained, *_tokens(parallel.data_index))
    trained.reduce_gradients()
    losses = [F.cross_entropy(reference(x).flatten(0, 1), y.flatten()) for x, y in map(_tokens, range(world))]
    (sum(losses) / world).backward()
    grads = {n: _rel(full(model.get_parameter(n).grad), p.grad) for n, p in reference.named_parameters()}
    return model.head.weight is model.embed.weight, grads


@pytest.mark.timeout(120)
def test_tied_modules_each_named_replica_train_under_fsdp_as_one_process():
    """Each of a tied pair named 'replica' under FSDP2: the pair is left to the root's unit (making
    each its own unit failed inside torch), the weight stays one Parameter, gradients are one
    process's."""
    for tied, grads in run_distributed(tied_fsdp_worker, 2):
        assert tied and max(grads.values()) < 1e-12, grads


def tied_errors_worker(rank, world):
    parallel = ParallelContext(ParallelConfig(tp_size=world))
    messages = []
    for strategy in ({"embed": "split"}, {"embed": "split", "head": "split.row"}):
        try:
            parallelize(TiedLM(), parallel, strategy)
            messages.append(None)
        except ValueError as error:
            messages.append(str(error))
    return messages


@pytest.mark.timeout(120)
def test_tied_parameters_split_two_ways_are_an_error():
    """A tied embedding split with its head replicated, or the head split by rows (Shard(1) of the
    matrix the embedding shards by rows): one-line ValueErrors naming both names and kinds."""
    for replicated, by_rows in run_distributed(tied_errors_worker, 2):
        assert replicated == (
            "tied parameter 'embed.weight' ('split': Shard(dim=0)) and 'head.weight' ('replica': whole) "
            "would train apart; split both modules the same way (e.g. embedding 'split', head "
            "'split.head') or untie them"
        )
        assert "('split': Shard(dim=0)) and 'head.weight' ('split.row': Shard(dim=1))" in by_rows


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp_replicas_and_experts_equal_one_process():
    """replica 'fsdp' (FSDP2): dense parameters HSDP over (dp, ep) or FSDP over ep, experts
    sharded over the expert-data-parallel ranks with gradients summed / (dp * ep), composed with TP
    (tp2 x ep2) and with the chunked exchange (a2a_chunks 2: the experts' weights are gathered
    around its expert pass, which is not the module's forward): the same checks as the DDP layouts."""
    _check_lm(run_distributed(lm_worker, 4, [(2, 1, "fsdp"), (2, 2, "fsdp"), (2, 1, "fsdp", 2)]))


class RootMoE(nn.Module):
    """A MoE layer that is a direct child of the root: ``"*": "replica"`` also names its router
    and its experts."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.moe = MoELayer(d_model=16, d_ff=16, num_experts=4, top_k=2, capacity_factor=None)

    def forward(self, x):
        return self.moe(self.inp(x))


def root_moe_worker(rank, world):
    parallel = ParallelContext(ParallelConfig(ep_size=2, replica="fsdp"))
    torch.manual_seed(0)
    model = RootMoE()
    reference = copy.deepcopy(model)
    trained = parallelize(model, parallel, {"moe": "expert", "*": "replica"})
    inputs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(10 + i)) for i in range(4)]
    out = trained(inputs[parallel.data_index])
    out.square().mean().backward()
    trained.reduce_gradients()
    set_aux_loss_scale(reference, 1.0 / parallel.data_count)
    outputs = [reference(x) for x in inputs]
    (sum(y.square().mean() for y in outputs) / len(outputs)).backward()
    return _rel(full(out).detach(), outputs[parallel.data_index].detach()), _compare(
        model, reference, parallel
    )


@pytest.mark.timeout(120)
def test_fsdp_with_a_replica_pattern_over_an_expert_layer_shards_its_experts_once():
    """dp2 x ep2: the experts are their layer's FSDP unit over the expert-data-parallel ranks, not
    a second one over the dense mesh (fully_shard twice: an error)."""
    for out, grads in run_distributed(root_moe_worker, 4):
        assert out < 1e-6
        assert max(grads.values()) < 1e-5, grads


def fp64_fsdp_worker(rank, world, micro: int):
    """ep = world (dp 1) under FSDP2 in fp64: every expert's layer is an FSDP unit on one rank."""
    torch.set_default_dtype(torch.float64)
    parallel = ParallelContext(ParallelConfig(ep_size=world, replica="fsdp"))
    torch.manual_seed(0)
    model = RootMoE()
    reference = copy.deepcopy(model)
    trained = parallelize(model, parallel, {"moe": "expert", "*": "replica"})
    inputs = [
        torch.randn(8, 16, generator=torch.Generator().manual_seed(10 + i)) for i in range(world * micro)
    ]
    set_aux_loss_scale(model, 1.0 / micro)
    for i in range(micro):
        with trained.no_sync() if i < micro - 1 else contextlib.nullcontext():
            (trained(inputs[parallel.data_index * micro + i]).square().mean() / micro).backward()
    trained.reduce_gradients()
    set_aux_loss_scale(reference, 1.0 / len(inputs))
    (sum(reference(x).square().mean() for x in inputs) / len(inputs)).backward()
    return _compare(model, reference, parallel)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("micro", [1, 2])
def test_fsdp_experts_on_one_rank_meshes_are_divided_once_in_fp64(micro):
    """ep = world, dp = 1: FSDP2 divided the experts' gradients by dp * ep twice in fp64 (its
    one-rank copy and its overflow-safe pre/post division both apply the factor), so they came
    out half of one process's; now they equal it, with and without accumulation."""
    for errors in run_distributed(fp64_fsdp_worker, 2, micro):
        assert max(errors.values()) < 1e-12, errors


def m6_config():
    from m6_moe.config import M6Config

    return M6Config(
        d_model=32, num_layers=2, num_heads=2, d_ff=64, max_text_len=48, image_size=16, patch_size=8,
        stem_channels=(8,), moe_every=2, tie_embeddings=False, vocab_size=256,
        moe={"d_ff": 64, "num_experts": 4, "top_k": 2, "capacity_factor": None},
    )  # fmt: skip


def _m6_batch(index: int):
    g = torch.Generator().manual_seed(30 + index)
    inputs = {
        "prefix_ids": torch.randint(0, 256, (2, 5), generator=g),
        "target_ids": torch.randint(0, 256, (2, 6), generator=g),
        "images": torch.rand(2, 3, 16, 16, generator=g) * 2 - 1,
    }
    labels = torch.randint(0, 256, (2, 6), generator=g)
    labels[:, -2:] = -100  # padding: ignored by the loss
    return inputs, labels


def m6_worker(rank, world):
    from m6_moe import M6Model, m6_loss
    from m6_moe.model import default_m6_strategy

    config = m6_config()
    parallel = ParallelContext(ParallelConfig(ep_size=2, tp_size=2))
    torch.manual_seed(0)
    model = M6Model(config, seed=5)
    reference = copy.deepcopy(model)
    strategy = default_m6_strategy(config, tp_size=2)
    trained = parallelize(model, parallel, strategy)
    kinds = {a.name: a.kind for a in trained.assignments}
    inputs, labels = _m6_batch(parallel.data_index)
    logits = trained(**inputs)
    with trained.loss_context(logits):
        loss = m6_loss(logits, labels)
        loss.backward()
    trained.reduce_gradients()
    set_aux_loss_scale(reference, 1.0 / parallel.data_count)
    losses = [m6_loss(reference(**_m6_batch(i)[0]), _m6_batch(i)[1]) for i in range(parallel.data_count)]
    (sum(losses) / len(losses)).backward()
    return {
        "kinds": {n: kinds.get(n) for n in ("stem", "head", "text_embed", "blocks.0.ffn", "blocks.1.ffn")},
        "stem_plain": all(type(p).__name__ == "Parameter" for p in model.stem.parameters()),
        "logits": repr(logits.placements[0]),
        "loss": (full(loss).item(), losses[parallel.data_index].item()),
        "grads": _compare(model, reference, parallel),
    }


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_m6_with_replicated_stem_and_split_head_equals_one_process():
    """M6 at tp2 x ep2 with its default strategy: image stem replicated (plain parameters), the
    dense FFN split, the MoE FFN expert-parallel, the head split with the parallel cross-entropy:
    loss and every gradient equal one process."""
    for r in run_distributed(m6_worker, 4):
        assert r["kinds"] == {
            "stem": "replica", "head": "split.head", "text_embed": "split", "blocks.0.ffn": "split",
            "blocks.1.ffn": "expert",
        }  # fmt: skip
        assert r["stem_plain"] and r["logits"] == "Shard(dim=2)"
        assert r["loss"][0] == pytest.approx(r["loss"][1], rel=1e-5)
        worst = max(r["grads"].items(), key=lambda item: item[1])
        assert worst[1] < 1e-4, worst


def meta_worker(rank, world):
    reports = []
    for ep, replica in ((2, "ddp"), (2, "fsdp")):
        parallel = ParallelContext(ParallelConfig(ep_size=ep, replica=replica))
        with torch.device("meta"):
            model = MoETransformerLM(LM, seed=3)
        trained = parallelize(model, parallel, default_lm_strategy(LM))
        trained.materialize("cpu")
        cpu = MoETransformerLM(LM, seed=3)  # built whole on the CPU
        local = parallel.local_experts(LM.moe.num_experts)
        errors = []
        for block, whole in zip(model.blocks, cpu.blocks, strict=True):
            for name in ("w1_EDF", "w2_EFD"):
                mine = full(getattr(block.ffn.experts, name)).detach()
                want = getattr(whole.ffn.experts, name).detach()[local.start : local.stop]
                errors.append(float((mine - want).abs().max()))
        out = trained(_tokens(0)[0])  # the materialised model runs (DDP wrapped after materialising)
        finite = bool(out.isfinite().all())
        reports.append({"layout": (ep, replica), "experts": max(errors), "finite": finite})
    return reports


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_meta_build_parallelize_materialize_gives_the_cpu_builds_experts():
    """Built on meta, parallelized (experts sliced on meta; FSDP2 shards them over dp) and
    materialised: each rank's experts equal the CPU-built full layer's slice, bit for bit."""
    for rank_reports in run_distributed(meta_worker, 4):
        for r in rank_reports:
            assert r["experts"] == 0.0 and r["finite"], r


def meta_expert_gradients_worker(rank, world):
    """Built on meta, parallelized with the experts replicated over both ranks (ep 1, dp 2) and
    materialised; one backward on this rank's own tokens, then the gradient reduction. Returns the
    experts' gradients."""
    parallel = ParallelContext(ParallelConfig(ep_size=1))
    with torch.device("meta"):
        model = MoETransformerLM(LM, seed=3)
    trained = parallelize(model, parallel, default_lm_strategy(LM))
    torch.manual_seed(5)  # the same non-expert initialisation on both ranks
    trained.materialize("cpu")
    inputs, targets = _tokens(rank)
    lm_loss(trained(inputs), targets).backward()
    trained.reduce_gradients()
    return {name: p.grad.clone() for name, p in model.named_parameters() if ".experts." in name}


@pytest.mark.timeout(120)
def test_materialising_keeps_the_parameters_the_gradient_reduction_holds():
    """materialize allocates the parameters in place: the expert gradient reducer parallelize made
    on meta reduces the real ones (new parameter objects left it holding the meta ones, and the
    experts' gradients went unreduced: each rank trained its own copy of the replicated experts)."""
    first, second = run_distributed(meta_expert_gradients_worker, 2)
    assert first.keys() == second.keys() and first
    for name, grad in first.items():
        assert grad.abs().sum() > 0, name
        assert torch.equal(grad, second[name]), name


def test_fsdp_cpu_offload_is_refused_without_fsdp():
    with pytest.raises(ValueError, match="fsdp_cpu_offload needs replica = 'fsdp'"):
        ParallelConfig(fsdp_cpu_offload=True)
    config = {"model": {"name": "moe_lm", "d_model": 32, "num_heads": 4, "moe": {"d_ff": 32}}}
    from moetrain.config import TrainConfig, config_from_dict

    with pytest.raises(ValueError, match="optim.name = 'offload' steps plain tensors"):
        config_from_dict(TrainConfig, {**config, "parallel": {"tp_size": 2}, "optim": {"name": "offload"}})


def offload_worker(rank, world):
    """Three AdamW steps of FSDP2 over ep 2, with and without the CPU offload policy."""
    runs = []
    for offload in (False, True):
        parallel = ParallelContext(ParallelConfig(ep_size=2, replica="fsdp", fsdp_cpu_offload=offload))
        torch.manual_seed(0)
        model = MoETransformerLM(LM, seed=3)
        trained = parallelize(model, parallel, default_lm_strategy(LM))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(3):
            inputs, targets = _tokens(10 * rank + step)
            loss = lm_loss(trained(inputs), targets)
            loss.backward()
            trained.reduce_gradients()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        weights = {n: full(p).detach().clone() for n, p in model.named_parameters()}
        runs.append((losses, weights))
    return runs


@pytest.mark.timeout(120)
def test_fsdp_cpu_offload_trains_as_fsdp_on_two_gloo_ranks():
    """The offload policy on a CPU run (pageable host memory): the same losses and weights over
    three optimizer steps as FSDP2 without it."""
    for (plain_losses, plain), (offload_losses, offloaded) in run_distributed(offload_worker, 2):
        assert offload_losses == pytest.approx(plain_losses, rel=1e-6)
        assert plain_losses[0] != plain_losses[-1]  # the steps changed the weights
        for name, weight in plain.items():
            torch.testing.assert_close(offloaded[name], weight, rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the pinned-memory path of FSDP2's CPU offload needs a GPU"
)
def test_fsdp_cpu_offload_equals_fsdp_on_one_gpu():
    """One process, one GPU: FSDP2 with the CPU offload policy (parameters and gradients on the
    host) gives the loss and gradients of FSDP2 without it."""
    import torch.distributed as dist

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        results = []
        for offload in (False, True):
            parallel = ParallelContext(ParallelConfig(replica="fsdp", fsdp_cpu_offload=offload))
            torch.manual_seed(0)
            model = MoETransformerLM(LM, seed=3).cuda()
            trained = parallelize(model, parallel, default_lm_strategy(LM))
            inputs, targets = (t.cuda() for t in _tokens(0))
            loss = lm_loss(trained(inputs), targets)
            loss.backward()
            trained.reduce_gradients()
            grads = {n: full(p.grad).detach().cpu() for n, p in model.named_parameters()}
            results.append((loss.item(), grads, {p.device.type for p in model.parameters()}))
        (loss0, grads0, _), (loss1, grads1, devices) = results
        assert devices == {"cpu"} and loss1 == pytest.approx(loss0, rel=1e-6)
        for name, grad in grads0.items():
            torch.testing.assert_close(grads1[name], grad, rtol=1e-5, atol=1e-6)
    finally:
        dist.destroy_process_group()
