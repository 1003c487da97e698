"""The plan's all-to-all traffic as the run sends it: ``a2a_chunks`` n sends every row exchange in n
chunks (n times the calls and messages, the same bytes; the report shows the latency they add and
never a negative hidden time), the fp16 wire's exponent column (``(D+1)*2`` bytes per fp32 or
bf16 row), and the fp16 wire's documented limits for tiny fp64 values."""

from __future__ import annotations

import inspect
import re

import pytest
import torch

from moe_lm import MoETransformerLM, describe_lm
from moetrain.comm import compression
from moetrain.comm.compression import decode_rows, encode_rows
from moetrain.planner import PlanSettings, cluster_preset, make_plan
from moetrain.planner.mixed import plan_mixed_cluster
from moetrain.planner.model import resolve_model
from moetrain.planner.plan_layout import wire_row_bytes
from tests.helpers.collectives import counting_all_to_all
from tests.helpers.dist_utils import run_distributed
from tests.helpers.paths import ROOT
from tests.helpers.planner_peak_cases import fixed_routing
from tests.unit.planner.test_planner_validation import WithLoss, cluster_for, lm_config

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TINY_CLUSTER = cluster_preset("a100-80gb", 2, gpus_per_node=2)  # ep 4 over 2 nodes x 2 GPUs


@pytest.fixture(scope="module")
def tiny_lm():
    return resolve_model(str(ROOT / "configs" / "tiny_lm.yaml"))


def _tiny_plan(tiny_lm, **settings):
    model, defaults = tiny_lm
    return make_plan(model, TINY_CLUSTER, PlanSettings(**{**defaults, "ep_size": 4, **settings}))


def _traffic(plan, name: str):
    return next(t for t in plan.traffic if t.name == name)


@pytest.mark.parametrize("algorithm", ["flat", "hierarchical"])
def test_chunks_multiply_the_row_exchanges_calls_and_messages_not_their_bytes(tiny_lm, algorithm):
    one, four = (_tiny_plan(tiny_lm, all_to_all=algorithm, a2a_chunks=n) for n in (1, 4))
    assert four.time["a2a_chunks"] == 4
    rows1, rows4 = _traffic(one, "all_to_all"), _traffic(four, "all_to_all")
    assert rows1.calls > 0 and rows4.calls == 4 * rows1.calls
    assert rows4.intra_messages == 4 * rows1.intra_messages
    assert rows4.inter_messages == 4 * rows1.inter_messages > 0
    assert (rows4.intra_bytes, rows4.inter_bytes) == (rows1.intra_bytes, rows1.inter_bytes)
    assert _traffic(four, "all_to_all_counts") == _traffic(one, "all_to_all_counts")  # never chunked
    other = "hierarchical" if algorithm == "flat" else "flat"
    for chunks, plan in ((1, one), (4, four)):  # the alternative: the other algorithm in as many chunks
        alone = _tiny_plan(tiny_lm, all_to_all=other, a2a_chunks=chunks)
        rows, counts, alt = (
            _traffic(alone, "all_to_all"),
            _traffic(alone, "all_to_all_counts"),
            plan.all_to_all_alternative,
        )
        for field in ("calls", "intra_messages", "inter_messages", "inter_bytes", "seconds"):
            assert getattr(alt, field) == pytest.approx(getattr(rows, field) + getattr(counts, field)), field
    # the extra messages' latency is in the all-to-all time, and only they differ
    t1, t4 = one.time, four.time
    latency = t4["all_to_all_chunk_latency_s"]
    assert latency > 0 and t1["all_to_all_chunk_latency_s"] == 0
    assert t4["all_to_all_s"] - t1["all_to_all_s"] == pytest.approx(latency)
    messages = 3 * (rows1.intra_messages * TINY_CLUSTER.intra_node_latency) + 3 * (
        rows1.inter_messages * TINY_CLUSTER.inter_node_latency
    )
    assert latency == pytest.approx(messages)
    assert t4["all_to_all_hidden_s"] >= 0 and t1["all_to_all_hidden_s"] == 0
    step = t4["compute_s"] + t4["recompute_s"] + t4["all_to_all_s"] - t4["all_to_all_hidden_s"]
    step += t4["grad_sync_s"] + t4["optimizer_exposed_s"]
    assert t4["step_s"] == pytest.approx(step)


