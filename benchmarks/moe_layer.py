"""Forward+backward time of one MoELayer vs the dense-GEMM floor and a plain-PyTorch MoE.

Figures are ratios measured in the same run:
- ``floor``: the same FFN (same activation) applied to exactly the N routed rows the layer
  computes, as one dense GEMM pair: the FLOPs a perfect MoE layer cannot avoid;
- ``plain``: a straightforward PyTorch MoE (boolean masks, index_select / index_add_), written here;
- ``titan``: a MoE in torchtitan's style, written here: sort the routed slots by expert, gather the
  rows, torch's grouped GEMM with its own autograd (a per-expert ``torch.mm`` loop where torch's
  grouped GEMM cannot run: the CPU, non-bf16), gate and scatter-add back (``titan_over_ours``).

Cases (T=2048, d_model=512, d_ff=2048, E=8, top-2, fp32, 2 threads by default):
``capacity_1.0``, ``dropless_balanced`` and ``dropless_skewed`` (about half of the routed slots go
to 2 of the 8 experts). Every candidate of every case is warmed up first (10 calls), then each
measured round times every candidate of every case once, in turn (medians over rounds; ratios are
medians of per-round ratios). Usage: ``python benchmarks/moe_layer.py [--json PATH] [--repeats N]``.

GPU mode, ``--device cuda [--dtype bf16]``: the same cases at a GPU-sized default configuration
(T=16384, d_model=4096, d_ff=14336, E=8, top-2), layer and floor in ``--dtype`` (parameters too),
timed with CUDA events (warm-up, then the median). It adds the layer's achieved TFLOP/s against the
GPU's dense bf16/fp16 peak (a table keyed by ``torch.cuda.get_device_name()``; "unknown" for other
GPUs) and the achieved memory bandwidth of the permutation kernels (``csrc/permute_cuda.cu``,
``csrc/a2a_layout_cuda.cu``) against the device's copy bandwidth measured in the same run (a large
``tensor.copy_``), and where one call of ours and of the torchtitan-style MoE synchronizes the host
with the GPU (``host_syncs``: each empties the GPU's queue) and the host's time per call
(``host_ms``). Targets: ``ours_over_floor <= 1.10``, kernels >= 70% of the copy bandwidth.
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

from moetrain import MoELayer
from moetrain._ext import ops
from moetrain.comm.all_to_all import transpose_chunks
from moetrain.kernels import grouped_mm
from moetrain.layers import expert_path
from moetrain.layers.dispatch import build_dispatch_plan

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _cli import nonnegative_int, output_path, positive_int, write_json  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# (tokens, d_model, d_ff) when not given on the command line.
DEFAULT_SHAPES = {"cpu": (2048, 512, 2048), "cuda": (16384, 4096, 14336)}
# Dense bf16/fp16 tensor-core peak in TFLOP/s (no sparsity), by a substring of the device name.
# "H100 80GB HBM3" is how the H100 SXM reports itself; the H100 PCIe / NVL are not listed.
PEAK_TFLOPS_16BIT = [("H100 80GB HBM3", 989.0), ("H100 SXM", 989.0), ("H200", 989.0), ("A100", 312.0)]


def _median_ratio(numerators: list[float], denominators: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(numerators, denominators, strict=True))


def plain_pytorch_moe(x_TD, router_w_ED, w1_EDF, w2_EFD, top_k, capacity):
    """A readable MoE without custom kernels: softmax top-k, per-expert masks, index_add_."""
    probs_TE = torch.softmax(x_TD @ router_w_ED.t(), dim=-1)
    gates_TK, ids_TK = probs_TE.topk(top_k, dim=-1)
    gates_TK = gates_TK / gates_TK.sum(-1, keepdim=True)
    out_TD = torch.zeros_like(x_TD)
    for e in range(w1_EDF.shape[0]):
        token_idx, choice_idx = torch.nonzero(ids_TK == e, as_tuple=True)
        if capacity is not None:
            token_idx, choice_idx = token_idx[:capacity], choice_idx[:capacity]
        if token_idx.numel() == 0:
            continue
        h = F.gelu(x_TD.index_select(0, token_idx) @ w1_EDF[e]) @ w2_EFD[e]
        out_TD = out_TD.index_add(0, token_idx, h * gates_TK[token_idx, choice_idx].unsqueeze(-1))
    return out_TD


def _expert_gemm(x_NI, w_EIO, counts_E, offsets_E):
    """``x[rows_e] @ w[e]`` for every expert: torch's grouped GEMM on CUDA bf16, else a loop."""
    if x_NI.is_cuda and x_NI.dtype == torch.bfloat16 and hasattr(F, "grouped_mm"):
        return F.grouped_mm(x_NI, w_EIO, offs=offsets_E)
    parts = [x @ w_EIO[e] for e, x in enumerate(x_NI.split(counts_E.tolist())) if x.shape[0]]
    return torch.cat(parts) if parts else x_NI.new_zeros(0, w_EIO.shape[2])


