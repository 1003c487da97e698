"""The GPU path: CUDA kernels (csrc/permute_cuda.cu, csrc/a2a_layout_cuda.cu, the CUDA implementations of
``torch.ops.moetrain.*``) against the plain-PyTorch references, the CPU ops and the torch-native
twins, the start-up check on a real GPU, and MoELayer on CUDA against MoELayer on the CPU.

Tests marked ``needs_cuda`` skip when no GPU is visible (no GPU has run them in this project's CI:
see docs/gpu.md); the build check runs everywhere.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moetrain import MoELayer, _ext
from moetrain._ext import ops
from moetrain.comm.all_to_all import transpose_chunks
from moetrain.comm.compression import decode_rows, encode_rows
from moetrain.kernels import DEVICE_OPS, KernelVerifier
from moetrain.layers.dispatch import (
    build_dispatch_plan,
    permute_tokens,
    token_priority_order,
    unpermute_tokens,
)
from tests.helpers.reference import (
    PERMUTE_SHAPES,
    reference_dispatch_plan,
    reference_permute,
    reference_transpose_chunks,
    reference_unpermute,
    scaled_fp16_inputs,
)

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device (torch.cuda.is_available() is False)")

# The CPU kernels' shapes (empty experts, T < E, capacity cuts, T = 0, odd hidden sizes for the
# element-wise path) plus larger multiples of 8 for the 16-byte packet path;
# k = 10 takes unpermute_weight_grad_kernel's choices in two groups.
SHAPES = [*PERMUTE_SHAPES, (300, 2, 8, 256, 70), (129, 6, 16, 1032, None), (33, 10, 12, 264, 20)]
FULL = [torch.float32, torch.float64]
REDUCED = [torch.bfloat16, torch.float16]
TOL = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.float64: {"rtol": 1e-12, "atol": 1e-12},
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2},
    torch.float16: {"rtol": 2e-3, "atol": 2e-3},
}


def _random_routing(tokens, k, experts, generator):
    """Distinct experts per token, skewed so some experts get nothing."""
    scores = torch.rand(tokens, experts, generator=generator) ** 3
    return scores.topk(k, dim=-1).indices


def _plan_fields(plan):
    return (plan.row_of_slot_TK, plan.slot_of_row_N, plan.kept_per_expert_E, plan.routed_per_expert_E)


# ------------------------------------------------------------------------------------------------
# Runs everywhere.
# ------------------------------------------------------------------------------------------------


def test_extension_has_cuda_kernels_exactly_when_torch_has_a_gpu_build():
    """A CUDA torch builds the .cu sources (setup.py), so its extension must have the CUDA kernels."""
    if torch.version.cuda is None:
        pytest.skip("CPU-only torch: the extension is built without CUDA kernels")
    assert _ext.HAS_CUDA_KERNELS, "moetrain._C lacks its CUDA kernels; was it built where nvcc was not found?"


# ------------------------------------------------------------------------------------------------
# GPU only.
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def cuda_ops():
    """The operators, which run their CUDA kernels for CUDA tensors."""
    if not _ext.HAS_CUDA_KERNELS:
        pytest.fail("a GPU is visible but moetrain._C was built without CUDA kernels: rebuild it")
    return torch.ops.moetrain


@needs_cuda
def test_every_cuda_kernel_passes_the_start_up_check(cuda_ops):
    """The check ``kernels: auto`` runs once per process, here asserted instead of logged."""
    verifier = KernelVerifier()
    for op in DEVICE_OPS:
        assert verifier._problem(op, torch.device("cuda")) is None, op


@needs_cuda
def test_moe_layer_custom_and_torch_kernels_agree_on_cuda(cuda_ops):
    torch.manual_seed(0)
    base = MoELayer(
        d_model=64, d_ff=128, num_experts=8, top_k=2, capacity_factor=1.0, kernels="custom"
    ).cuda()
    other = MoELayer(dataclasses.replace(base.config, kernels="torch")).cuda()
    other.load_state_dict(base.state_dict())
    x = torch.randn(300, 64, device="cuda", requires_grad=True)
    outs = []
    for layer in (base, other):
        out = layer(x)
        grad_x, *grads = torch.autograd.grad(out.square().sum(), [x, *layer.parameters()])
        outs.append([out, grad_x, *grads])
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@needs_cuda
def test_auto_runs_more_than_256_choices_per_token_on_cuda_with_the_twins(cuda_ops):
    """The CUDA unpermute kernels take K <= 256 (kMaxChoices), which ``custom`` hits; ``auto`` gives
    such calls to the twins, forward and backward, and agrees with the CPU."""
    tokens, k, experts, hidden = 6, 300, 320, 16
    g = torch.Generator().manual_seed(3)
    expert_ids = _random_routing(tokens, k, experts, g)
    x = torch.randn(tokens, hidden, generator=g)
    gates = torch.rand(tokens, k, generator=g)
    cuda_plan = build_dispatch_plan(expert_ids.cuda(), experts, None)
    with pytest.raises(RuntimeError, match="at most 256"):
        unpermute_tokens(permute_tokens(x.cuda(), cuda_plan, "custom"), gates.cuda(), cuda_plan, "custom")
    results = []
    for device, plan in (("cuda", cuda_plan), ("cpu", build_dispatch_plan(expert_ids, experts, None))):
        inputs = [x.to(device).requires_grad_(True), gates.to(device).requires_grad_(True)]
        out = unpermute_tokens(permute_tokens(inputs[0], plan, "auto") * 2, inputs[1], plan, "auto")
        results.append([t.cpu() for t in (out, *torch.autograd.grad(out.square().sum(), inputs))])
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@needs_cuda
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("prioritized", [False, True])
def test_cuda_dispatch_plan_matches_reference(shape, prioritized):
    tokens, k, experts, _, capacity = shape
    g = torch.Generator().manual_seed(tokens * 31 + k)
    expert_ids = _random_routing(tokens, k, experts, g)
    order = token_priority_order(tokens, k, torch.rand(tokens, generator=g)) if prioritized else None
    plan = build_dispatch_plan(expert_ids.cuda(), experts, capacity, None if order is None else order.cuda())
    assert plan.slot_of_row_N.is_cuda and plan.row_of_slot_TK.is_cuda
    for got, want in zip(
        _plan_fields(plan), reference_dispatch_plan(expert_ids, experts, capacity, order), strict=True
    ):
        assert torch.equal(got.cpu(), want)


@needs_cuda
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", FULL + REDUCED)
def test_cuda_row_kernels_match_reference(shape, dtype, cuda_ops):
    tokens, k, experts, hidden, capacity = shape
    g = torch.Generator().manual_seed(hidden + 7 * tokens)
    plan = build_dispatch_plan(_random_routing(tokens, k, experts, g), experts, capacity)
    wdtype = torch.float64 if dtype == torch.float64 else torch.float32
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w = torch.rand(tokens, k, generator=g, dtype=wdtype)
    y = torch.randn(plan.num_rows, hidden, generator=g).to(dtype)
    grad = torch.randn(tokens, hidden, generator=g).to(dtype)
    slot_of_row, row_of_slot = plan.slot_of_row_N.cuda(), plan.row_of_slot_TK.cuda()
    wide = torch.float64  # references in fp64, rounded once to the row dtype like the kernels
    tol = TOL[dtype]

    # Unweighted permute is a copy: exact in every dtype.
    got = cuda_ops.permute_rows(x.cuda(), slot_of_row, k, None)
    assert torch.equal(got.cpu(), reference_permute(x, plan.slot_of_row_N, k))
    got = cuda_ops.permute_rows(x.cuda(), slot_of_row, k, w.view(-1).cuda())
    want = reference_permute(x.to(wide), plan.slot_of_row_N, k, w.view(-1).to(wide)).to(dtype)
    torch.testing.assert_close(got.cpu(), want, **tol)
    for weights in (w, None):
        got = cuda_ops.unpermute_rows(y.cuda(), row_of_slot, None if weights is None else weights.cuda())
        want = reference_unpermute(
            y.to(wide), plan.row_of_slot_TK, None if weights is None else weights.to(wide)
        )
        torch.testing.assert_close(got.cpu(), want.to(dtype), **tol)
    got = cuda_ops.unpermute_weight_grad(grad.cuda(), y.cuda(), row_of_slot)
    assert got.dtype == wdtype and got.shape == (tokens, k)
    want = torch.zeros(tokens, k, dtype=wide)
    for t in range(tokens):
        for j, row in enumerate(plan.row_of_slot_TK[t].tolist()):
            if row >= 0:
                want[t, j] = grad[t].to(wide) @ y[row].to(wide)
    dot_tol = TOL[torch.float64] if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-4}
    torch.testing.assert_close(got.cpu().to(wide), want, **dot_tol)


@needs_cuda
@pytest.mark.parametrize("dtype", FULL + REDUCED)
def test_cuda_row_kernels_equal_cpu_ops(dtype, cuda_ops):
    """Same plan, same inputs: the CUDA kernels reproduce the CPU ops (copies bit for bit)."""
    tokens, k, experts, hidden = 500, 2, 8, 512
    g = torch.Generator().manual_seed(3)
    plan = build_dispatch_plan(_random_routing(tokens, k, experts, g), experts, 110)
    wdtype = torch.float64 if dtype == torch.float64 else torch.float32
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    y = torch.randn(plan.num_rows, hidden, generator=g).to(dtype)
    w = torch.rand(tokens, k, generator=g, dtype=wdtype)
    with_zero_rows_N = plan.slot_of_row_N.clone()
    with_zero_rows_N[::3] = -1  # -1: a zero row (the gradient of rows no slot uses)
    calls = [
        ("permute_rows", (x, plan.slot_of_row_N, k, None)),
        ("permute_rows", (x, with_zero_rows_N, k, w.view(-1))),
        ("permute_rows", (x, plan.slot_of_row_N, k, w.view(-1))),
        ("unpermute_rows", (y, plan.row_of_slot_TK, w)),
        ("unpermute_rows", (y, plan.row_of_slot_TK, None)),
        ("unpermute_weight_grad", (x, y, plan.row_of_slot_TK)),
    ]
    for index, (name, args) in enumerate(calls):
        want = getattr(ops, name)(*args)
        got = getattr(cuda_ops, name)(*[a.cuda() if isinstance(a, torch.Tensor) else a for a in args]).cpu()
        if index == 0:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, **TOL[dtype], msg=lambda m, name=name: f"{name}: {m}")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernels_on_misaligned_rows(dtype, cuda_ops):
    """Rows whose storage starts off a 16-byte boundary take the element-wise path, same results."""
    tokens, k, experts, hidden = 37, 2, 4, 64
    g = torch.Generator().manual_seed(4)
    plan = build_dispatch_plan(_random_routing(tokens, k, experts, g), experts, None)
    storage = torch.randn(tokens * hidden + 1, generator=g).to(dtype).cuda()
    x = storage[1:].view(tokens, hidden)  # contiguous, data_ptr 2 or 4 bytes past an aligned one
    assert x.data_ptr() % 16 != 0
    got = cuda_ops.permute_rows(x, plan.slot_of_row_N.cuda(), k, None)
    assert torch.equal(got.cpu(), reference_permute(x.cpu(), plan.slot_of_row_N, k))
    y = torch.randn(plan.num_rows * hidden + 1, generator=g).to(dtype).cuda()[1:].view(plan.num_rows, hidden)
    got = cuda_ops.unpermute_rows(y, plan.row_of_slot_TK.cuda(), None)
    want = reference_unpermute(y.cpu().double(), plan.row_of_slot_TK).to(dtype)
    torch.testing.assert_close(got.cpu(), want, **TOL[dtype])


@needs_cuda
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", FULL + REDUCED)
def test_cuda_autograd_matches_reference_gradients(shape, dtype):
    """permute -> tanh -> weighted unpermute on CUDA in ``dtype`` against the same computation in
    fp64 on the CPU with the references (inputs rounded to ``dtype`` first); values and the
    gradients of x and the gates, each compared relative to its largest entry."""
    tokens, k, experts, hidden, capacity = shape
    g = torch.Generator().manual_seed(3 * hidden + tokens)
    expert_ids = _random_routing(tokens, k, experts, g)
    x0 = torch.randn(tokens, hidden, generator=g).to(dtype)
    gates0 = torch.rand(tokens, k, generator=g)
    upstream = torch.randn(tokens, hidden, generator=g, dtype=torch.float64)

    def run(device, run_dtype, reference):
        plan = build_dispatch_plan(expert_ids.to(device), experts, capacity)
        x = x0.to(device, run_dtype).requires_grad_(True)
        gates_dtype = torch.float64 if run_dtype == torch.float64 else torch.float32
        gates = gates0.to(device, gates_dtype).requires_grad_(True)
        if reference:
            y_ND = torch.tanh(reference_permute(x, plan.slot_of_row_N, k)) * 1.5
            out = reference_unpermute(y_ND, plan.row_of_slot_TK, gates)
        else:
            y_ND = torch.tanh(permute_tokens(x, plan)) * 1.5  # row-wise, non-linear
            out = unpermute_tokens(y_ND, gates, plan)
        anchor = 0.0 * (x.sum() + gates.sum())  # keeps the graph alive when every slot is dropped
        loss = (out.double() * upstream.to(device)).sum() + anchor
        return [t.detach().cpu().double() for t in (out, *torch.autograd.grad(loss, (x, gates)))]

    got = run("cuda", dtype, reference=False)
    want = run("cpu", torch.float64, reference=True)
    tol = TOL[dtype] if dtype in FULL else {"rtol": 0.0, "atol": 4 * TOL[dtype]["atol"]}
    for name, a, b in zip(("out", "grad_x", "grad_gates"), got, want, strict=True):
        scale = b.abs().max().clamp_min(1.0) if b.numel() else 1.0
        torch.testing.assert_close(a / scale, b / scale, **tol, msg=lambda m, name=name: f"{name}: {m}")


@needs_cuda
def test_cuda_gradcheck_fp64():
    tokens, k, experts, hidden, capacity = 17, 2, 4, 31, 3
    g = torch.Generator().manual_seed(1)
    plan = build_dispatch_plan(_random_routing(tokens, k, experts, g).cuda(), experts, capacity)
    x = torch.randn(tokens, hidden, generator=g, dtype=torch.float64).cuda().requires_grad_(True)
    y = torch.randn(plan.num_rows, hidden, generator=g, dtype=torch.float64).cuda().requires_grad_(True)
    gates = torch.rand(tokens, k, generator=g, dtype=torch.float64).cuda().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x_: permute_tokens(x_, plan), (x,))
    assert torch.autograd.gradcheck(lambda y_, g_: unpermute_tokens(y_, g_, plan), (y, gates))


# Each bad call and the error it must raise. They run in child processes: on an H100 with torch
# 2.11 (2026-11-26) four of them crashed the process (SIGSEGV) instead of raising, which would take
# every later test down with it (docs/gpu.md, known defects). The last one is the CPU kernel's
# twin of the third: a control for whether a crash is specific to the CUDA path.
BAD_CUDA_CALLS = [
    ("slot_of_row must be on cuda", "ops.permute_rows(x, torch.tensor([0, 1]), 2, None)"),
    (
        "weights must be Float for Float rows",
        "ops.permute_rows(x, torch.tensor([0, 1], device='cuda'), 2, "
        "torch.ones(8, dtype=torch.float64, device='cuda'))",
    ),
    (
        "weights must have 8 elements",
        "ops.permute_rows(x, torch.tensor([0, 1], device='cuda'), 2, torch.ones(3, device='cuda'))",
    ),
    ("x must be a CUDA tensor", "ops.permute_rows(x.cpu(), torch.tensor([0, 1], device='cuda'), 2, None)"),
    (
        "must be float32, float64, bfloat16 or float16",
        "ops.permute_rows(x.int(), torch.tensor([0], device='cuda'), 1, None)",
    ),
    ("row_of_slot must be 2-D", "ops.unpermute_rows(x, torch.tensor([0, 1], device='cuda'), None)"),
    (
        "grad and y must have the same dtype",
        "ops.unpermute_weight_grad(x, x.double(), torch.zeros(4, 1, dtype=torch.long, device='cuda'))",
    ),
    ("sizes sum to 3 but x has 4 rows", "ops.transpose_chunks(x, torch.tensor([[1, 2]]))"),
    ("sizes must be >= 0", "ops.transpose_chunks(x, torch.tensor([[5, -1]]))"),
    ("x must be float32 or float64", "ops.pack_scaled_fp16(x.half())"),
    (
        "weights must have 8 elements, got 3",
        "ops.permute_rows(x.cpu(), torch.tensor([0, 1]), 2, torch.ones(3))",
    ),
]

# What every bad call runs after: the ops and a CUDA input x.
_BAD_CALL_PREAMBLE = (
    "import torch, moetrain._ext\nops = torch.ops.moetrain\nx = torch.randn(4, 8, device='cuda')\n"
)
# Runs the calls from index argv[1] on, one line per call; a crash ends it after its START line.
_BAD_CALLS_PROGRAM = (
    _BAD_CALL_PREAMBLE
    + """
