"""CPU checks of the all-to-all layout kernels (csrc/a2a_layout.cpp) against the plain-PyTorch
references in tests/helpers/reference.py: ``transpose_chunks`` and its autograd wrapper ``regroup_chunks``,
the scaled-fp16 wire format (``pack_scaled_fp16`` / ``unpack_scaled_fp16``) and the wire codecs
``encode_rows`` / ``decode_rows`` built on it. tests/gpu/test_cuda_kernels.py holds the CUDA twins.
"""

from __future__ import annotations

import math

import pytest
import torch

from moetrain._ext import ops
from moetrain.comm.all_to_all import regroup_chunks, transpose_chunks
from moetrain.comm.compression import decode_rows, encode_rows
from tests.helpers.reference import (
    reference_pack_scaled_fp16,
    reference_scaled_fp16_exponent,
    reference_transpose_chunks,
    reference_unpack_scaled_fp16,
    scaled_fp16_inputs,
)

FULL = [torch.float32, torch.float64]
INF, NAN = float("inf"), float("nan")

# ------------------------------------------------------------------------------------------------
# transpose_chunks / regroup_chunks
# ------------------------------------------------------------------------------------------------

# (A, B): single chunk, one row or column of chunks, square and ragged tables, empty tables.
TABLES = [(1, 1), (1, 6), (6, 1), (3, 4), (8, 8), (17, 5), (0, 4), (4, 0)]


def _chunk_sizes(a_count, b_count, generator):
    """Random [A, B] int64 chunk sizes, a third each empty, 1-row and 2..39-row chunks."""
    kind = torch.randint(0, 3, (a_count, b_count), generator=generator)
    many = torch.randint(2, 40, (a_count, b_count), generator=generator)
    return torch.where(kind == 0, 0, torch.where(kind == 1, 1, many))


def _chunk_tables(seed):
    g = torch.Generator().manual_seed(seed)
    tables = [_chunk_sizes(a, b, g) for a, b in TABLES]
    tables.append(torch.zeros(3, 2, dtype=torch.long))  # every chunk empty
    tables.append(torch.tensor([[0, 1], [37, 0]]))
    flat = torch.cat([t.reshape(-1) for t in tables])
    assert (flat == 0).any() and (flat == 1).any() and (flat > 1).any()
    return tables


def _rows(rows, row_shape, dtype, generator):
    if dtype == torch.uint8:
        return torch.randint(0, 256, (rows, *row_shape), generator=generator, dtype=torch.uint8)
    if dtype == torch.bool:
        return torch.rand(rows, *row_shape, generator=generator) < 0.5
    return (torch.randn(rows, *row_shape, generator=generator, dtype=torch.float64) * 100).to(dtype)


@pytest.mark.parametrize(
    "dtype, row_shape",
    [
        (torch.float32, (16,)),
        (torch.float64, (3,)),
        (torch.bfloat16, (5,)),
        (torch.float16, ()),
        (torch.int64, (1,)),
        (torch.uint8, (2, 3)),
        (torch.bool, (4,)),
        (torch.float32, (0,)),
    ],
)
def test_transpose_chunks_matches_reference_and_inverts(dtype, row_shape):
    g = torch.Generator().manual_seed(1)
    for sizes in _chunk_tables(seed=2):
        x = _rows(int(sizes.sum()), row_shape, dtype, g)
        want = reference_transpose_chunks(x, sizes)
        got = ops.transpose_chunks(x, sizes)
        assert got.dtype == dtype and got.shape == x.shape
        assert torch.equal(got, want), f"sizes {sizes.tolist()}"
        # The inverse is the transpose with sizes^T (a non-contiguous view: the wrapper copies it).
        assert torch.equal(transpose_chunks(got, sizes.t()), x)
        assert torch.equal(transpose_chunks(x, sizes), want)


def test_transpose_chunks_long_chunks_and_non_contiguous_rows():
    """Chunks longer than the kernel's copy grain (64 KiB: 256 rows of 64 fp32), and rows that reach
    the wrapper as a strided view."""
    g = torch.Generator().manual_seed(3)
    sizes = torch.tensor([[700, 3, 0], [1, 513, 256]])
    x = torch.randn(int(sizes.sum()), 64, generator=g)
    assert torch.equal(ops.transpose_chunks(x, sizes), reference_transpose_chunks(x, sizes))
    strided = torch.randn(64, int(sizes.sum()), generator=g).t()
    assert not strided.is_contiguous()
    assert torch.equal(transpose_chunks(strided, sizes), reference_transpose_chunks(strided, sizes))


