"""The overlap model of the chunked all-to-all (moetrain.comm.chunking), its chunk chooser, and the
planner's use of both (step time less what is hidden, the chunked buffers)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from moetrain.comm.chunk_cost import Links, run_links
from moetrain.comm.chunking import (
    ExchangeCost,
    choose_chunks,
    chunked_comm_bytes,
    hidden_seconds,
    overlapped_seconds,
    unchunked_comm_bytes,
)
from moetrain.config import ParallelConfig
from moetrain.config.parallel import A2A_LINK_FIELDS
from moetrain.planner import PlanSettings, make_plan
from moetrain.planner.hardware import EMULATED_GLOO_LINKS, M6T_V100_LINKS, cluster_preset
from moetrain.planner.model import resolve_model


def test_one_chunk_is_the_serial_layer_and_hides_nothing():
    cost = ExchangeCost(latency=0.001, transfer=0.040)
    t_f, t_b = overlapped_seconds(cost, 0.03, 0.03, 0.03, 1)
    assert t_f == pytest.approx(2 * 0.041 + 0.03) and t_b == pytest.approx(2 * 0.041 + 0.06)
    assert hidden_seconds(cost, 0.03, 0.03, 0.03, 1) == pytest.approx(0.0)


def test_compute_bound_and_link_bound_limits():
    # compute-bound: only the first exchange and the last return show (forward)
    cost = ExchangeCost(latency=0.0, transfer=0.008)
    t_f, _ = overlapped_seconds(cost, 0.1, 0.1, 0.1, 4)
    assert t_f == pytest.approx(2 * 0.002 + 0.1)
    # link-bound: the link carries 2 n chunk exchanges, plus one chunk's computation
    cost = ExchangeCost(latency=0.001, transfer=0.1)
    t_f, _ = overlapped_seconds(cost, 0.02, 0.02, 0.02, 4)
    assert t_f == pytest.approx(8 * (0.001 + 0.025) + 0.005)


def test_the_chooser_splits_bytes_not_latency():
    assert choose_chunks(ExchangeCost(0.0, 0.05), 0.05, 0.05, 0.05, max_chunks=8) == 8  # free chunks
    assert choose_chunks(ExchangeCost(0.05, 0.0), 0.05, 0.05, 0.05) == 1  # nothing to split
    balanced = choose_chunks(ExchangeCost(0.001, 0.04), 0.04, 0.04, 0.04)
    assert 2 <= balanced <= 8
    cost = ExchangeCost(0.001, 0.04)
    best = min(range(1, 9), key=lambda n: sum(overlapped_seconds(cost, 0.04, 0.04, 0.04, n)))
    assert balanced == best


def test_comm_bytes_models():
    assert unchunked_comm_bytes(100, 80, 1, encoded=False) == 80
    assert unchunked_comm_bytes(100, 80, 2, encoded=True) == 80 + 100 + 300
    assert chunked_comm_bytes(100, 80, 1, 2) == 180  # two trips of half the rows
    assert chunked_comm_bytes(100, 80, 2, 8) == pytest.approx(4 * 180 / 8)
    assert chunked_comm_bytes(100, 80, 2, 16) < chunked_comm_bytes(100, 80, 2, 8)


def test_a2a_chunks_config_values():
    assert ParallelConfig(a2a_chunks="auto").a2a_chunks == "auto"
    for bad in (0, -1, "4", 2.5, True):
        with pytest.raises(ValueError, match="a2a_chunks must be an integer >= 1 or 'auto'"):
            ParallelConfig(a2a_chunks=bad)
    with pytest.raises(ValueError, match="a2a_chunks must be an integer >= 1 or 'auto'"):
        PlanSettings(a2a_chunks=0)


def test_runtime_constants_say_where_they_come_from():
    for links in (EMULATED_GLOO_LINKS, M6T_V100_LINKS):
        assert links.source and links.flops_per_s > 0 and links.inter_node_bandwidth > 0


def test_run_links_come_from_the_config_or_the_cpu_fit():
    """``a2a_chunks="auto"`` at run time: ``parallel.a2a_links`` when set, the measured gloo fit on
    CPU ranks otherwise, and on GPU ranks an error naming the option (no V100 table behind it)."""
    stated = dict.fromkeys(A2A_LINK_FIELDS, 1.0)
    assert run_links(stated, "cuda") == Links(**stated, source="parallel.a2a_links")
    assert run_links(None, "cpu") is EMULATED_GLOO_LINKS
    with pytest.raises(ValueError, match="needs parallel.a2a_links"):
        run_links(None, "cuda")
    assert ParallelConfig(a2a_links=stated).a2a_links == stated
    for bad in ({**stated, "extra": 1.0}, {**stated, "flops_per_s": 0}, [1.0] * 5):
        with pytest.raises(ValueError, match="a2a_links"):
            ParallelConfig(a2a_links=bad)


def test_the_shipped_m6_1t_run_chooses_with_the_m6t_links_as_before():
    """configs/m6_1t.yaml states the M6-T links the run used to take from the planner's table."""
    parallel = yaml.safe_load(Path("configs/m6_1t.yaml").read_text())["parallel"]
    links = run_links(ParallelConfig(**parallel).a2a_links, "cuda")
    assert replace(links, gpus_per_node=8, source="") == replace(M6T_V100_LINKS, source="")


@pytest.fixture(scope="module")
def m6_1t():
    return resolve_model("configs/m6_1t.yaml")


def test_the_planner_hides_part_of_the_all_to_all_and_shrinks_its_buffers(m6_1t):
    model, defaults = m6_1t
    cluster = cluster_preset("v100-32gb", 60, inter_node_bandwidth=35e9 / 8)
    # at 16 sequences per micro-step (the shipped config takes 4 x 4): 8 chunks of 4 sequences'
    # exchange cost more latency than they hide
    big = {**defaults, "micro_batch": 16, "grad_accum": 1}
    chunks = (1, 2, 8, "auto")
    plans = {n: make_plan(model, cluster, PlanSettings(**{**big, "a2a_chunks": n})) for n in chunks}
    assert plans[1].time["all_to_all_hidden_s"] == 0
    for n in (2, 8):
        hidden = plans[n].time["all_to_all_hidden_s"]
        assert 0 < hidden < plans[n].time["all_to_all_s"]
        t = plans[n].time
        parts = (
            t["compute_s"]
            + t["recompute_s"]
            + t["all_to_all_s"]
            + t["grad_sync_s"]
            + t["optimizer_exposed_s"]
        )
        assert t["step_s"] == pytest.approx(parts - hidden)
    assert plans[8].gpu_memory["all_to_all_buffers"] < plans[2].gpu_memory["all_to_all_buffers"]
    auto = plans["auto"]
    assert auto.time["step_s"] <= min(p.time["step_s"] for p in plans.values()) + 1e-9
    assert defaults["a2a_chunks"] == "auto"  # the shipped config asks for it; README quotes that plan