import json, sys
calls = json.loads(sys.stdin.read())
for index in range(int(sys.argv[1]), len(calls)):
    print('START', index, flush=True)
    try:
        eval(calls[index])
    except Exception as error:
        print('RESULT', index, 'RAISED', type(error).__name__, str(error).splitlines()[0], flush=True)
    else:
        print('RESULT', index, 'NO ERROR', flush=True)
"""
)


def _bad_call_command(first: int) -> list[str]:
    import sys

    return [sys.executable, "-c", _BAD_CALLS_PROGRAM, str(first)]


@pytest.fixture(scope="module")
def bad_call_outcomes() -> dict[int, str]:
    """Index of each BAD_CUDA_CALLS entry -> its child's line for it ("RAISED <type> <message>" or
    "NO ERROR"), with " | then the process crashed (exit N)" when the child died after it, or
    "CRASHED (exit N)" when it died during the call. One child runs every call (CUDA starts once,
    not once per call); after a death a new child goes on from the next call. The first death also
    gets the C++ backtrace of that call alone, from gdb or cuda-gdb where one is installed."""
    import json
    import subprocess

    calls = json.dumps([call for _, call in BAD_CUDA_CALLS])
    outcomes: dict[int, str] = {}
    first, backtrace_taken = 0, False
    while first < len(BAD_CUDA_CALLS):
        done = subprocess.run(
            _bad_call_command(first), input=calls, capture_output=True, text=True, timeout=120
        )
        started = first - 1
        for line in done.stdout.splitlines():
            tag, _, rest = line.partition(" ")
            index, _, result = rest.partition(" ")
            if tag == "START":
                started = int(index)
            elif tag == "RESULT":
                outcomes[int(index)] = result
        if done.returncode == 0:
            break
        if started < first:
            pytest.fail(
                f"the child died before its first call, exit {done.returncode}: {done.stderr[-1500:]}"
            )
        death = f"exit {done.returncode}: {done.stderr[-1500:]}"
        if not backtrace_taken:
            death += _native_backtrace(_bad_call_command(started)[:2] + [_single_call_program(started)])
            backtrace_taken = True
        if started in outcomes:
            outcomes[started] += f" | then the process crashed ({death})"
        else:
            outcomes[started] = f"CRASHED ({death})"
        first = started + 1
    return outcomes


def _single_call_program(index: int) -> str:
    return _BAD_CALL_PREAMBLE + BAD_CUDA_CALLS[index][1]


@needs_cuda
@pytest.mark.parametrize(
    "index", range(len(BAD_CUDA_CALLS)), ids=[f"{i}-{c[0]}" for i, c in enumerate(BAD_CUDA_CALLS)]
)
def test_cuda_kernels_reject_bad_arguments_by_name(cuda_ops, bad_call_outcomes, index):
    expected, call = BAD_CUDA_CALLS[index]
    outcome = bad_call_outcomes[index]
    assert outcome.startswith("RAISED RuntimeError") and expected in outcome, f"{call}: {outcome}"
    assert "then the process crashed" not in outcome, f"{call}: {outcome}"


def _native_backtrace(command: list[str]) -> str:
    """The C++ backtrace of a command that crashes, from gdb or cuda-gdb where one is installed
    (the GPU machines have cuda-gdb, which debugs host code too); empty otherwise."""
    import shutil
    import subprocess

    debugger = shutil.which("gdb") or shutil.which("cuda-gdb")
    if debugger is None:
        return ""
    script = ["-batch", "-ex", "run", "-ex", "bt 25", "--args", *command]
    try:
        done = subprocess.run([debugger, *script], capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        return f"\n{debugger}: timed out"
    frames = [line for line in done.stdout.splitlines() if line.startswith("#")]
    return f"\nbacktrace ({debugger}):\n" + "\n".join(frames[:25])


@needs_cuda
@pytest.mark.parametrize("sizes_on_gpu", [False, True])
@pytest.mark.parametrize(
    "dtype, row_shape",
    [
        (torch.float32, (64,)),
        (torch.bfloat16, (4096,)),
        (torch.float16, (3,)),
        (torch.int64, ()),
        (torch.uint8, (5,)),
        (torch.float64, (2, 3)),
    ],
)
def test_cuda_transpose_chunks_matches_reference_and_inverts(dtype, row_shape, sizes_on_gpu, cuda_ops):
    g = torch.Generator().manual_seed(7)
    for a_count, b_count in [(1, 1), (2, 3), (4, 8), (17, 33)]:
        sizes = torch.randint(0, 5, (a_count, b_count), generator=g)
        sizes[0, 0] = 0  # empty chunks at the edges and in the middle
        sizes[-1, -1] = 0
        rows = int(sizes.sum())
        x = (torch.randn(rows, *row_shape, generator=g).abs() * 100).to(dtype)
        s = sizes.cuda() if sizes_on_gpu else sizes
        got = transpose_chunks(x.cuda(), s)
        assert torch.equal(got.cpu(), reference_transpose_chunks(x, sizes))
        assert torch.equal(got.cpu(), ops.transpose_chunks(x, sizes))
        back = transpose_chunks(got, s.t())
        assert torch.equal(back.cpu(), x)


@needs_cuda
def test_cuda_transpose_chunks_empty(cuda_ops):
    x = torch.empty(0, 16, device="cuda")
    assert transpose_chunks(x, torch.zeros(3, 2, dtype=torch.long)).shape == (0, 16)
    assert transpose_chunks(x, torch.zeros(3, 2, dtype=torch.long, device="cuda")).shape == (0, 16)
    assert transpose_chunks(x, torch.zeros(0, 2, dtype=torch.long)).shape == (0, 16)


@needs_cuda
@pytest.mark.parametrize("dtype", FULL)
@pytest.mark.parametrize("hidden", [40, 7, 0])
def test_cuda_scaled_fp16_equals_cpu_and_round_trips(dtype, hidden, cuda_ops):
    x = scaled_fp16_inputs(dtype)[:, :hidden].contiguous()
    packed_cpu = ops.pack_scaled_fp16(x)
    packed_gpu = cuda_ops.pack_scaled_fp16(x.cuda()).cpu()
    nan_rows = torch.isnan(x).any(1)
    # Bit-equal except NaN payloads (CUDA's canonical fp16 NaN differs from the CPU's).
    assert torch.equal(packed_gpu[~nan_rows], packed_cpu[~nan_rows])
    for out_dtype in FULL:
        got = cuda_ops.unpack_scaled_fp16(packed_gpu.cuda(), out_dtype).cpu()
        want = ops.unpack_scaled_fp16(packed_cpu, out_dtype)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    if hidden:
        # Round trip through encode_rows / decode_rows (the all-to-all wire format) on the GPU:
        # fp16 rounding of x / 2^e, relative 2^-11, plus fp16's subnormal step at the row's scale.
        finite = torch.isfinite(x).all(1)
        back = decode_rows(encode_rows(x.cuda(), "fp16"), "fp16", dtype).cpu()
        row_max = x[finite].abs().amax(1, keepdim=True)
        error = (back[finite] - x[finite]).abs()
        assert bool((error <= 2**-11 * x[finite].abs() + 2**-24 * row_max).all())
        assert torch.isinf(back[4, 5])
        if hidden > 7:
            assert torch.isnan(back[5, 7])


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_moe_layer_on_cuda_equals_moe_layer_on_cpu(dtype, capacity_factor):
    """Same weights, same inputs: outputs and every gradient agree (autocast for bf16/fp16)."""
    torch.manual_seed(0)
    cpu = MoELayer(
        d_model=128, d_ff=256, num_experts=8, top_k=2, capacity_factor=capacity_factor, aux_loss_coef=1e-2
    )
    with torch.no_grad():
        cpu.router.weight.mul_(50)  # clear routing margins: both devices pick the same experts
    gpu = MoELayer(cpu.config).cuda()
    gpu.load_state_dict(cpu.state_dict())
    x = torch.randn(300, 128)
    upstream = torch.randn(300, 128)

    def run(layer, device):
        xd = x.detach().to(device, copy=True).requires_grad_(True)  # a leaf of its own on every device
        autocast = dtype != torch.float32
        with torch.autocast(device, dtype=dtype, enabled=autocast):
            out = layer(xd)
        (out.float() * upstream.to(device)).sum().backward()
        grads = {name: p.grad.detach().cpu().float() for name, p in layer.named_parameters()}
        routing = layer.router(x.to(device)).expert_ids_TK.cpu()
        return out.detach().cpu().float(), xd.grad.cpu().float(), grads, routing, layer.last_stats

    out_c, gx_c, grads_c, ids_c, stats_c = run(cpu, "cpu")
    out_g, gx_g, grads_g, ids_g, stats_g = run(gpu, "cuda")
    assert torch.equal(ids_c, ids_g), "CPU and GPU routed differently; the comparison needs equal routing"
    assert torch.equal(stats_c.kept_per_expert, stats_g.kept_per_expert.cpu())
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 4e-2, "atol": 4e-2}
    torch.testing.assert_close(out_g, out_c, **tol)
    torch.testing.assert_close(gx_g, gx_c, **tol)
    for name in grads_c:
        scale = grads_c[name].abs().max().clamp_min(1e-6)
        torch.testing.assert_close(grads_g[name] / scale, grads_c[name] / scale, **tol, msg=name)


@needs_cuda
@pytest.mark.parametrize("padded", [False, True])
def test_cuda_grouped_gemm_values_and_gradients_match_fp64(padded):
    """``moetrain::grouped_mm`` on CUDA bf16 (torch's grouped GEMM forward, and its 2-D x 2-D form
    for the weight gradient) against fp64 per-expert GEMMs on the CPU: an expert without rows, and
    for a padded plan 7 rows that belong to no expert (zeros out, no gradient)."""
    torch.manual_seed(0)
    counts = torch.tensor([40, 0, 57, 31])
    rows = int(counts.sum()) + (7 if padded else 0)
    x = torch.randn(rows, 64, dtype=torch.float64)
    w = torch.randn(4, 64, 48, dtype=torch.float64) / 8
    upstream = torch.randn(rows, 48, dtype=torch.float64)
    xg, wg = (t.to("cuda", torch.bfloat16).requires_grad_(True) for t in (x, w))
    out = torch.ops.moetrain.grouped_mm(xg, wg, counts.cuda(), False, padded)
    out.backward(upstream.to("cuda", torch.bfloat16))
    offsets = [0, *torch.cumsum(counts, 0).tolist()]
    x_ref = x.detach().clone().requires_grad_(True)
    w_ref = w.detach().clone().requires_grad_(True)
    out_ref = torch.zeros(rows, 48, dtype=torch.float64)
    for e in range(4):
        out_ref[offsets[e] : offsets[e + 1]] = x_ref[offsets[e] : offsets[e + 1]] @ w_ref[e]
    out_ref.backward(upstream)
    tol = {"rtol": 3e-2, "atol": 3e-2}
    torch.testing.assert_close(out.detach().cpu().double(), out_ref.detach(), **tol)
    torch.testing.assert_close(xg.grad.cpu().double(), x_ref.grad, **tol)
    scale = w_ref.grad.abs().max()
    torch.testing.assert_close(wg.grad.cpu().double() / scale, w_ref.grad / scale, **tol)
    assert torch.equal(wg.grad[1].cpu(), torch.zeros(64, 48, dtype=torch.bfloat16))


@needs_cuda
def test_the_empty_group_probe_sees_an_unwritten_block():
    """The probe behind skipping the zeroing of experts without rows: on this GPU, what it says
    must be what the raw kernel does on a real layer-sized call (NaN-filled memory reused)."""
    from moetrain import _torch_compat
    from moetrain.kernels import grouped_mm as grouped_mm_module

    says_zero = grouped_mm_module.empty_groups_come_out_zero(torch.device("cuda"))
    a = torch.randn(4096, 512, dtype=torch.bfloat16, device="cuda")
    offsets = torch.tensor([1000, 1000, 4096, 4096], dtype=torch.int32, device="cuda")
    for _ in range(3):
        torch.full((4, 512, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        out = _torch_compat.grouped_mm(a.t(), a, offsets)
        if says_zero:
            assert bool((out[1] == 0).all()) and bool((out[3] == 0).all())
