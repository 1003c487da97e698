"""Edges of the annotations, one process: a split of a Hugging Face attention that would cut heads
(it keeps ``head_dim``, not ``num_heads``), ``moefy`` failing on a later match (the model stays
whole), which scopes count for an MoE layer (a parameter-free wrapper around it, a root built under
a scope), a strategy pattern every module of which an earlier pattern took, ``ParallelContext``
sizes without ``torch.distributed``, and ``comm_hook`` where no DDP runs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from moetrain import (
    MoEConfig,
    MoELayer,
    ParallelConfig,
    ParallelContext,
    moefy,
    parallelize,
    scope,
    strategy_from_scopes,
)
from moetrain.parallelize import _replica_options, resolve_strategy
from moetrain.tensor_split import check_split

transformers = pytest.importorskip("transformers", reason="transformers (a test dependency) is not installed")

MOE = MoEConfig(d_model=16, d_ff=16, num_experts=4, top_k=2)
ATTENTION_SPLIT = {
    "model.layers.*.self_attn.[qkv]_proj": "split",
    "model.layers.*.self_attn.o_proj": "split.row",
}


def llama(heads: int = 4, kv_heads: int = 2, hidden: int = 32):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=hidden, intermediate_size=64, num_attention_heads=heads,
        num_key_value_heads=kv_heads, vocab_size=64, max_position_embeddings=32,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32)
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "hidden", "message"),
    [
        (
            3,
            3,
            48,
            r"'model.layers.0.self_attn.q_proj' over tp_size = 2 would cut heads: 3 heads of head_dim 16",
        ),
        (
            4,
            1,
            32,
            r"'model.layers.0.self_attn.k_proj' over tp_size = 2 would cut heads: 1 head of head_dim 8",
        ),
    ],
)
def test_a_split_cutting_the_heads_of_a_hugging_face_attention_is_one_error(heads, kv_heads, hidden, message):
    model = llama(heads, kv_heads, hidden)  # even shapes at tp 2: only the heads are cut
    assignments = resolve_strategy(model, ATTENTION_SPLIT)
    with pytest.raises(
        ValueError, match=r"^strategy 'model.layers.\*.self_attn.\[qkv\]_proj': 'split' of " + message
    ):
        check_split(assignments, model, 2)
    check_split(assignments, model, 1)


def test_a_split_keeping_whole_heads_of_a_hugging_face_attention_passes():
    model = llama(heads=4, kv_heads=2, hidden=32)
    check_split(resolve_strategy(model, ATTENTION_SPLIT), model, 2)


def test_moefy_failing_on_a_later_match_leaves_the_model_whole():
    model = llama()
    keys = sorted(model.state_dict())
    with pytest.raises(
        ValueError, match=r"^module 'model.layers.0.mlp.gate_proj' \(Linear\) is not a supported FFN"
    ):
        moefy(model, match="*mlp*", num_experts=4, top_k=2)  # the MLPs, then their projections
    assert not any(isinstance(m, MoELayer) for m in model.modules())
    assert sorted(model.state_dict()) == keys
    assert getattr(model.config, "moetrain_moefy", None) is None

    model = gpt2()
    keys = sorted(model.state_dict())
    with pytest.raises(
        ValueError, match=r"^module 'transformer.h.1.attn' \(GPT2Attention\) is not a supported"
    ):
        moefy(
            model,
            match=lambda name, _: name in ("transformer.h.0.mlp", "transformer.h.1.attn"),
            num_experts=4,
        )
    assert not any(isinstance(m, MoELayer) for m in model.modules())
    assert sorted(model.state_dict()) == keys


def test_a_scope_around_a_parameter_free_wrapper_of_an_moe_layer_counts_for_the_layer():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(16)
            with scope.replica():
                self.ffn = nn.Sequential(MoELayer(MOE), nn.Dropout(0.1))
                self.moes = nn.ModuleList([MoELayer(MOE), MoELayer(MOE)])

    kinds = strategy_from_scopes(Net())
    assert kinds["ffn.0"] == kinds["moes.0"] == kinds["moes.1"] == "replica"

    model = gpt2()  # moefy keeps GPT-2's dropout: nn.Sequential(MoELayer, Dropout)
    with scope.replica():
        moefy(model, match="transformer.h.*.mlp", num_experts=4)
    kinds = strategy_from_scopes(model)
    assert kinds["transformer.h.0.mlp.0"] == kinds["transformer.h.1.mlp.0"] == "replica"


def test_a_scope_around_the_enclosing_module_or_the_root_leaves_moe_layers_expert():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(16)
            self.moe = MoELayer(MOE)
            self.ffn = nn.Sequential(MoELayer(MOE), nn.Dropout(0.1))

    with scope.replica():  # the root built under the scope
        root = Block()
    kinds = strategy_from_scopes(root)
    assert kinds["norm"] == "replica"
    assert kinds["moe"] == kinds["ffn.0"] == "expert"

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            with scope.replica():  # around the enclosing block
                self.block = Block()
            self.head = nn.Linear(16, 16)

    kinds = strategy_from_scopes(Net())
    assert kinds["block"] == "replica"
    assert kinds["block.moe"] == kinds["block.ffn.0"] == "expert"


def test_a_pattern_whose_modules_an_earlier_pattern_took_is_one_error_naming_both():
    model = llama()
    moefy(model, match="model.layers.*.mlp", num_experts=4, top_k=2)
    shadowed = {"*": "replica", "model.layers.*.mlp": "expert"}
    with pytest.raises(
        ValueError,
        match=r"^strategy pattern 'model.layers.\*.mlp' matches only modules that the earlier pattern '\*' "
        r"already took \(the first match wins\): put 'model.layers.\*.mlp' first or remove it$",
    ):
        parallelize(model, ParallelContext(), shadowed)
    two = {"model.layers.0.*": "replica", "model.layers.1.*": "replica", "model.layers.*.mlp": "expert"}
    with pytest.raises(
        ValueError, match=r"the earlier patterns 'model.layers.0.\*', 'model.layers.1.\*' already"
    ):
        resolve_strategy(model, two)
    resolve_strategy(model, shadowed, allow_unmatched=True)  # a pipeline stage: checked whole before
    partly = {"model.layers.0.mlp": "replica", "model.layers.*.mlp": "expert"}  # a module of its own
    kinds = {a.name: a.kind for a in resolve_strategy(model, partly)}
    assert (kinds["model.layers.0.mlp"], kinds["model.layers.1.mlp"]) == ("replica", "expert")


@pytest.mark.parametrize("options", [{"ep_size": 2}, {"tp_size": 2}, {"pp_size": 2}, {"ep_size": 3}])
def test_parallel_sizes_without_torch_distributed_ask_for_it(options):
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"need torch.distributed initialised with that many ranks$"):
        ParallelContext(ParallelConfig(**options))


def test_comm_hook_is_checked_before_anything_and_refused_where_no_ddp_runs():
    with pytest.raises(ValueError, match=r"^comm_hook must be one of None, 'bf16', 'fp16', got 'bogus'$"):
        parallelize(llama(), ParallelContext(), comm_hook="bogus")
    with pytest.raises(
        ValueError, match=r"^comm_hook = 'fp16' is DDP's gradient compression: replica = 'fsdp'"
    ):
        parallelize(llama(), ParallelContext(), replica="fsdp", comm_hook="fp16")
    pipelined = SimpleNamespace(config=ParallelConfig(), pp_size=2)  # the sizes _replica_options reads
    with pytest.raises(ValueError, match=r"^comm_hook = 'bf16' is DDP's gradient compression: pp_size = 2"):
        _replica_options(pipelined, None, None, "bf16")
    assert _replica_options(pipelined, None, None, None) == ("ddp", False)
    parallelize(llama(), ParallelContext(), comm_hook="fp16")  # DDP's, on one process: nothing to wrap