def test_transpose_chunks_rejects_bad_arguments_by_name():
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="sizes sum to 3 but x has 4 rows"):
        ops.transpose_chunks(x, torch.tensor([[1, 2]]))
    with pytest.raises(RuntimeError, match=r"sizes must be >= 0, got -1 at \[0, 1\]"):
        ops.transpose_chunks(x, torch.tensor([[5, -1]]))
    bad_sizes = r"sizes must be a 2-D int64 tensor \[A, B\] on the CPU or on x's device, got a "
    with pytest.raises(RuntimeError, match=bad_sizes + "2-D Int one on cpu"):
        ops.transpose_chunks(x, torch.tensor([[2, 2]], dtype=torch.int32))
    with pytest.raises(RuntimeError, match=bad_sizes + "1-D Long one"):
        ops.transpose_chunks(x, torch.tensor([2, 2]))
    with pytest.raises(RuntimeError, match="x must be a contiguous CPU tensor"):
        ops.transpose_chunks(x.t(), torch.tensor([[4, 4]]))
    with pytest.raises(RuntimeError, match="x must have a row dimension"):
        ops.transpose_chunks(torch.tensor(1.0), torch.zeros(1, 1, dtype=torch.long))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_regroup_chunks_values_and_gradients_match_reference(dtype):
    """regroup_chunks against the slicing reference under autograd: outputs and input gradients are
    permutations, so they must agree exactly."""
    g = torch.Generator().manual_seed(4)
    for sizes in _chunk_tables(seed=5):
        x0 = _rows(int(sizes.sum()), (6,), dtype, g)
        upstream = _rows(x0.shape[0], (6,), dtype, g)
        results = []
        for fn in (regroup_chunks, reference_transpose_chunks):
            x = x0.clone().requires_grad_(True)
            out = fn(x, sizes)
            (out * upstream).sum().backward()
            results.append((out.detach(), x.grad))
        (out, grad), (want_out, want_grad) = results
        assert torch.equal(out, want_out), f"sizes {sizes.tolist()}"
        assert grad is not None and grad.dtype == dtype
        assert torch.equal(grad, want_grad), f"sizes {sizes.tolist()}"


def test_regroup_chunks_gradcheck_fp64():
    g = torch.Generator().manual_seed(6)
    for sizes in [
        torch.tensor([[0, 1, 3], [2, 0, 1]]),
        _chunk_sizes(3, 2, g),
        torch.zeros(2, 2, dtype=torch.long),
    ]:
        x = torch.randn(int(sizes.sum()), 3, generator=g, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda x_, s=sizes: regroup_chunks(x_, s), (x,))


# ------------------------------------------------------------------------------------------------
# pack_scaled_fp16 / unpack_scaled_fp16
# ------------------------------------------------------------------------------------------------


def _finite_rows(dtype, hidden):
    """The shared finite rows (tests/helpers/reference.py) plus rows spread over the dtype's range, exact
    powers of two and their neighbours, signed zeros, and the values a plain fp16 cast loses."""
    g = torch.Generator().manual_seed(10)
    shared = scaled_fp16_inputs(dtype).double()
    shared = shared[torch.isfinite(shared).all(1)]
    decades = 30 if dtype == torch.float32 else 290
    spread = torch.randn(48, 40, generator=g, dtype=torch.float64)
    spread *= 10.0 ** torch.empty(48, 1, dtype=torch.float64).uniform_(-decades, decades, generator=g)
    special = torch.randn(12, 40, generator=g, dtype=torch.float64)
    special[0] = 2.0**15  # payload 2^15 exactly, exponent 0
    special[1, 0] = 2.0**15 + 2.0**-8  # just above a power of two: exponent 1
    special[2] = -0.0
    special[3, :20] = 0.0
    special[4] = 1e30  # plain fp16 cast: inf
    special[5] = -7e4
    special[6] = 1e-30  # plain fp16 cast: 0
    special[7, 0] = 1e30  # one huge entry: the rest flushes to zero
    special[8, 1] = -7e4
    special[9] = torch.linspace(-1e-30, 3e-30, 40, dtype=torch.float64)
    special[10] *= 1e-36  # fp32: 2^-e is no normal float, the vector path hands the row back
    special[11] *= 1e-40  # fp32 subnormals
    return torch.cat([shared, spread, special])[:, :hidden].to(dtype).contiguous()


