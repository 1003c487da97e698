"""moetrain.scope: Whale's annotations in model code, turned into the strategy ``parallelize`` applies.

Single process: marking (nesting, defaults, MoE layers, threads, deepcopy, meta), the errors for a
scope around a module it cannot apply to, the LM and M6 (written with scopes) giving exactly their
pattern tables' strategies on every tp / pp size, stage marks as pipeline cut points, and ``auto``
choosing what ``moetrain plan --recommend`` chooses on two mesh shapes. The gloo runs (scopes vs
pattern tables, on meta, pipeline stages, ``moetrain train``) are in tests/distributed/test_scope_dist.py.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from moe_lm import LMConfig, MoETransformerLM, default_lm_strategy
from moetrain import MoEConfig, MoELayer, ParallelContext, parallelize, scope, strategy_from_scopes
from moetrain.layers.experts import DenseFFN
from moetrain.parallelize import default_strategy, resolve_strategy
from moetrain.scope import compose, has_marks, marks, stage_boundaries
from tests.helpers.scoped_lm import StagedLM, auto_lm

MOE = MoEConfig(d_model=16, d_ff=16, num_experts=4, top_k=2)
LM = LMConfig(vocab_size=64, d_model=16, num_layers=2, num_heads=4, max_seq_len=8, moe=MOE)


def sizes(tp: int = 1, pp: int = 1, world: int | None = None):
    """The mesh sizes :func:`strategy_from_scopes` reads (a ParallelContext has them all)."""
    return SimpleNamespace(tp_size=tp, pp_size=pp, world_size=world or tp * pp)


def assigned(model, strategy) -> set[tuple[str, str]]:
    return {(a.name, a.kind) for a in resolve_strategy(model, strategy)}


class Attention(nn.Module):
    def __init__(self, d: int = 16, heads: int = 4):
        super().__init__()
        self.num_heads = heads
        with scope.split():
            self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        with scope.split("row"):
            self.proj = nn.Linear(d, d)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.attn = Attention()
        self.ffn = MoELayer(MOE)


def test_a_model_built_under_no_scope_is_unmarked_and_the_hook_is_gone():
    with scope.split():
        nn.Linear(2, 2)
    model = Block()
    marked = {name for name, m in model.named_modules() if marks(m)}
    assert marked == {"attn.q", "attn.k", "attn.v", "attn.proj"}  # Attention's own scopes only
    assert marks(model.attn.q) and marks(model.attn.q)[-1].value == "split"
    plain = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    assert not has_marks(plain) and strategy_from_scopes(plain) == {}
    assert scope._HOOK == {"handle": None, "users": 0}  # nothing global left behind
    assert default_strategy(plain) == {"*": "replica"}


def test_nesting_innermost_wins_per_dimension():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            with scope.replica():
                self.a = nn.Linear(4, 4)
                with scope.split():
                    self.b = nn.Linear(4, 4)
                    with scope.split("row"):
                        self.c = nn.Linear(4, 4)
                    self.d = nn.Embedding(8, 4)
                self.e = nn.LayerNorm(4)

    net = Net()
    assert strategy_from_scopes(net) == {
        "a": "replica",
        "b": "split",
        "c": "split.row",
        "d": "split",
        "e": "replica",
    }
    # tp_size 1: split scopes are transparent, the scope around them decides
    assert strategy_from_scopes(net, sizes(tp=1)) == dict.fromkeys("abcde", "replica")


def test_set_default_marks_what_no_scope_marks_and_ends_with_its_block():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(8, 16)
            self.block = Block()
            with scope.split("head"):
                self.head = nn.Linear(16, 8)

    with scope.set_default("replica"):
        net = Net()
    kinds = strategy_from_scopes(net, sizes(tp=2))
    assert kinds["embed"] == kinds["block"] == kinds["block.norm"] == "replica"
    assert kinds["block.attn.q"] == "split" and kinds["head"] == "split.head"
    assert kinds["block.ffn"] == "expert"  # the default does not change an MoE layer
    assert not has_marks(nn.Sequential(nn.Linear(2, 2)))  # the default ended with the block

    previous = scope.set_default("auto")  # Whale's bare call: until changed
    try:
        assert marks(nn.Sequential(nn.Linear(2, 2))[0])[0].describe() == "scope.set_default('auto')"
    finally:
        scope.set_default(None)
    assert not has_marks(nn.Sequential(nn.Linear(2, 2)))
    assert isinstance(previous, scope._Default) and scope._HOOK["users"] == 0
    with pytest.raises(
        ValueError, match=r"scope.set_default takes one of 'replica', 'auto' or None, got 'split'"
    ):
        scope.set_default("split")


def test_moe_layers_are_expert_unless_a_scope_is_opened_around_the_layer_itself():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            with scope.replica():
                self.block = Block()  # a scope around the enclosing block: the layer stays expert
                self.moe_default = MoELayer(MOE)  # opened in this constructor: around the layer itself
            with scope.split():  # Whale: experts under split = expert parallel
                self.moe_split = MoELayer(MOE)
            self.moe_plain = MoELayer(MOE)

    kinds = strategy_from_scopes(Net())
    assert kinds["block.ffn"] == "expert"
    assert kinds["block.ffn.router"] == kinds["block.ffn.experts"] == "replica"  # the block's scope
    assert kinds["moe_default"] == "replica" and kinds["moe_default.experts"] == "replica"
    assert kinds["moe_split"] == "expert" and "moe_split.experts" not in kinds  # one layer, one kind
    assert kinds["moe_plain"] == "expert"
    assert strategy_from_scopes(Net(), sizes(tp=1))["moe_split"] == "expert"
    assert assigned(Net(), kinds)  # a strategy parallelize accepts

    class Row(nn.Module):
        def __init__(self):
            super().__init__()
            with scope.split("row"):
                self.moe = MoELayer(MOE)

    with pytest.raises(
        ValueError, match=r"^scope.split\('row'\) around 'moe' \(a MoELayer\): 'split.row' applies"
    ):
        strategy_from_scopes(Row())


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: scope.split(), r"scope.split\(\) around 'x' \(a LayerNorm\): 'split' applies to nn.Linear"),
        (
            lambda: scope.split("head"),
            r"scope.split\('head'\) around 'x' \(a Embedding\): 'split.head' applies",
        ),
        (
            lambda: scope.expert(),
            r"scope.expert\(\) around 'x' \(a LayerNorm\): 'expert' applies to MoELayer",
        ),
    ],
)
def test_a_scope_around_a_module_it_cannot_apply_to_is_one_error_naming_it(build, message):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.ok = nn.Linear(4, 4)
            with build():
                self.x = nn.Embedding(4, 4) if "head" in message else nn.LayerNorm(4)

    with pytest.raises(ValueError, match=message):
        strategy_from_scopes(Net())


def test_split_around_a_module_with_no_weight_and_inside_a_split_block_are_errors():
    class Act(nn.Module):
        def __init__(self):
            super().__init__()
            with scope.split():
                self.act = nn.GELU()

    with pytest.raises(
        ValueError, match=r"^scope.split\(\) around 'act' \(a GELU\): .*, and it has no weight to shard"
    ):
        strategy_from_scopes(Act())

    class Whole(nn.Module):  # the Linears are split; the norm inside the same scope is named
        def __init__(self):
            super().__init__()
            with scope.split():
                self.block = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.LayerNorm(4), nn.Linear(4, 4))

    with pytest.raises(ValueError, match=r"^scope.split\(\) around 'block.2' \(a LayerNorm\)"):
        strategy_from_scopes(Whole())

    class Mlp(nn.Module):  # a parameter-free part of a split block is no error
        def __init__(self):
            super().__init__()
            with scope.split():
                self.mlp = nn.Sequential(nn.Linear(4, 8), nn.GELU())
                self.ffn = DenseFFN(4, 8, "gelu")

    assert strategy_from_scopes(Mlp()) == {"mlp.0": "split", "ffn": "split"}

    class Pipe(nn.Module):
        def __init__(self):
            super().__init__()
            with scope.pipeline():
                self.layer = nn.Linear(4, 4)

    for mesh in (None, sizes(pp=1)):  # checked with pp_size 1 too, where it would do nothing
        with pytest.raises(ValueError, match=r"scope.pipeline\(\) around 'layer' \(a Linear\): 'pipeline'"):
            strategy_from_scopes(Pipe(), mesh)


def test_scopes_are_per_thread():
    entered, built = threading.Event(), threading.Event()
    seen = {}

    def annotated():
        with scope.split():
            entered.set()
            built.wait(10)
            seen["inside"] = nn.Sequential(nn.Linear(2, 2))

    def plain():
        entered.wait(10)
        seen["other"] = nn.Sequential(nn.Linear(2, 2))  # built while the other thread's scope is open
        built.set()

    threads = [threading.Thread(target=annotated), threading.Thread(target=plain)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert has_marks(seen["inside"]) and not has_marks(seen["other"])


def test_marks_survive_deepcopy_and_do_not_change_the_model():
    torch.manual_seed(0)
    model = MoETransformerLM(LM, seed=1)
    twin = copy.deepcopy(model)
    assert strategy_from_scopes(twin) == strategy_from_scopes(model)
    assert set(model.state_dict()) == set(twin.state_dict())
    assert not any("moetrain" in key for key in model.state_dict())
    tokens = torch.randint(0, LM.vocab_size, (2, 8))
    assert torch.equal(model(tokens), twin(tokens))


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("pp", [1, 2])
def test_the_lm_with_scopes_gives_its_pattern_tables_strategy(tp, pp):
    model = MoETransformerLM(LM)
    assert assigned(model, strategy_from_scopes(model, sizes(tp, pp))) == assigned(
        model, default_lm_strategy(LM, tp, pp)
    )


def m6_variants():
    from m6_moe.config import M6Config

    base = M6Config.preset("tiny")
    return [
        base,
        dataclasses.replace(base, tie_embeddings=not base.tie_embeddings),
        dataclasses.replace(base, moe=dataclasses.replace(base.moe, activation="swiglu"), moe_every=2),
    ]


@pytest.mark.parametrize("variant", range(3))
def test_m6_with_scopes_gives_its_pattern_tables_strategy(variant):
    from m6_moe.model import M6Model, default_m6_strategy

    config = m6_variants()[variant]
    with torch.device("meta"):
        model = M6Model(config)
    for tp in (1, 2):
        for pp in (1, 2):
            table = assigned(model, default_m6_strategy(config, tp, pp))
            assert assigned(model, strategy_from_scopes(model, sizes(tp, pp))) == table, (tp, pp)


def test_scopes_on_meta_give_the_same_marks_and_parallelize_uses_them():
    with torch.device("meta"):
        meta = MoETransformerLM(LM)
    assert strategy_from_scopes(meta) == strategy_from_scopes(MoETransformerLM(LM))
    trained = parallelize(meta, ParallelContext())  # one process: whole, no strategy given
    assert {(a.name, a.kind) for a in trained.assignments} == assigned(meta, default_lm_strategy(LM))
    trained.materialize("cpu")
    assert all(p.device.type == "cpu" for p in meta.parameters())


def test_composing_patterns_with_marks_lets_the_patterns_win():
    model = MoETransformerLM(LM)
    marked = strategy_from_scopes(model, sizes(tp=2))
    composed = compose({"head": "replica", "blocks.*.attn.*": "replica"}, marked)
    kinds = dict(assigned(model, composed))
    assert kinds["head"] == "replica" and kinds["blocks.0.attn.q"] == "replica"
    assert kinds["embed"] == "split" and kinds["blocks.1.ffn"] == "expert"


def test_stage_marks_give_the_cut_points_and_name_the_stack():
    config = dataclasses.replace(LM, num_layers=4)
    model = StagedLM(config, [0, 0, 0, 1])
    assert stage_boundaries(model.blocks) == [3]
    assert strategy_from_scopes(model, sizes(pp=2))["blocks"] == "pipeline"
    assert "blocks" not in strategy_from_scopes(model, sizes(pp=1))
    # the same kinds as the LM's table besides
    assert assigned(model, strategy_from_scopes(model, sizes(2, 2))) == assigned(
        model, default_lm_strategy(config, 2, 2)
    )
    assert stage_boundaries(MoETransformerLM(config).blocks) is None
    with pytest.raises(ValueError, match=r"must start at 0 and go up by at most 1"):
        stage_boundaries(StagedLM(config, [0, 2, 2, 2]).blocks)
    with pytest.raises(ValueError, match=r"must start at 0"):
        stage_boundaries(StagedLM(config, [0, 1, 0, 1]).blocks)


# auto: the planner's choice


AUTO_LM = LMConfig(
    vocab_size=32768,
    d_model=1024,
    num_layers=2,
    num_heads=8,
    max_seq_len=256,
    moe=MoEConfig(d_model=1024, d_ff=1024, num_experts=4, top_k=2),
)


def test_auto_chooses_what_plan_recommend_chooses_on_two_mesh_shapes(caplog):
    from moe_lm import describe_lm
    from moetrain.planner import PlanSettings, cluster_preset
    from moetrain.planner.auto import AutoSplit
    from moetrain.planner.split import recommend_split

    with torch.device("meta"):
        model = auto_lm(AUTO_LM)
    description = dataclasses.replace(describe_lm(AUTO_LM), build=lambda: auto_lm(AUTO_LM))
    settings = PlanSettings(micro_batch=2, seq_len=256, precision="bf16", autocast=True)
    chosen = {}
    for nodes, per_node, tp in ((1, 2, 2), (2, 2, 2)):
        cluster = cluster_preset("a100-80gb", nodes, gpus_per_node=per_node)
        auto = AutoSplit(cluster, description, settings)
        caplog.clear()
        with caplog.at_level("INFO", logger="moetrain.planner.auto"):
            kinds = strategy_from_scopes(model, sizes(tp=tp, world=cluster.world_size), auto=auto)
        assert any(r.getMessage().startswith("scope.auto(): head split at tp_size 2") for r in caplog.records)
        rec = recommend_split(description, cluster, settings, 1.0, 0, tp_sizes=[tp])
        expected = {}
        for cost in rec.units:
            expected.update(cost.unit.modules if cost.split else dict.fromkeys(cost.unit.modules, "replica"))
        assert {name: kinds[name] for name in expected} == expected, (nodes, per_node)
        assert all(kinds[n] == "expert" for n, m in model.named_modules() if isinstance(m, MoELayer))
        assert kinds["blocks.0.attn_norm"] == kinds["norm"] == "replica"
        chosen[nodes] = {u.unit.name for u in rec.units if u.split}
    # the two shapes choose differently: with 2 ranks, both tp, no gradient is all-reduced and the
    # embedding (no FLOPs to share) stays whole; with 2 nodes its gradient crosses them: split
    assert "embed" not in chosen[1] and "embed" in chosen[2] and "head" in chosen[1], chosen

    with pytest.raises(ValueError, match=r"scope.auto\(\) marks \d+ module\(s\) \(embed, blocks.0,"):
        strategy_from_scopes(model, sizes(tp=2))  # no decision given
    with pytest.raises(ValueError, match=r"the cluster described has 4 GPUs .* the mesh 2 ranks"):
        strategy_from_scopes(model, sizes(tp=2, world=2), auto=AutoSplit(cluster, description, settings))
    one = strategy_from_scopes(model, sizes(tp=1))  # nothing to decide with tp_size 1
    assert one["head"] == one["blocks.0.attn.q"] == "replica"


def test_an_explicit_strategy_is_applied_as_is_and_none_applies_the_marks():
    model = MoETransformerLM(LM)
    given = parallelize(model, ParallelContext(), {"*": "replica"})
    assert {a.kind for a in given.assignments} == {"replica"}
    model = MoETransformerLM(LM)
    marked = parallelize(model, ParallelContext())  # tp_size 1: the split marks are transparent
    assert {(a.name, a.kind) for a in marked.assignments} == assigned(model, default_lm_strategy(LM))
    assert default_strategy(model) == strategy_from_scopes(model)  # a registered model's, no mesh
    assert default_strategy(model)["head"] == "split.head"


def test_parallelize_frees_the_full_experts_it_replaced_by_their_slice():
    """Sharding replaces each MoE layer's experts by its slice (a copy on a real device); the
    result's assignments must name the slices, not keep the full experts alive beside them (they
    did: 4 bytes per expert parameter more, measured on an H100 as 2.06 GiB, docs/planner.md)."""
    import gc
    import weakref

    from moetrain.layers.experts import GroupedExperts

    model = MoETransformerLM(LM)
    full = [weakref.ref(m) for m in model.modules() if isinstance(m, GroupedExperts)]
    assert full
    trained = parallelize(model, ParallelContext())
    gc.collect()
    assert all(ref() is None for ref in full)
    assert all(a.module is model.get_submodule(a.name) for a in trained.assignments)