def test_the_report_shows_the_chunks_latency_and_never_a_negative_hidden_time(tiny_lm):
    """tiny_lm's exchanges are latency-bound: 4 chunks cost more latency than they hide."""
    plan = _tiny_plan(tiny_lm, all_to_all="flat", a2a_chunks=4)
    t = plan.time
    assert t["all_to_all_chunk_latency_s"] > t["all_to_all_hidden_s"] >= 0  # chunking is a net loss here
    text = plan.format_table()
    assert "- -" not in text
    line = next(line for line in text.splitlines() if "hidden behind the experts" in line)
    assert (
        f"all-to-all {(t['all_to_all_s'] - t['all_to_all_chunk_latency_s']) * 1e3:.1f} ms + "
        f"{t['all_to_all_chunk_latency_s'] * 1e3:.1f} ms latency of its 4 chunks - "
        f"{t['all_to_all_hidden_s'] * 1e3:.1f} ms hidden behind the experts" in line
    )
    table = next(line for line in text.splitlines() if line.lstrip().startswith("all_to_all (flat)"))
    rows = _traffic(plan, "all_to_all")
    assert table.split()[2:3] == [str(rows.calls)]
    unchunked = _tiny_plan(tiny_lm, all_to_all="flat", a2a_chunks=1).format_table()
    assert "latency of its" not in unchunked and "hidden behind" not in unchunked


def test_a_mixed_cluster_waits_for_the_exposed_all_to_all(tiny_lm):
    """The time every rank waits for counts the chunked all-to-all less what it hides, as the step
    does (not the latency its chunks add without what they hide)."""
    model, defaults = tiny_lm
    settings = PlanSettings(**{**defaults, "ep_size": 4, "a2a_chunks": 4, "grad_accum": 1})
    parts = [("a100-80gb", 1), ("v100-32gb", 1)]
    mixed = plan_mixed_cluster(model, parts, settings, global_batch=8, gpus_per_node=2)
    waits, serial = [], []
    for gpu, _ in parts:
        plan = make_plan(model, cluster_preset(gpu, 2, gpus_per_node=2), settings.replace(micro_batch=2))
        t = plan.time
        assert t["a2a_chunks"] == 4 and t["all_to_all_hidden_s"] > 0
        rest = t["grad_sync_s"] + t["optimizer_exposed_s"]
        waits.append(t["all_to_all_s"] - t["all_to_all_hidden_s"] + rest)
        serial.append(t["all_to_all_s"] + rest)
    assert mixed.common_s == pytest.approx(max(waits)) and mixed.common_s < max(serial)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("comm_dtype", [None, "bf16", "fp16"])
def test_the_planner_s_row_bytes_are_what_encode_rows_sends(precision, comm_dtype):
    for d_model in (16, 1024):
        wire = encode_rows(torch.zeros(3, d_model, dtype=DTYPES[precision]), comm_dtype)
        assert wire_row_bytes(d_model, precision, comm_dtype) == wire.shape[1] * wire.element_size()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_plan_counts_the_fp16_wire_s_exponent_column(tiny_lm, precision):
    """(D+1)*2 bytes per fp32 or bf16 row on the fp16 wire (D*2 was planned: 1/D too few)."""
    model, _ = tiny_lm
    d_model, b = model.arch.d_model, 4 if precision == "fp32" else 2
    plain, wired = (_tiny_plan(tiny_lm, precision=precision, comm_dtype=c) for c in (None, "fp16"))
    rows, wire_rows = _traffic(plain, "all_to_all"), _traffic(wired, "all_to_all")
    width = encode_rows(torch.zeros(1, d_model, dtype=DTYPES[precision]), "fp16").shape[1]
    assert width == d_model + 1
    assert wire_rows.inter_bytes * d_model * b == pytest.approx(rows.inter_bytes * width * 2)
    assert wire_rows.intra_bytes * d_model * b == pytest.approx(rows.intra_bytes * width * 2)


def count_worker(rank, world, local_world, cases):
    """Per case, one forward and backward of a 2-layer MoE LM (fixed balanced routing, dropless)
    with every ``all_to_all_single`` counted (``tests.helpers.collectives.counting_all_to_all``),
    and the plan's figures for the same settings."""
    import torch.distributed as dist

    from moetrain.layers import shard_experts
    from moetrain.parallel import ParallelContext

    original, out = dist.all_to_all_single, []
    for algorithm, chunks, precision, comm_dtype in cases:
        log = dict.fromkeys(("calls", "intra", "inter", "intra_messages", "inter_messages"), 0)
        ctx = ParallelContext(
            ep_size=world, all_to_all=algorithm, a2a_chunks=chunks, comm_dtype=comm_dtype,
            local_world_size=local_world,
        )  # fmt: skip
        config = lm_config(capacity_factor=None)
        torch.manual_seed(3)
        model = MoETransformerLM(config)
        for block in model.blocks:
            shard_experts(block.ffn, ctx)
        model = model.to(DTYPES[precision])
        fixed_routing(model)
        generator = torch.Generator().manual_seed(100 + rank)
        tokens = torch.randint(0, 64, (4, 32), generator=generator)
        targets = torch.randint(0, 64, (4, 32), generator=generator)
        dist.all_to_all_single = counting_all_to_all(log, local_world)
        try:
            WithLoss(model)(tokens, targets).backward()
        finally:
            dist.all_to_all_single = original
        settings = PlanSettings(
            ep_size=world, micro_batch=4, seq_len=32, precision=precision, recompute="none",
            all_to_all=algorithm, a2a_chunks=chunks, comm_dtype=comm_dtype,
        )  # fmt: skip
        plan = make_plan(describe_lm(config), cluster_for(world, local_world), settings, kernels="cpu")
        a2a = [t for t in plan.traffic if t.name.startswith("all_to_all")]
        planned = {
            "calls": sum(t.calls for t in a2a),
            "intra": sum(t.intra_bytes for t in a2a),
            "inter": sum(t.inter_bytes for t in a2a),
            "intra_messages": sum(t.intra_messages for t in a2a),
            "inter_messages": sum(t.inter_messages for t in a2a),
        }
        out.append((planned, log))
    return out