def _assert_round_trip_bound(back, x):
    """fp16 rounding of x / 2^e: relative 2^-11 per element, plus half fp16's subnormal step at the
    row's scale (2^-25 * 2^e < 2^-39 * max|row|) for entries far below the row's maximum."""
    x, back = x.double(), back.double()
    row_max = x.abs().amax(1, keepdim=True) if x.shape[1] else x.new_zeros(x.shape[0], 1)
    error = (back - x).abs()
    bound = 2.0**-11 * x.abs() + 2.0**-39 * row_max
    bad = error > bound
    assert not bad.any(), (
        f"{int(bad.sum())} entries off, e.g. x={x[bad][:4].tolist()} back={back[bad][:4].tolist()}"
    )
    assert bool((error <= 2.0**-11 * row_max).all())  # the coarser per-row statement


@pytest.mark.parametrize("dtype", FULL)
@pytest.mark.parametrize("hidden", [40, 7, 1, 0])
def test_pack_scaled_fp16_matches_reference(dtype, hidden, simd_level):
    x = _finite_rows(dtype, hidden)
    packed = ops.pack_scaled_fp16(x)
    assert packed.dtype == torch.int16 and packed.shape == (x.shape[0], hidden + 1)
    want = reference_pack_scaled_fp16(x)
    mismatch = (packed != want).any(1)
    assert not mismatch.any(), f"rows {mismatch.nonzero().view(-1).tolist()}: {packed[mismatch][:2].tolist()}"
    for out_dtype in FULL:
        got = ops.unpack_scaled_fp16(packed, out_dtype)
        assert got.dtype == out_dtype and got.shape == x.shape
        assert torch.equal(got, reference_unpack_scaled_fp16(want, out_dtype))
    _assert_round_trip_bound(ops.unpack_scaled_fp16(packed, dtype), x)


@pytest.mark.parametrize("dtype", FULL)
def test_scaled_fp16_keeps_values_a_plain_fp16_cast_loses(dtype, simd_level):
    x = torch.tensor([[1e30, 2e29, -1e30], [-7e4, 7e4, -65520.0], [1e-30, -1e-30, 3e-30]], dtype=dtype)
    plain = x.to(torch.float16)
    assert torch.isinf(plain[:2]).all() and (plain[2] == 0).all()  # what the scaling is for
    packed = ops.pack_scaled_fp16(x)
    assert packed[:, -1].tolist() == reference_scaled_fp16_exponent(x).tolist() == [85, 2, -113]
    back = ops.unpack_scaled_fp16(packed, dtype)
    assert torch.isfinite(back).all() and (back != 0).all()
    _assert_round_trip_bound(back, x)


def test_scaled_fp16_zero_rows_and_empty_shapes():
    for dtype in FULL:
        assert ops.pack_scaled_fp16(torch.empty(0, 5, dtype=dtype)).shape == (0, 6)
        assert ops.unpack_scaled_fp16(torch.empty(0, 6, dtype=torch.int16), dtype).shape == (0, 5)
        packed = ops.pack_scaled_fp16(torch.zeros(3, 4, dtype=dtype))
        assert torch.equal(packed, torch.zeros(3, 5, dtype=torch.int16))  # +0 payload, exponent 0
        assert torch.equal(
            ops.pack_scaled_fp16(torch.empty(3, 0, dtype=dtype)), torch.zeros(3, 1, dtype=torch.int16)
        )
        back = ops.unpack_scaled_fp16(torch.zeros(3, 1, dtype=torch.int16), dtype)
        assert back.shape == (3, 0) and back.dtype == dtype


def test_scaled_fp16_rows_with_inf_travel_unscaled(simd_level):
    """csrc/a2a_layout.cpp: rows holding inf are sent unscaled (exponent 0, a plain fp16 cast), so
    the non-finite values arrive as they left; finite neighbours get what a plain cast gives."""
    for dtype in FULL:
        x = torch.tensor([[INF, 1e6, 1e-3, -2.0], [1.0, -INF, NAN, 3e-8], [NAN, INF, -INF, 0.5]], dtype=dtype)
        packed = ops.pack_scaled_fp16(x)
        assert packed[:, -1].tolist() == [0, 0, 0]
        plain = x.to(torch.float16)
        for out_dtype in FULL:
            back = ops.unpack_scaled_fp16(packed, out_dtype)
            torch.testing.assert_close(back, plain.to(out_dtype), rtol=0, atol=0, equal_nan=True)
            assert back[0, 0] == INF and back[1, 1] == -INF and back[2, 1] == INF and back[2, 2] == -INF
            assert back[1, 2].isnan() and back[2, 0].isnan()