def titan_style_moe(x_TD, router_w_ED, w1_EDF, w2_EFD, top_k, capacity):
    """torchtitan's way, written here: softmax top-k, routed slots stably sorted by expert (the first
    ``capacity`` of each expert kept), rows gathered, grouped GEMMs, gated, scatter-added back."""
    experts = w1_EDF.shape[0]
    probs_TE = torch.softmax(x_TD @ router_w_ED.t(), dim=-1)
    gates_TK, ids_TK = probs_TE.topk(top_k, dim=-1)
    gates_TK = gates_TK / gates_TK.sum(-1, keepdim=True)
    slots_S = torch.argsort(ids_TK.view(-1), stable=True)
    counts_E = torch.bincount(ids_TK.view(-1), minlength=experts)
    if capacity is not None:
        starts_E = torch.cumsum(counts_E, 0) - counts_E
        expert_S = ids_TK.view(-1)[slots_S]
        rank_S = torch.arange(slots_S.numel(), device=slots_S.device) - starts_E[expert_S]
        slots_S = slots_S[rank_S < capacity]
        counts_E = counts_E.clamp(max=capacity)
    offsets_E = torch.cumsum(counts_E, 0).to(torch.int32)
    token_N = slots_S // top_k
    h_NF = F.gelu(_expert_gemm(x_TD[token_N], w1_EDF, counts_E, offsets_E))
    y_ND = _expert_gemm(h_NF, w2_EFD, counts_E, offsets_E) * gates_TK.view(-1)[slots_S].unsqueeze(1)
    return torch.zeros_like(x_TD).index_add(0, token_N, y_ND.to(x_TD.dtype))


def skew_router(layer: MoELayer, x_TD: torch.Tensor, hot_experts: int, target_share: float) -> float:
    """Tilts the router so that ``hot_experts`` experts receive ``target_share`` of the routed slots:
    inputs share a common direction u and the hot experts' router rows get ``alpha * u`` added."""
    u = x_TD.mean(0)
    u = u / u.norm()
    base = layer.router.weight.detach().clone()
    low, high = 0.0, 50.0
    share = 0.0
    for _ in range(40):
        alpha = (low + high) / 2
        with torch.no_grad():
            layer.router.weight.copy_(base)
            layer.router.weight[:hot_experts] += alpha * u
            ids = layer.router(x_TD).expert_ids_TK
        share = float((ids < hot_experts).float().mean())
        if share < target_share:
            low = alpha
        else:
            high = alpha
    return share


def timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def timed_cuda(fn, repeats: int) -> list[float]:
    """Seconds per call from CUDA events recorded around each call on the current stream."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def layer_weights(args) -> dict[str, torch.Tensor]:
    """The state dict every case's layer starts from, on ``args.device`` in ``args.dtype``: drawn
    once (``nn.Linear``'s default per expert, seeded), since drawing the experts of the GPU shape
    on the host takes seconds per layer."""
    torch.manual_seed(0)
    layer = MoELayer(d_model=args.d_model, d_ff=args.d_ff, num_experts=args.experts, top_k=args.top_k)
    return layer.to(device=args.device, dtype=DTYPES[args.dtype]).state_dict()


def host_synchronizations(fn) -> list[str]:
    """Where one call of ``fn`` made the host wait for the GPU, as ``file:line`` of the Python line
    that did (``torch.cuda.set_sync_debug_mode("warn")`` warns at each synchronizing CUDA call).
    A synchronization empties the GPU's queue: the host work up to the next large kernel is then
    GPU idle time. ``fn`` ran before (a shape class's first-call measurements are not counted)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{pathlib.Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]


def host_ms(fn, repeats: int = 5) -> float:
    """Milliseconds the host spends in one call of ``fn`` started on an idle GPU: issuing its
    kernels, plus any wait for the GPU inside it (median of ``repeats``). Near the call's GPU time,
    the host, not the GPU, sets the pace."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        times += timed(fn, 1)
    torch.cuda.synchronize()
    return round(1e3 * statistics.median(times), 2)


def build_case(name: str, capacity_factor, skewed: bool, args, weights: dict | None = None) -> dict:
    """One case's candidates (``ours``, ``floor``, ``plain``, ``titan``: each one forward+backward)
    and its figures; :func:`measure` times them. ``weights``: :func:`layer_weights` (copied, so
    cases do not share a router; drawn here when None)."""
    device, dtype = torch.device(args.device), DTYPES[args.dtype]

    def randn(*shape, requires_grad=False):
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=requires_grad)

    weights = layer_weights(args) if weights is None else weights
    with torch.device("meta"):
        layer = MoELayer(
            d_model=args.d_model,
            d_ff=args.d_ff,
            num_experts=args.experts,
            top_k=args.top_k,
            capacity_factor=capacity_factor,
            min_capacity=1,
            aux_loss_coef=1e-2,
        )
    layer.load_state_dict({key: value.clone() for key, value in weights.items()}, assign=True)
    torch.manual_seed(0)
    x = randn(args.tokens, args.d_model)
    if skewed:
        x = x + 0.5 * randn(args.d_model)  # a shared direction the router can key on
        share = skew_router(layer, x, hot_experts=2, target_share=0.5)
    else:
        share = float((layer.router(x).expert_ids_TK < 2).float().mean())
    x.requires_grad_(True)
    layer(x)
    rows = int(layer.last_stats.kept_per_expert.sum())
    capacity = layer.last_stats.capacity
    grad_out = randn(args.tokens, args.d_model)

    floor_x = randn(rows, args.d_model, requires_grad=True)
    floor_w1 = randn(args.d_model, args.d_ff, requires_grad=True)
    floor_w2 = randn(args.d_ff, args.d_model, requires_grad=True)
    floor_grad = randn(rows, args.d_model)
    plain_weights = [
        p.detach().clone().requires_grad_(True)
        for p in (layer.router.weight, layer.experts.w1_EDF, layer.experts.w2_EFD)
    ]

    def ours():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x).backward(grad_out)

    def floor():
        F.gelu(floor_x @ floor_w1).matmul(floor_w2).backward(floor_grad)
        floor_x.grad = floor_w1.grad = floor_w2.grad = None

    def reference(moe):  # a reference MoE's forward + backward on the layer's weights (copies)
        def run():
            x.grad = None
            for p in plain_weights:
                p.grad = None
            moe(x, *plain_weights, args.top_k, capacity).backward(grad_out)

        return run

    return {
        "case": name,
        "candidates": {
            "ours": ours,
            "floor": floor,
            "plain": reference(plain_pytorch_moe),
            "titan": reference(titan_style_moe),
        },
        "rows": rows,
        "capacity": capacity,
        "share": share,
    }


def measure(cases: list[dict], args) -> list[dict]:
    """Warms every candidate of every case up (``args.warmup`` calls each) before timing any, then
    runs ``args.repeats`` rounds, each timing every candidate of every case once, in turn: so the
    first case is not timed on a colder machine than the others, and drift in the machine's speed
    hits all cases and candidates alike."""
    timer = timed_cuda if args.device == "cuda" else timed
    for case in cases:
        for fn in case["candidates"].values():
            timer(fn, args.warmup)
    for case in cases:
        case["samples"] = {key: [] for key in case["candidates"]}
    for _ in range(args.repeats):
        for case in cases:
            for key, fn in case["candidates"].items():
                case["samples"][key] += timer(fn, 1)
    results = [case_figures(case, args) for case in cases]
    if args.device == "cuda":
        for case, figures in zip(cases, results, strict=True):
            candidates = case["candidates"]
            figures["host_syncs"] = {key: host_synchronizations(candidates[key]) for key in ("ours", "titan")}
            figures["host_ms"] = {key: host_ms(candidates[key]) for key in ("ours", "titan")}
    return results


def case_figures(case: dict, args) -> dict:
    samples, rows = case["samples"], case["rows"]
    median_ms = {key: 1e3 * statistics.median(v) for key, v in samples.items()}
    flops = 3 * 2 * 2 * rows * args.d_model * args.d_ff  # fwd + 2x bwd, two GEMMs, 2 flop per MAC
    if args.device == "cuda":
        peak = peak_tflops(args.dtype)
        tflops = flops / median_ms["ours"] / 1e9
        gpu_figures = {
            "ours_tflops": round(tflops, 1),
            "of_peak": "unknown" if peak is None else f"{100 * tflops / peak:.0f}%",
        }
    else:
        gpu_figures = {}
    return {
        "case": case["case"],
        "routed_rows": rows,
        "capacity": case["capacity"],
        "hot2_share": round(case["share"], 3),
        "ours_ms": round(median_ms["ours"], 2),
        "floor_ms": round(median_ms["floor"], 2),
        "plain_ms": round(median_ms["plain"], 2),
        "titan_ms": round(median_ms["titan"], 2),
        # Ratios are the median of the per-round ratios: the three candidates of a round run back
        # to back, so slow drifts of this machine's speed cancel within a round.
        "ours_over_floor": round(_median_ratio(samples["ours"], samples["floor"]), 3),
        "plain_over_ours": round(_median_ratio(samples["plain"], samples["ours"]), 3),
        "titan_over_ours": round(_median_ratio(samples["titan"], samples["ours"]), 3),
        "ours_gflops": round(flops / median_ms["ours"] / 1e6, 1),
        **gpu_figures,
    }


def peak_tflops(dtype_name: str) -> float | None:
    """Dense bf16/fp16 peak of the current GPU from PEAK_TFLOPS_16BIT; None if not listed (or fp32)."""
    if dtype_name == "fp32":
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_TFLOPS_16BIT if key in name), None)


def kernel_bandwidth(args) -> dict:
    """Achieved bandwidth of the permutation kernels at the layer's shape (dropless, uniform
    random top-k routing) and of a large ``tensor.copy_`` (the device's practical limit). Bytes are
    what each kernel must move: rows read once and written once (index and weight reads, <1%, not
    counted). Median of ``args.repeats`` CUDA-event timings after ``args.warmup`` calls."""
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    tokens, hidden, k = args.tokens, args.d_model, args.top_k
    generator = torch.Generator(device=device).manual_seed(0)
    expert_ids_TK = (
        torch.rand(tokens, args.experts, device=device, generator=generator).topk(k, dim=-1).indices
    )
    plan = build_dispatch_plan(expert_ids_TK, args.experts, None)
    rows = plan.num_rows
    x_TD = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=generator)
    y_ND = torch.randn(rows, hidden, device=device, dtype=dtype, generator=generator)
    weight_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    gates_TK = torch.rand(tokens, k, device=device, dtype=weight_dtype, generator=generator)
    kernels = torch.ops.moetrain  # the custom kernels (CUDA kernels for CUDA tensors)
    sizes_AB = plan.kept_per_expert_E.view(1, -1).expand(2, -1).contiguous() // 2  # [2 ranks][E experts]
    sizes_AB[0] += plan.kept_per_expert_E - sizes_AB.sum(0)
    row_bytes = hidden * x_TD.element_size()
    copy_src = torch.empty(1 << 30, dtype=torch.uint8, device=device)  # 1 GiB, well past L2
    copy_dst = torch.empty_like(copy_src)
    cases = {
        "permute_rows (dispatch)": (
            lambda: kernels.permute_rows(x_TD, plan.slot_of_row_N, k, None),
            2 * rows * row_bytes,
        ),
        "unpermute_rows weighted (combine)": (
            lambda: kernels.unpermute_rows(y_ND, plan.row_of_slot_TK, gates_TK),
            (rows + tokens) * row_bytes,
        ),
        "permute_rows weighted (combine bwd)": (
            lambda: kernels.permute_rows(x_TD, plan.slot_of_row_N, k, gates_TK.view(-1)),
            2 * rows * row_bytes,
        ),
        "unpermute_rows (dispatch bwd)": (
            lambda: kernels.unpermute_rows(y_ND, plan.row_of_slot_TK, None),
            (rows + tokens) * row_bytes,
        ),
        "unpermute_weight_grad (gates bwd)": (
            lambda: kernels.unpermute_weight_grad(x_TD, y_ND, plan.row_of_slot_TK),
            (rows + tokens) * row_bytes,
        ),
        "transpose_chunks (EP regroup)": (
            lambda: transpose_chunks(y_ND, sizes_AB, "custom"),
            2 * rows * row_bytes,
        ),
        "torch copy_ (1 GiB)": (lambda: copy_dst.copy_(copy_src), 2 * copy_src.numel()),
    }
    results = {}
    for name, (fn, nbytes) in cases.items():
        timed_cuda(fn, args.warmup)
        seconds = statistics.median(timed_cuda(fn, args.repeats))
        results[name] = {"ms": round(1e3 * seconds, 3), "gb_per_s": round(nbytes / seconds / 1e9, 1)}
    copy_gbs = results["torch copy_ (1 GiB)"]["gb_per_s"]
    for figures in results.values():
        figures["of_copy"] = round(figures["gb_per_s"] / copy_gbs, 3)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=sorted(DEFAULT_SHAPES), default="cpu")
    parser.add_argument(
        "--dtype", choices=list(DTYPES), help="of layer, floor and inputs; default fp32 on cpu, bf16 on cuda"
    )
    parser.add_argument("--tokens", type=positive_int, help="default 2048 on cpu, 16384 on cuda")
    parser.add_argument("--d-model", type=positive_int, help="default 512 on cpu, 4096 on cuda")
    parser.add_argument("--d-ff", type=positive_int, help="default 2048 on cpu, 14336 on cuda")
    parser.add_argument("--experts", type=positive_int, default=8)
    parser.add_argument("--top-k", type=positive_int, default=2)
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--repeats", type=positive_int, default=15)
    parser.add_argument(
        "--warmup", type=nonnegative_int, default=10, help="calls of every candidate before any is timed"
    )
    parser.add_argument("--json", metavar="PATH", type=output_path, help="write the figures as JSON to PATH")
    args = parser.parse_args()
    if args.top_k > args.experts:
        parser.error(f"argument --top-k: must be <= --experts ({args.experts}), got {args.top_k}")
    for name, default in zip(("tokens", "d_model", "d_ff"), DEFAULT_SHAPES[args.device], strict=True):
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.dtype is None:
        args.dtype = "bf16" if args.device == "cuda" else "fp32"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a GPU, but torch.cuda.is_available() is False")
    torch.set_num_threads(args.threads)

    cases = [
        ("capacity_1.0", 1.0, False),
        ("dropless_balanced", None, False),
        ("dropless_skewed", None, True),
    ]
    weights = layer_weights(args)
    built = [build_case(name, cf, skewed, args, weights) for name, cf, skewed in cases]
    del weights
    results = measure(built, args)
    machine = {
        "cpu": platform.processor() or platform.machine(),
        "threads": args.threads,
        "simd": ops.simd_level(),
        "torch": torch.__version__,
    }
    if args.device == "cuda":
        kernels = kernel_bandwidth(args)
        # which expert-GEMM path each measured shape class took (the per-expert one reads the row
        # counts on the host every call) and whether the grouped backward skips its host check
        paths = {" ".join(map(str, key)): path for key, path in expert_path.CHOOSER.choices.items()}
        empty_zero = grouped_mm.empty_groups_come_out_zero(torch.device("cuda", torch.cuda.current_device()))
        peak = peak_tflops(args.dtype)
        machine.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda, peak_tflops=peak)
        where = f"{torch.cuda.get_device_name()}, CUDA events"
    else:
        kernels = None
        where = f"{args.threads} threads"
    header = (
        f"MoELayer fwd+bwd, T={args.tokens} d_model={args.d_model} d_ff={args.d_ff} E={args.experts} "
        f"top-{args.top_k} {args.dtype}, {where}, median of {args.repeats}"
    )
    print(header)
    columns = [
        "case",
        "routed_rows",
        "hot2_share",
        "ours_ms",
        "floor_ms",
        "plain_ms",
        "ours_over_floor",
        "plain_over_ours",
        "titan_over_ours",
    ]
    if args.device == "cuda":
        columns += ["ours_tflops", "of_peak"]
    print(" | ".join(f"{c:>17}" for c in columns))
    for row in results:
        print(" | ".join(f"{row[c]!s:>17}" for c in columns))
    if args.device == "cuda":
        print(f"peak dense {args.dtype}: {'unknown' if peak is None else f'{peak:.0f} TFLOP/s'}")
        print("target: ours_over_floor <= 1.10 (8 experts) / <= 1.40 (64 fine-grained), titan_over_ours > 1")
        print(f"{'kernel':>36} | {'ms':>8} | {'GB/s':>8} | {'of copy_':>8}")
        for name, figures in kernels.items():
            share = f"{100 * figures['of_copy']:.0f}%"
            print(f"{name:>36} | {figures['ms']:>8} | {figures['gb_per_s']:>8} | {share:>8}")
        print("target: every permutation kernel >= 70% of the copy_ bandwidth")
        for shape, path in paths.items():
            print(f"expert GEMMs, shape class {shape}: {path}")
        print(f"grouped GEMM writes zeros for empty experts (no host sync in its backward): {empty_zero}")
        for row in results:
            print(
                f"host time per call, {row['case']}: "
                + ", ".join(f"{k} {v} ms" for k, v in row["host_ms"].items())
            )
            for key, places in row["host_syncs"].items():
                where = " ".join(places)
                print(f"host synchronizations per call, {row['case']}, {key}: {len(places)} {where}")
    else:
        print("target: ours_over_floor <= 1.05 in every case")
    if args.json:
        report = {"benchmark": "moe_layer", "config": vars(args), "machine": machine, "results": results}
        if kernels is not None:
            report["kernels"] = kernels
            report["expert_paths"] = paths
            report["empty_groups_zero"] = empty_zero
        write_json(args.json, report)


if __name__ == "__main__":
    main()