COUNT_CASES = [  # algorithm, a2a_chunks, precision, comm_dtype
    ("flat", 4, "fp32", None),
    ("hierarchical", 3, "bf16", "fp16"),
    ("flat", 1, "fp32", "fp16"),
]


@pytest.mark.timeout(300)
def test_the_run_sends_the_planned_calls_messages_and_bytes_chunked_and_on_the_fp16_wire():
    """4 gloo ranks as 2 nodes x 2: every rank's counted exchanges equal the plan's."""
    results = run_distributed(count_worker, 4, 2, COUNT_CASES, timeout=280)
    for rank, cases in enumerate(results):
        for case, (planned, measured) in zip(COUNT_CASES, cases, strict=True):
            assert planned == pytest.approx(measured), (rank, case, planned, measured)


# ---- the fp16 wire's tiny fp64 values (moetrain/comm/compression.py, docs/expert_parallel.md)

NORMAL_LIMIT = 2.0**-1014  # fp16's smallest normal 2^-14 under the smallest scale 2^-1000
ZERO_LIMIT = 2.0**-1025  # half of fp16's smallest subnormal 2^-24 under that scale
U = 2.0**-11


def _round_trip(values: list[float], kernels: str) -> torch.Tensor:
    x = torch.tensor([values], dtype=torch.float64)
    return decode_rows(encode_rows(x, "fp16", kernels), "fp16", torch.float64, kernels)[0]


def test_the_documented_tiny_fp64_limits_are_stated():
    doc = (ROOT / "docs" / "expert_parallel.md").read_text(encoding="utf-8")
    section = " ".join(doc.split("## Reduced-precision wire", 1)[1].split("\n## ", 1)[0].split())
    docstring = " ".join(inspect.getdoc(compression).split())
    for text in (section, docstring):
        assert "1e-297 arrive" not in text and "1e-297 flush" not in text
        assert re.search(r"2\^-1014 \(~5\.7e-306\)", text), text
        assert re.search(r"zeros at 2\^-1025 \(~2\.8e-309\) and below", text), text
        assert "2^-986" in text
    assert f"{NORMAL_LIMIT:.1e}" == "5.7e-306" and f"{ZERO_LIMIT:.1e}" == "2.8e-309"


@pytest.mark.parametrize("kernels", ["torch", "auto"])
def test_tiny_fp64_values_keep_u_down_to_2_pow_minus_1014_and_vanish_only_at_2_pow_minus_1025(kernels):
    # above the normal limit: within u |v|, in a row whose scale stopped at 2^-1000 (1e-300 < 2^-986)
    above = [1e-300, -3.3e-301, NORMAL_LIMIT * 1.25, -NORMAL_LIMIT * 1.0001]
    back = _round_trip(above, kernels)
    for v, q in zip(above, back.tolist(), strict=True):
        assert abs(q - v) <= U * abs(v), (v, q)
    # below it: fp16 subnormals, an absolute error of at most 2^-1025, more than u |v|, not zero
    below = [1e-306, -NORMAL_LIMIT * 0.8, 3e-309, ZERO_LIMIT * 1.5]
    back = _round_trip(below, kernels)
    for v, q in zip(below, back.tolist(), strict=True):
        assert q != 0 and abs(q - v) <= ZERO_LIMIT, (v, q)
    assert abs(back[0].item() - 1e-306) > U * 1e-306
    # at 2^-1025 and below: zeros
    assert _round_trip([ZERO_LIMIT, -ZERO_LIMIT, 1e-310], kernels).tolist() == [0.0, 0.0, 0.0]