def test_scaled_fp16_nan_arrives_as_nan(simd_level):
    for dtype in FULL:
        x = torch.tensor([[NAN, 1e6, 1e-3], [1e-30, NAN, -2e-30], [NAN, NAN, NAN]], dtype=dtype)
        back = ops.unpack_scaled_fp16(ops.pack_scaled_fp16(x), dtype)
        assert torch.equal(back.isnan(), x.isnan())
        assert torch.isfinite(back[~x.isnan()]).all()


def test_scaled_fp16_rows_with_nan_are_scaled_by_their_finite_entries(simd_level):
    """The max ignores NaN (csrc/a2a_layout.cpp): the finite entries are packed as in a row without
    the NaN, and the NaN arrives as NaN."""
    for dtype in FULL:
        x = torch.tensor([[NAN, 1e6, 1e-3], [1e-30, NAN, -2e-30]], dtype=dtype).repeat(1, 7)  # 21 wide
        x[0, 11] = 3e7  # the largest finite entry in the vector part, after a NaN lane
        finite = torch.nan_to_num(x, nan=0.0)
        packed = ops.pack_scaled_fp16(x)
        expected = reference_pack_scaled_fp16(finite)
        assert torch.equal(packed[:, -1], expected[:, -1])
        assert torch.equal(packed[:, :-1][~x.isnan()], expected[:, :-1][~x.isnan()])
        back = ops.unpack_scaled_fp16(packed, dtype)
        assert bool(back[x.isnan()].isnan().all())


def test_scaled_fp16_tiny_fp64_rows_flush_to_zero_instead_of_overflowing(simd_level):
    """Below 2^(-1000 + 15) the exponent stops at -1000 (2^1000 is still a finite double): such
    rows come back as zero or within fp16's subnormal step 2^-24 times 2^-1000, never inf / NaN."""
    x = torch.tensor([[1e-310, 0.0, -3e-311], [1e-306, 2e-307, 0.0]], dtype=torch.float64)
    packed = ops.pack_scaled_fp16(x)
    assert torch.equal(packed, reference_pack_scaled_fp16(x))
    assert packed[:, -1].tolist() == [-1000, -1000]
    back = ops.unpack_scaled_fp16(packed, torch.float64)
    assert torch.isfinite(back).all()
    assert bool(((back - x).abs() <= 2.0**-1025).all())


def test_scaled_fp16_fp64_max_just_above_a_power_of_two():
    """max|row| = 2^10 (1 + 2^-52): the exponent is exact (frexp), -4, where a floating-point
    ceil(log2) would round to -5; the payload stays <= 2^15 and the round trip within its bound."""
    x = torch.tensor([[math.nextafter(2.0**10, INF), 1.0, -3.0]], dtype=torch.float64)
    packed = ops.pack_scaled_fp16(x)
    payload = packed[:, :-1].view(torch.float16).double()
    assert int(packed[0, -1]) == -4 and bool((payload.abs() <= 2.0**15).all())
    _assert_round_trip_bound(ops.unpack_scaled_fp16(packed, torch.float64), x)


def test_scaled_fp16_rejects_bad_arguments_by_name():
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="x must be float32 or float64, got Half"):
        ops.pack_scaled_fp16(x.half())
    with pytest.raises(RuntimeError, match="x must be float32 or float64, got BFloat16"):
        ops.pack_scaled_fp16(x.bfloat16())
    with pytest.raises(RuntimeError, match="x must be a contiguous 2-D CPU tensor"):
        ops.pack_scaled_fp16(x.t())
    with pytest.raises(RuntimeError, match="x must be a contiguous 2-D CPU tensor"):
        ops.pack_scaled_fp16(x.view(-1))
    packed = ops.pack_scaled_fp16(x)
    with pytest.raises(RuntimeError, match="dtype must be float32 or float64"):
        ops.unpack_scaled_fp16(packed, torch.float16)
    with pytest.raises(RuntimeError, match="packed must be a contiguous 2-D int16 CPU tensor"):
        ops.unpack_scaled_fp16(packed.int(), torch.float32)
    with pytest.raises(RuntimeError, match="packed must be a contiguous 2-D int16 CPU tensor"):
        ops.unpack_scaled_fp16(torch.empty(4, 0, dtype=torch.int16), torch.float32)


# ------------------------------------------------------------------------------------------------
# encode_rows / decode_rows
# ------------------------------------------------------------------------------------------------

ALL = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _codec_rows(dtype, rows=24, hidden=9):
    g = torch.Generator().manual_seed(12)
    x = torch.randn(rows, hidden, generator=g, dtype=torch.float64)
    x *= 10.0 ** torch.empty(rows, 1, dtype=torch.float64).uniform_(-3, 3, generator=g)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("rows", [24, 0])
