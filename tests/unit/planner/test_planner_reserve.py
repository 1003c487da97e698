"""The GPU reserve (moetrain/planner/reserve.py): the NCCL communicators a layout creates, NCCL's
memory per communicator by GPU type, the CUDA context and the fragmentation term."""

from __future__ import annotations

import pytest

from moetrain.planner import PlanSettings, make_plan
from moetrain.planner.comm import choose_all_to_all, expert_groups, group_layout
from moetrain.planner.hardware import cluster_preset, gbps_to_bytes
from moetrain.planner.model import resolve_model
from moetrain.planner.plan import plan_communicators
from moetrain.planner.reserve import (
    CUDA_CONTEXT_BYTES,
    DEFAULT_FIGURES,
    FRAGMENTATION,
    NCCL_NET_PEER_BYTES,
    NET_POOL_PEERS,
    RESERVE_FIGURES,
    Communicator,
    nccl_bytes,
    reserve_terms,
)

GPU_TYPES = ("H100-SXM5-80GB", "A100-SXM4-80GB", "V100-SXM2-32GB", "P100-SXM2-16GB")


def communicators_of(
    world: int, ep: int, gpus_per_node: int, layout: str = "packed", all_to_all: str = "auto"
):
    """The communicators a rank of this layout creates, as make_plan derives them."""
    groups, _ = expert_groups(world, ep, layout)
    algorithm = choose_all_to_all(all_to_all, ep, groups, gpus_per_node) if ep > 1 else "flat"
    return plan_communicators(world, ep, world // ep, algorithm, group_layout(groups[0], gpus_per_node))


def nccl_total(terms: dict[str, int]) -> int:
    return sum(value for key, value in terms.items() if key.startswith("nccl_"))


def test_the_m6_1t_layout_creates_four_communicators():
    """480 ranks, ep_size 480 on 60 nodes x 8, hierarchical all-to-all: the world (DDP), the EP
    group and the 2-D all-to-all's intra- and inter-node groups; no expert-data-parallel group (no
    expert is replicated)."""
    communicators = communicators_of(480, 480, 8, all_to_all="hierarchical")
    assert [(c.name, c.runs, c.intra_peers, c.inter_peers) for c in communicators] == [
        ("world", "all_reduce", 0, 0),
        ("ep", "all_to_all", 7, 472),
        ("ep_intra_node", "all_to_all", 7, 0),
        ("ep_inter_node", "all_to_all", 0, 59),
    ]
    model, defaults = resolve_model("configs/m6_1t.yaml")
    cluster = cluster_preset("v100-32gb", 60, inter_node_bandwidth=gbps_to_bytes(35))
    plan = make_plan(model, cluster, PlanSettings(**defaults))
    nccl = {key: value for key, value in plan.reserve.items() if key.startswith("nccl_")}
    assert list(nccl) == ["nccl_world", "nccl_ep", "nccl_ep_intra_node", "nccl_ep_inter_node"]
    assert plan.gpu_memory["reserved"] == sum(plan.reserve.values())
    assert plan.reserve["cuda_context"] == CUDA_CONTEXT_BYTES


def test_an_expert_data_parallel_group_and_the_flat_algorithm():
    # 16 ranks, ep 8 on 2 nodes x 8 (packed): each EP group is one node (flat), experts replicated twice
    names = [c.name for c in communicators_of(16, 8, 8)]
    assert names == ["world", "expert_dp", "ep"]
    assert communicators_of(1, 1, 8) == []  # one GPU: no communicator


def test_nccl_memory_per_communicator_follows_the_documented_formula():
    figures = RESERVE_FIGURES["V100-SXM2-32GB"]
    g = 8
    all_reduce = Communicator("world", "all_reduce", 0, 0)
    assert nccl_bytes(all_reduce, figures, g) == figures.nccl_collective
    inside = Communicator("ep", "all_to_all", 7, 0)  # all of the node's GPUs, no remote peer
    assert nccl_bytes(inside, figures, g) == figures.nccl_all_to_all_node
    half = Communicator("ep", "all_to_all", 3, 4)
    expected = round(figures.nccl_all_to_all_node * 3 / 7) + NCCL_NET_PEER_BYTES * 4
    assert nccl_bytes(half, figures, g) == expected
    # remote peers share one pool of network buffers: the term stops growing at NET_POOL_PEERS
    wide = [nccl_bytes(Communicator("ep", "all_to_all", 7, peers), figures, g) for peers in (8, 59, 472)]
    assert (
        wide[0] == wide[1] == wide[2] == figures.nccl_all_to_all_node + NCCL_NET_PEER_BYTES * NET_POOL_PEERS
    )
    # only remote peers: the network pool plus a collective's set-up
    remote = Communicator("ep_inter_node", "all_to_all", 0, 59)
    assert nccl_bytes(remote, figures, g) == NCCL_NET_PEER_BYTES * NET_POOL_PEERS + figures.nccl_collective


def test_the_figures_differ_by_gpu_type():
    """All-to-all memory follows the NVLinks per GPU (H100 18, A100 12, V100 6, P100 4); an
    all-reduce communicator's figure is measured for H100 and A100, assumed for V100 and P100."""
    communicators = communicators_of(480, 480, 8, all_to_all="hierarchical")
    totals = [nccl_total(reserve_terms(gpu, 8, communicators, 0)) for gpu in GPU_TYPES]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == len(totals)
    all_to_all = [RESERVE_FIGURES[gpu].nccl_all_to_all_node for gpu in GPU_TYPES]
    assert all_to_all == [3280 * 10**6 * links // 18 for links in (18, 12, 6, 4)]
    assert RESERVE_FIGURES["H100-SXM5-80GB"].nccl_collective == 1060 * 10**6  # NVIDIA/nccl #1685
    assert RESERVE_FIGURES["A100-SXM4-80GB"].nccl_collective == 688 * 10**6  # NVIDIA/nccl #964
    # a GPU without figures gets the largest known ones
    assert reserve_terms("B200", 8, communicators, 0) == reserve_terms("H100-SXM5-80GB", 8, communicators, 0)
    assert DEFAULT_FIGURES is RESERVE_FIGURES["H100-SXM5-80GB"]


@pytest.mark.parametrize("gpu", GPU_TYPES)
def test_the_reserve_grows_with_the_communicators(gpu):
    def total(world, ep, all_to_all="auto"):
        return nccl_total(reserve_terms(gpu, 8, communicators_of(world, ep, 8, all_to_all=all_to_all), 0))

    # one GPU; DDP only; + an EP group; + an expert-data-parallel group
    assert 0 == total(1, 1) < total(8, 1) < total(8, 8) < total(16, 8)
    # the 2-D all-to-all adds its intra- and inter-node groups to the flat algorithm's EP group
    assert total(32, 32, "hierarchical") > total(32, 32, "flat")


def test_fragmentation_is_the_measured_share_of_the_dynamic_memory():
    """0.43: the larger of the two shares measured on an H100 (reserve.py says where)."""
    assert FRAGMENTATION == 0.43
    terms = reserve_terms("V100-SXM2-32GB", 8, [], 10**9)
    assert terms == {"cuda_context": CUDA_CONTEXT_BYTES, "fragmentation": 43 * 10**7}
    # in a plan: of the step peak and the all-to-all buffers
    model, defaults = resolve_model("configs/m6_1t.yaml")
    plan = make_plan(model, cluster_preset("v100-32gb", 60), PlanSettings(**defaults))
    dynamic = plan.gpu_memory["step_peak"] + plan.gpu_memory["all_to_all_buffers"]
    assert plan.reserve["fragmentation"] == round(FRAGMENTATION * dynamic)
