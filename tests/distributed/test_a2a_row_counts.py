"""Every row count and every row dtype through the expert-parallel exchanges (issue #25).

``all_to_all: node_dedup`` packs each copy's row and its int32 slot ids into one byte message; it
used to take byte views of tensors whose strides or offsets forbid them (``.contiguous()`` keeps the
strides of a 0- or 1-row tensor; fp64 rows followed by an odd number of int32 ids), and every rank
crashed when a rank sent or received zero or one rows. Here:

- :func:`moetrain.comm.all_to_all.pack_rows` / ``unpack_rows`` round-trip bit for bit for 0 to 5
  rows, every dtype and width, any input strides and any received strides or storage offset;
- the wire formats of ``comm_dtype`` keep the per-element bound docs/expert_parallel.md states;
- on gloo ranks (world 4 as 2 nodes x 2; world 8 as 2 x 4 and 4 x 2), the MoE layer under
  ``node_dedup``, ``flat`` and ``hierarchical`` with 0 to 3 tokens per rank, top_k 1 to 3, fp32 /
  fp64 / bf16 / fp16 rows, without a wire and with the bf16 and fp16 wires, against one process
  on the global batch (dropless, no aux loss: where the two are the same computation), many cases
  per launch. The forward output with fp32 / fp64 rows on a reduced wire is checked against the
  documented bound: at most ``k u (1 + u) sum_j g_j |f_j(Q(x))|`` per element away from the same
  layer whose experts see the wire-rounded rows ``Q(x)`` (k = 2 for node_dedup, else 1).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from moetrain import MoEConfig, MoELayer, shard_experts
from moetrain.comm.all_to_all import pack_rows, packed_row_layout, unpack_rows
from moetrain.comm.compression import decode_rows, encode_rows
from moetrain.parallel import ParallelContext
from tests.helpers.dist_utils import run_distributed

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.uint8]


def _random_bits(rows: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Arbitrary bit patterns of ``dtype`` (NaNs and infinities included for floats)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (rows, width * dtype.itemsize), generator=g, dtype=torch.uint8)
    return raw.view(dtype)


def _odd_strides(x: torch.Tensor, how: str) -> torch.Tensor:
    """The same values with strides a caller may hand over: a column slice of a wider tensor, a
    column-major tensor, or (0 or 1 rows) the degenerate strides ``.contiguous()`` leaves alone."""
    rows, width = x.shape
    if how == "plain":
        return x
    if how == "slice":
        wide = torch.zeros(rows, width + 3, dtype=x.dtype, device=x.device)
        wide[:, 1 : 1 + width] = x
        return wide[:, 1 : 1 + width]
    if how == "degenerate" and rows <= 1:
        store = torch.zeros(width + 8, dtype=x.dtype, device=x.device)
        out = store.as_strided((rows, width), (width + 5, 1 if width > 1 else 0), 1)
        if rows:
            out.copy_(x)
        assert out.is_contiguous()  # torch calls it contiguous: .contiguous() returns it as it is
        return out
    return x.t().contiguous().t()  # column-major (and "degenerate" with 2 or more rows)


def _largest(t: torch.Tensor) -> float:
    return float(t.max()) if t.numel() else 0.0


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5])
def test_pack_rows_round_trips_bit_for_bit(rows, device):
    """Every pair and triple of dtypes, widths 1 to 3, inputs of odd strides, received messages with
    degenerate strides and misaligned storage offsets: the fields come back bit for bit, each a
    fresh contiguous tensor."""
    checked = 0
    for seed, (dtypes, widths, how) in enumerate(
        itertools.product(
            [*itertools.product(DTYPES, repeat=2), (torch.float64, torch.int32, torch.float16)],
            [(1, 1, 1), (3, 1, 2), (2, 3, 1)],
            ["plain", "slice", "degenerate", "column-major"],
        )
    ):
        fields = [
            _random_bits(rows, w, d, 3 * seed + i).to(device)
            for i, (d, w) in enumerate(zip(dtypes, widths, strict=False))
        ]
        layout = [(f.dtype, f.shape[1]) for f in fields]
        packed = pack_rows([_odd_strides(f, how) for f in fields])
        offsets, row_bytes = packed_row_layout(layout)
        assert packed.dtype == torch.uint8 and packed.shape == (rows, row_bytes)
        assert packed.device == fields[0].device
        for offset, (dtype, _) in zip(offsets, layout, strict=True):
            assert offset % dtype.itemsize == 0 and row_bytes % dtype.itemsize == 0
        for shift in (0, 1, 4):  # as received: inside a larger buffer at an odd byte offset
            store = torch.zeros(rows * row_bytes + shift + 16, dtype=torch.uint8, device=device)
            got = store[shift : shift + rows * row_bytes].view(rows, row_bytes)
            got.copy_(packed)
            if rows == 1:  # a 1-row message may carry any row stride
                got = store.as_strided((1, row_bytes), (row_bytes + 9, 1), shift)
            out = unpack_rows(got, layout)
            assert all(_same_bits(a, b) for a, b in zip(out, fields, strict=True)), (dtypes, widths, how)
            assert all(o.is_contiguous() and (rows < 2 or o.stride() == (o.shape[1], 1)) for o in out)
            assert all(o.device == fields[0].device for o in out)
            checked += 1
    assert checked == (len(DTYPES) ** 2 + 1) * 3 * 4 * 3


def test_packed_row_layout_aligns_every_field_and_pads_with_zeros():
    assert packed_row_layout([(torch.float32, 8), (torch.int32, 2)]) == ([0, 32], 40)
    assert packed_row_layout([(torch.float64, 8), (torch.int32, 1)]) == ([0, 64], 72)  # 68 -> 72
    assert packed_row_layout([(torch.bfloat16, 3), (torch.int32, 1)]) == ([0, 8], 12)  # 6 -> 8
    assert packed_row_layout([(torch.float16, 9), (torch.int32, 3)]) == ([0, 20], 32)
    packed = pack_rows([torch.ones(2, 3, dtype=torch.bfloat16), torch.full((2, 1), -1, dtype=torch.int32)])
    assert packed[:, 6:8].eq(0).all()  # the padding travels as zeros, not as whatever memory held
    with pytest.raises(ValueError, match="uint8 message"):
        unpack_rows(packed, [(torch.bfloat16, 3), (torch.int32, 2)])


# What docs/expert_parallel.md states for `comm_dtype` (section "Reduced-precision wire"): every
# element crossing is rounded once to the wire format and decoded exactly: |Q(v) - v| <= u |v|
# (u = 2^-8 for bf16, 2^-11 for fp16; fp64 rows pass through fp32 first, which can miss the nearest
# wire value but stays within u |v|). On the fp16 wire, elements below 2^-28 of their row's largest
# may fall into fp16's subnormals: an absolute error of at most 2^-39 of the row's largest instead.
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}


@pytest.mark.parametrize("comm_dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_wire_rounds_each_element_once_within_the_documented_bound(comm_dtype, dtype):
    g = torch.Generator().manual_seed(3)
    rows = [
        torch.randn(64, 33, generator=g, dtype=torch.float64),
        torch.randn(64, 33, generator=g, dtype=torch.float64) * torch.logspace(-30, 30, 33).double(),
        (1 + torch.rand(64, 33, generator=g, dtype=torch.float64)) * 2.0 ** torch.randint(-60, 60, (64, 1)),
    ]
    x = torch.cat(rows).to(dtype)
    if comm_dtype == "bf16":  # bf16 keeps fp32's exponent range only: stay inside its normal range
        x = torch.where(x.abs() > 1e-37, x, 1.0).clamp(-1e37, 1e37)
    for kernels in ("torch", "auto"):
        back = decode_rows(encode_rows(x, comm_dtype, kernels), comm_dtype, dtype, kernels)
        err = (back.double() - x.double()).abs()
        row_max = x.double().abs().amax(1, keepdim=True)
        u = UNIT_ROUNDOFF[comm_dtype]
        normal = x.double().abs() >= (2.0**-28 * row_max if comm_dtype == "fp16" else 0.0)
        ratio = err[normal] / (u * x.double().abs()[normal])
        assert float(ratio.max()) <= 1.0, (kernels, float(ratio.max()))
        assert float(ratio.max()) > 0.9  # the bound is attained: one rounding, not a loose estimate
        assert _largest(err[~normal] / (2.0**-39 * row_max.expand_as(err)[~normal])) <= 1.0


def test_fp64_rows_on_the_bf16_wire_round_twice_and_stay_within_u():
    """fp64 rows reach the bf16 wire through fp32 (two roundings): not always the nearest bf16
    value, but the double rounding's extra 2^-24 fits in the slack of u |v| (a value that far from
    a bf16 value is at least 1 + 2^-8 times a power of two)."""
    v = torch.tensor([[1 + 2.0**-8 + 2.0**-30]], dtype=torch.float64)  # just above a bf16 midpoint
    got = float(decode_rows(encode_rows(v, "bf16"), "bf16", torch.float64))
    assert got == 1.0, "torch now rounds fp64 to bf16 directly: docs/expert_parallel.md can say so"
    assert abs(got - float(v)) <= 2.0**-8 * float(v)
    g = torch.Generator().manual_seed(5)
    odd = 2 * torch.randint(1, 2**7, (4096,), generator=g, dtype=torch.float64) - 1
    near = 1 + odd * 2.0**-8 + 2.0**-25 * torch.rand(4096, generator=g, dtype=torch.float64)  # near midpoints
    back = decode_rows(encode_rows(near.view(64, 64), "bf16"), "bf16", torch.float64).view(-1)
    assert float(((back - near).abs() / (2.0**-8 * near.abs())).max()) <= 1.0


# ------------------------------------------------------------------ the layer on gloo ranks

D_MODEL, D_FF = 16, 8  # 16 fp64 values + one int32 id: a 132-byte message row (68 in the issue)
PATTERNS = {  # tokens on EP rank r of P
    "one_empty": lambda r, p: 0 if r == 1 else 3,
    "ones": lambda r, p: 1,
    "rotate0": lambda r, p: r % 4,
    "rotate1": lambda r, p: (r + 1) % 4,
    "rotate2": lambda r, p: (r + 2) % 4,
    "rotate3": lambda r, p: (r + 3) % 4,
    "empty": lambda r, p: 0,
}
WIRES = [None, "bf16", "fp16"]
ROW_DTYPES = ["float32", "float64", "bfloat16", "float16"]
ALGORITHMS = {  # name: (all_to_all, a2a_chunks); the chunked exchange splits a rank's 0 to 3 rows in 2
    "node_dedup": ("node_dedup", 1),
    "flat": ("flat", 1),
    "hierarchical": ("hierarchical", 1),
    "hierarchical_chunked": ("hierarchical", 2),
}
ROUNDINGS_BACK = {"node_dedup": 2, "flat": 1, "hierarchical": 1, "hierarchical_chunked": 1}


def _inputs(case_index: int, rank: int, tokens: int, dtype):
    g = torch.Generator().manual_seed(1000 * case_index + rank)
    x = torch.randn(tokens, D_MODEL, generator=g, dtype=torch.float64)
    return x.to(dtype), torch.randn(tokens, D_MODEL, generator=g, dtype=torch.float64).to(dtype)


def _layer(cfg, dtype, ctx=None):
    torch.manual_seed(4321)
    layer = MoELayer(cfg)
    return (layer if ctx is None else shard_experts(layer, ctx)).to(dtype)


def _with_experts(layer, wrap):
    """``layer`` whose experts compute ``wrap(experts, x_ND, counts)``."""
    experts = layer.experts
    original = experts.forward
    experts.forward = lambda x_ND, counts: wrap(original, x_ND, counts)
    return layer


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.numel() else 0.0


def _on_wire(cfg, dtype, comm_dtype, x_TD):
    """The one-process layer whose experts see the wire-rounded rows: (``sum_j g_j f_j(Q(x))``,
    ``sum_j g_j |f_j(Q(x))|``) of the tokens ``x_TD``, in fp64."""

    def wired(v):
        return decode_rows(encode_rows(v, comm_dtype), comm_dtype, v.dtype)

    with torch.no_grad():
        out = _with_experts(_layer(cfg, dtype), lambda f, v, c: f(wired(v), c))(x_TD)
        scale = _with_experts(_layer(cfg, dtype), lambda f, v, c: f(wired(v), c).abs())(x_TD)
    return out.double(), scale.double()


def layer_worker(rank, world, cases):
    """``cases``: (local_world, pattern, top_k, experts per rank, row dtype, comm_dtype). Per case,
    the layer under each algorithm and one process on the global batch, forward and backward."""
    import torch.distributed as dist

    contexts: dict = {}
    results = []
    for index, (local_world, pattern, top_k, per_rank, dtype_name, comm_dtype) in enumerate(cases):
        dtype = getattr(torch, dtype_name)
        experts = per_rank * world
        cfg = MoEConfig(d_model=D_MODEL, d_ff=D_FF, num_experts=experts, top_k=top_k, capacity_factor=None,
                        aux_loss_coef=0.0)  # fmt: skip
        tokens = [PATTERNS[pattern](r, world) for r in range(world)]
        inputs = [_inputs(index, r, tokens[r], dtype) for r in range(world)]
        x, upstream = inputs[rank]
        mine = slice(sum(tokens[:rank]), sum(tokens[: rank + 1]))
        # one process, the global batch (dropless, no aux loss: the same computation)
        reference = _layer(cfg, dtype)
        x_all = torch.cat([xs for xs, _ in inputs]).requires_grad_(True)
        out_all = reference(x_all)
        out_all.backward(torch.cat([us for _, us in inputs]))
        local = range(rank * per_rank, (rank + 1) * per_rank)
        ref = {"out": out_all.detach()[mine], "grad_x": x_all.grad[mine],
               "router": reference.router.weight.grad,
               "w1": reference.experts.w1_EDF.grad[local.start : local.stop],
               "w2": reference.experts.w2_EFD.grad[local.start : local.stop]}  # fmt: skip
        bounded = comm_dtype is not None and dtype in (torch.float32, torch.float64)
        if bounded:
            on_wire, scale = _on_wire(cfg, dtype, comm_dtype, x)
        case = {"case": cases[index], "tokens": tokens}
        routers = []  # each rank's router gradient is its own tokens': summed over the ranks below
        unchunked, runs = None, {}
        for algorithm, (all_to_all, chunks) in ALGORITHMS.items():
            key = (local_world, algorithm, comm_dtype)
            if key not in contexts:
                contexts[key] = ParallelContext(ep_size=world, all_to_all=all_to_all, comm_dtype=comm_dtype,
                                                local_world_size=local_world, a2a_chunks=chunks)  # fmt: skip
            ctx = contexts[key]
            assert ctx.all_to_all == all_to_all and ctx.ep_node_grid == (world // local_world, local_world)
            layer = _layer(cfg, dtype, ctx)
            shards = layer.experts  # the documented layout: names kept, dim 0 = global experts `local`
            case[algorithm + "_layout"] = (
                (shards.first_expert, shards.num_experts, shards.total_experts)
                == (local.start, per_rank, experts)
                and [n for n, _ in layer.named_parameters()] == [n for n, _ in reference.named_parameters()]
                and all(
                    torch.equal(p, dict(reference.named_parameters())[n][local.start : local.stop])
                    if n.startswith("experts.") else torch.equal(p, dict(reference.named_parameters())[n])
                    for n, p in layer.named_parameters()
                )
            )  # fmt: skip
            xi = x.clone().requires_grad_(True)
            out = layer(xi)
            out.backward(upstream)
            got = {"out": out.detach(), "grad_x": xi.grad, "router": layer.router.weight.grad,
                   "w1": layer.experts.w1_EDF.grad, "w2": layer.experts.w2_EFD.grad}  # fmt: skip
            case[algorithm] = {name: _rel(got[name], ref[name]) for name in ref if name != "router"}
            runs[algorithm] = got
            routers.append(got["router"])
            if chunks > 1:
                assert layer.dispatcher.last_chunks == chunks
                # bit for bit the unchunked exchange's (docs/expert_parallel.md: CPU, fp32 and fp64)
                case[algorithm]["bits"] = dtype not in (torch.float32, torch.float64) or all(
                    torch.equal(got[name], unchunked[name]) for name in ref
                )
            elif all_to_all == "hierarchical":
                unchunked = got
            if bounded:
                # the documented bound: |y - y(Q(x))| <= k u (1 + u) sum_j g_j |f_j(Q(x))| (+ the
                # summation order), k the roundings on the way back: 2 for node_dedup (the expert's row
                # on the intra-node hop, the node's partial sum on the inter-node one), else 1
                u = ROUNDINGS_BACK[algorithm] * UNIT_ROUNDOFF[comm_dtype] * (1 + UNIT_ROUNDOFF[comm_dtype])
                slack = (2.0**-18 if dtype == torch.float32 else 2.0**-40) * scale
                floor = 2.0**-38 * _largest(scale)  # fp16's subnormal clause
                err = (got["out"].double() - on_wire).abs()
                case[algorithm]["bound"] = _largest(err / (u * scale + slack + floor + 1e-300))
                case[algorithm]["attained"] = _largest(err / (u * scale + 1e-300))
        routers = torch.stack(routers)
        dist.all_reduce(routers)  # one all-reduce for every algorithm
        for algorithm, router in zip(ALGORITHMS, routers, strict=True):
            case[algorithm]["router"] = _rel(router, ref["router"])
        for name in ("out", "grad_x", "w1", "w2"):  # node_dedup against the flat all-to-all directly
            case["node_dedup"]["vs_flat_" + name] = _rel(runs["node_dedup"][name], runs["flat"][name])
        results.append(case)
    return results


TOLERANCE = {  # max |EP - one process| / max |one process| of outputs and every gradient
    ("float32", None): 4e-6,  # sums in another order (seen: 1.4e-7, ~2 units of fp32)
    ("float64", None): 1e-14,  # (seen: 4.6e-16)
    # a reduced wire or reduced rows round rows on the way out and back, and the experts' outputs and
    # gradients carry their inputs' rounding: 8 units of the coarser format (seen: up to 2.8)
    **{(dtype, wire): 8 * 2.0**-8 for dtype in ROW_DTYPES for wire in ("bf16",)},
    **{(dtype, "fp16"): 8 * 2.0**-11 for dtype in ("float32", "float64", "float16")},
    ("bfloat16", "fp16"): 8 * 2.0**-8,
    ("bfloat16", None): 8 * 2.0**-8,
    ("float16", None): 8 * 2.0**-11,
}


def _check(results) -> int:
    checked = 0
    for rank, rank_results in enumerate(results):
        for case in rank_results:
            _, _, _, _, dtype_name, comm_dtype = case["case"]
            tol = TOLERANCE[(dtype_name, comm_dtype)]
            assert len([n for n in case["node_dedup"] if n[:8] == "vs_flat_"]) == 4
            for algorithm in ALGORITHMS:
                assert case[algorithm + "_layout"], (rank, case["case"], algorithm)
                assert case[algorithm].get("bits", True), (rank, case["case"], algorithm, "not bit for bit")
                errors = case[algorithm]
                compared = ["out", "grad_x", "router", "w1", "w2"] + [
                    n for n in errors if n[:8] == "vs_flat_"
                ]
                for name in compared:
                    assert errors[name] <= tol, (rank, case["case"], case["tokens"], algorithm, name, errors)
                if "bound" in errors:
                    assert errors["bound"] <= 1.0, (rank, case["case"], algorithm, errors)
                checked += 1
    return checked


def _cases(local_world: int, dtypes_and_wires, top_ks, per_rank=(1,), shift: int = 0):
    """Every (row dtype, wire) x top_k once, the token patterns taken in turn (so that every pattern
    meets every top_k, and every rank holds 0, 1, 2 and 3 tokens in some case)."""
    names = list(PATTERNS)
    return [
        (local_world, names[(i + shift) % len(names)], top_k, per_rank[i % len(per_rank)], dtype, wire)
        for i, ((dtype, wire), top_k) in enumerate(itertools.product(dtypes_and_wires, top_ks))
    ]


ISSUE_CASES = [  # the layouts of issue #25: 2 nodes x 2, 4 experts, top_k 1, dropless
    (2, "one_empty", 1, 1, "float32", None),  # a rank with no tokens: stride(-1) must be 1 ... got 0
    (2, "one_empty", 1, 1, "float64", None),
    (2, "ones", 1, 1, "float64", None),  # one token per rank: stride(0) must be divisible by 8 ... got 68
]
WORLD4_CASES = ISSUE_CASES + _cases(2, list(itertools.product(ROW_DTYPES, WIRES)), [1, 2, 3], per_rank=(1, 2))


@pytest.mark.timeout(240)
def test_world4_every_row_count_and_dtype_matches_one_process():
    results = run_distributed(layer_worker, 4, WORLD4_CASES)
    assert _check(results) == 4 * len(WORLD4_CASES) * len(ALGORITHMS)
    counts = {tuple(case["tokens"]) for case in results[0]}
    assert all(any(c[r] == n for c in counts) for r in range(4) for n in range(4))  # 0..3 on every rank
    bounds = [c[a]["attained"] for rank in results for c in rank for a in ALGORITHMS if "bound" in c[a]]
    assert max(bounds) > 0.25  # the documented bound is near what the wire does, not a loose estimate


WORLD8_CASES = [
    (4, "ones", 3, 1, "float64", None),  # the issue's top_k 3 at world 8 as 2 x 4
    *_cases(4, [("float64", None), ("float32", "fp16"), ("bfloat16", "bf16"), ("float16", None)], [1, 3]),
    *_cases(
        2,
        [("float32", None), ("float64", "bf16"), ("float16", "bf16"), ("bfloat16", "fp16")],
        [1, 2],
        shift=3,
    ),
]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_world8_two_nodes_of_four_and_four_nodes_of_two_every_row_count():
    results = run_distributed(layer_worker, 8, WORLD8_CASES)
    assert _check(results) == 8 * len(WORLD8_CASES) * len(ALGORITHMS)