def test_codecs_pass_rows_through_when_there_is_nothing_to_convert(dtype, rows):
    x = _codec_rows(dtype, rows)
    same_as_wire = {torch.bfloat16: ["bf16"], torch.float16: ["fp16"]}.get(dtype, [])
    for comm_dtype in [None, *same_as_wire]:
        wire = encode_rows(x, comm_dtype)
        assert wire is x
        assert decode_rows(wire, comm_dtype, dtype) is wire


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("rows", [24, 0])
def test_bf16_wire_is_a_cast(dtype, rows):
    x = _codec_rows(dtype, rows)
    wire = encode_rows(x, "bf16")
    assert wire.dtype == torch.bfloat16 and wire.shape == x.shape
    assert torch.equal(wire.double(), x.double().to(torch.bfloat16).double())
    back = decode_rows(wire, "bf16", dtype)
    assert back.dtype == dtype and back.shape == x.shape
    assert torch.isfinite(back).all()
    # bf16 keeps 8 significant bits: relative error 2^-8; the cast back is exact (fp16 has 11).
    error = (back.double() - x.double()).abs()
    assert bool((error <= 2.0**-8 * x.double().abs()).all())


def test_bf16_wire_keeps_the_largest_fp16_values_finite():
    """bf16 rounds fp16 values above 65408 up to 2^16, past fp16's largest value 65504: they come
    back as +-65504; a real inf stays inf."""
    x = torch.tensor([[65504.0, -65504.0, 65440.0, 65280.0, INF, -INF]], dtype=torch.float16)
    back = decode_rows(encode_rows(x, "bf16"), "bf16", torch.float16)
    assert back.tolist() == [[65504.0, -65504.0, 65504.0, 65280.0, INF, -INF]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("empty", [False, True])
def test_fp16_wire_is_the_scaled_format(dtype, empty):
    x = _bf16_rows() if dtype == torch.bfloat16 else _finite_rows(dtype, hidden=40)
    x = x[:0] if empty else x
    wire = encode_rows(x, "fp16")
    assert wire.dtype == torch.float16 and wire.shape == (x.shape[0], x.shape[1] + 1)
    assert torch.equal(wire.view(torch.int16), reference_pack_scaled_fp16(x))
    back = decode_rows(wire, "fp16", dtype)
    assert back.dtype == dtype and back.shape == x.shape
    if dtype == torch.bfloat16:
        # An fp16 payload holds bf16's 8 significant bits exactly while x / 2^e stays a normal fp16
        # (>= 2^-14, i.e. within 2^-28 of the row's maximum); below that, fp16's subnormal step.
        row_max = x.double().abs().amax(1, keepdim=True)
        normal = x.double().abs() >= 2.0**-28 * row_max
        assert torch.equal(back[normal], x[normal])
        assert bool(
            ((back.double() - x.double()).abs()[~normal] <= 2.0**-36 * row_max.expand_as(x)[~normal]).all()
        )
    else:
        _assert_round_trip_bound(back, x)


def _bf16_rows():
    """bf16 rows: random ones, and the values fp16 cannot hold (1e5, -7e4, 1e-30, near bf16's limits)."""
    x = torch.randn(30, 40, generator=torch.Generator().manual_seed(13), dtype=torch.float64)
    x *= 10.0 ** torch.linspace(-35, 35, 30, dtype=torch.float64).view(-1, 1)
    x[0] = 1e5
    x[1] = -7e4
    x[2] = 1e-30
    x[3, :3] = torch.tensor([1e5, -7e4, 1e-30])  # one row: 1e-30 is far below its maximum
    x[4] = 3e38
    x[5] = 1e-40  # bf16 (fp32) subnormal
    return x.to(torch.bfloat16)


def test_bf16_rows_round_trip_the_fp16_wire_finite_and_exact():
    """compression.py widens bf16 rows to fp32 before packing, so fp16's range does not clip them."""
    x = torch.tensor([[1e5, 1e5], [-7e4, 7e4], [1e-30, -3e-30], [1e5, 1e-30]], dtype=torch.bfloat16)
    plain = x.to(torch.float16)
    assert torch.isinf(plain[:2]).all() and (plain[2] == 0).all()  # what the widening is for
    back = decode_rows(encode_rows(x, "fp16"), "fp16", torch.bfloat16)
    assert back.dtype == torch.bfloat16 and torch.isfinite(back).all()
    assert torch.equal(back[:3], x[:3])
    assert back[3, 0] == x[3, 0] and back[3, 1] == 0  # 2^-116 below its row's maximum: flushed
