// Layout transforms around the all-to-all exchanges (CUDA). Same ops, arguments and results as
// csrc/a2a_layout.cpp, for CUDA tensors:
//
// transpose_chunks_cuda(x, sizes_AB): the rows of x form an A x B matrix of chunks stored row-major
// ([a][b], chunk (a, b) has sizes[a][b] rows); the output stores the same chunks column-major
// ([b][a]). sizes may live on the CPU or on x's GPU; the chunk offsets are computed on the device
// by one single-block scan kernel:
//   src_off[c] = sum of sizes before chunk c in [a][b] order    (c = a*B + b, src_off[A*B] = rows)
//   dst_off[c] = sum of sizes before chunk c in [b][a] order
// and one kernel moves the rows: warp per source row r, which finds its chunk c by binary search
// (the last c with src_off[c] <= r) and copies the row to dst_off[c] + r - src_off[c], in 16-byte
// packets when the row size and pointers allow it (any dtype: rows are moved as bytes).
// CPU sizes are validated on the host with the CPU op's errors; CUDA sizes are validated by the
// scan kernel (device-side asserts: 0 <= size <= rows, sum == rows), so no call waits for the device.
//
// pack_scaled_fp16_cuda / unpack_scaled_fp16_cuda: fp16 wire format for fp32/fp64 rows that cannot
// overflow: row r is divided by 2^e_r, e_r = max(ceil(log2(max|x_r|)) - 15, kMinExponent) (0 for
// rows whose max is 0 or inf), and sent as D fp16 values followed by e_r in one 16-bit slot
// ([N, D + 1] int16). Warp per row: a warp-wide max (NaN ignored, like the CPU loop), then the
// scaled fp16 values. The exponent rule (exact, from frexp) and the element arithmetic (double
// product, round to fp32, round to fp16) are the CPU op's, so the packed values equal the CPU's bit
// for bit, except NaN payloads (CUDA's canonical fp16 NaN is 0x7fff, the CPU's 0x7e00).
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <cuda_fp16.h>

#include <cmath>

#include "arg_checks.h"
#include "cuda_utils.cuh"

namespace moetrain {
namespace {

using cuda::kWarpsPerBlock;
using cuda::kWarpSize;

constexpr int kScanThreads = 256;

// ------------------------------------------------------------------------------------------------
// transpose_chunks
// ------------------------------------------------------------------------------------------------

// One block of kScanThreads threads. Pass 0 scans the chunks in [a][b] order into src_off, pass 1
// in [b][a] order into dst_off (both indexed by c = a*B + b). Each thread sums a contiguous run of
// the scan order, the block scans those run totals in shared memory, then each thread writes its run.
__global__ void __launch_bounds__(kScanThreads)
    chunk_offsets_kernel(const int64_t* __restrict__ sizes, int64_t a_count, int64_t b_count, int64_t rows,
                         int64_t* __restrict__ src_off, int64_t* __restrict__ dst_off) {
  __shared__ int64_t run_total[kScanThreads];
  const int64_t chunks = a_count * b_count;
  const int64_t per_thread = (chunks + kScanThreads - 1) / kScanThreads;
  const int64_t begin = min(chunks, static_cast<int64_t>(threadIdx.x) * per_thread);
  const int64_t end = min(chunks, begin + per_thread);
  for (int pass = 0; pass < 2; ++pass) {
    // Position q of the scan order -> chunk c: [a][b] order is q = c; [b][a] order is q = b*A + a.
    auto chunk_at = [&](int64_t q) { return pass == 0 ? q : (q % a_count) * b_count + q / a_count; };
    int64_t local = 0;
    for (int64_t q = begin; q < end; ++q) {
      const int64_t size = sizes[chunk_at(q)];
      // size <= rows: the sums cannot wrap around to rows unless chunks * rows >= 2^63
      CUDA_KERNEL_ASSERT_MSG(size >= 0 && size <= rows, "transpose_chunks_cuda: sizes must be in [0, rows of x]");
      local += size;
    }
    run_total[threadIdx.x] = local;
    __syncthreads();
    for (int offset = 1; offset < kScanThreads; offset *= 2) {  // inclusive Hillis-Steele scan
      const int64_t add = threadIdx.x >= offset ? run_total[threadIdx.x - offset] : 0;
      __syncthreads();
      run_total[threadIdx.x] += add;
      __syncthreads();
    }
    int64_t running = run_total[threadIdx.x] - local;  // exclusive prefix of this thread's run
    int64_t* off = pass == 0 ? src_off : dst_off;
    for (int64_t q = begin; q < end; ++q) {
      const int64_t c = chunk_at(q);
      off[c] = running;
      running += sizes[c];
    }
    if (threadIdx.x == kScanThreads - 1) {
      CUDA_KERNEL_ASSERT_MSG(run_total[threadIdx.x] == rows, "transpose_chunks_cuda: sizes must sum to the rows of x");
      if (pass == 0) src_off[chunks] = run_total[threadIdx.x];
    }
    __syncthreads();  // run_total is reused by the next pass
  }
}

// Warp per source row r: chunk c = the last chunk with src_off[c] <= r (empty chunks share their
// start with the next chunk, so the last such c is the non-empty one holding r).
template <typename V>
__global__ void __launch_bounds__(cuda::kThreads)
    transpose_chunks_kernel(const V* __restrict__ x, V* __restrict__ out, const int64_t* __restrict__ src_off,
                            const int64_t* __restrict__ dst_off, int64_t chunks, int64_t rows, int64_t ppr) {
  constexpr int kUnroll = 4;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize; r < rows;
       r += warps) {
    int64_t lo = 0, hi = chunks - 1;  // invariant: src_off[lo] <= r
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (src_off[mid] <= r) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    const V* src = x + r * ppr;
    V* dst = out + (dst_off[lo] + r - src_off[lo]) * ppr;
    for (int64_t i0 = lane; i0 < ppr; i0 += kWarpSize * kUnroll) {
      V p[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (i0 + u * kWarpSize < ppr) p[u] = src[i0 + u * kWarpSize];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (i0 + u * kWarpSize < ppr) dst[i0 + u * kWarpSize] = p[u];
      }
    }
  }
}

template <typename V>
void launch_transpose(const at::Tensor& x, at::Tensor& out, const int64_t* src_off, const int64_t* dst_off,
                      int64_t chunks, int64_t rows, int64_t row_bytes) {
  const auto kernel = transpose_chunks_kernel<V>;
  const dim3 grid(static_cast<unsigned>(cuda::row_grid(kernel, rows)));
  kernel<<<grid, cuda::kThreads, 0, cuda::current_stream()>>>(
      static_cast<const V*>(x.data_ptr()), static_cast<V*>(out.data_ptr()), src_off, dst_off, chunks, rows,
      row_bytes / static_cast<int64_t>(sizeof(V)));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ------------------------------------------------------------------------------------------------
// pack_scaled_fp16 / unpack_scaled_fp16
// ------------------------------------------------------------------------------------------------

// ceil(log2(amax)) - 15 for finite amax > 0, else 0; exact (frexp: amax = m * 2^p, m in [0.5, 1)).
// At least kMinExponent, so 2^-e stays finite for tiny fp64 rows (their smallest values then become
// fp16 subnormals or zeros: csrc/a2a_layout.cpp).
constexpr int kMinExponent = -1000;

template <typename scalar_t>
__device__ __forceinline__ int row_exponent(scalar_t amax) {
  if (!(amax > 0) || isinf(amax)) return 0;
  int p = 0;
  const scalar_t m = frexp(amax, &p);
  return max((m == scalar_t(0.5) ? p - 1 : p) - 15, kMinExponent);
}

// Warp per row r: amax over the row, then packed[r, i] = fp16(fp32(x[r, i] * 2^-e)), packed[r, D] = e.
template <typename scalar_t, int VEC>
__global__ void __launch_bounds__(cuda::kThreads)
    pack_scaled_fp16_kernel(const scalar_t* __restrict__ x, int16_t* __restrict__ packed, int64_t rows,
                            int64_t hidden) {
  using P = cuda::Packet<scalar_t, VEC>;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t ppr = hidden / VEC;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize; r < rows;
       r += warps) {
    const P* src = reinterpret_cast<const P*>(x + r * hidden);
    scalar_t amax = 0;
    for (int64_t i = lane; i < ppr; i += kWarpSize) {
      const P p = src[i];
#pragma unroll
      for (int e = 0; e < VEC; ++e) amax = cuda::max_ignoring_nan(amax, static_cast<scalar_t>(fabs(p.v[e])));
    }
    amax = cuda::warp_max(amax);
    const int exponent = row_exponent(amax);
    const double inv_scale = ldexp(1.0, -exponent);
    int16_t* dst = packed + r * (hidden + 1);
    for (int64_t i = lane; i < ppr; i += kWarpSize) {  // second read of the row: from L1/L2
      const P p = src[i];
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float scaled = static_cast<float>(static_cast<double>(p.v[e]) * inv_scale);
        dst[i * VEC + e] = __half_as_short(__float2half_rn(scaled));
      }
    }
    if (lane == 0) dst[hidden] = static_cast<int16_t>(exponent);
  }
}

// Warp per row r: x[r, i] = float(packed[r, i]) * 2^packed[r, D], formed in double like the CPU op.
template <typename scalar_t>
__global__ void __launch_bounds__(cuda::kThreads)
    unpack_scaled_fp16_kernel(const int16_t* __restrict__ packed, scalar_t* __restrict__ x, int64_t rows,
                              int64_t hidden) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize; r < rows;
       r += warps) {
    const int16_t* src = packed + r * (hidden + 1);
    const double scale = ldexp(1.0, static_cast<int>(src[hidden]));
    scalar_t* dst = x + r * hidden;
#pragma unroll 4
    for (int64_t i = lane; i < hidden; i += kWarpSize) {
      const float value = __half2float(__short_as_half(src[i]));
      dst[i] = static_cast<scalar_t>(static_cast<double>(value) * scale);
    }
  }
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// Ops.
// ------------------------------------------------------------------------------------------------

at::Tensor transpose_chunks_cuda(const at::Tensor& x, const at::Tensor& sizes_AB) {
  checks::chunk_layout(x, sizes_AB, c10::kCUDA);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0);
  const int64_t row_bytes = rows == 0 ? 0 : static_cast<int64_t>(x.nbytes()) / rows;
  const int64_t a_count = sizes_AB.size(0), b_count = sizes_AB.size(1);
  const int64_t chunks = a_count * b_count;
  at::Tensor sizes = sizes_AB.contiguous();
  if (sizes.is_cpu() || chunks == 0) checks::chunk_sizes(sizes, rows);
  if (sizes.is_cpu()) sizes = sizes.to(x.device(), /*non_blocking=*/false);
  at::Tensor out = at::empty_like(x);
  if (chunks == 0) return out;
  // offsets = [src_off (chunks + 1) | dst_off (chunks)]
  at::Tensor offsets = at::empty({2 * chunks + 1}, sizes.options());
  int64_t* src_off = offsets.data_ptr<int64_t>();
  int64_t* dst_off = src_off + chunks + 1;
  chunk_offsets_kernel<<<1, kScanThreads, 0, cuda::current_stream()>>>(sizes.data_ptr<int64_t>(), a_count, b_count,
                                                                      rows, src_off, dst_off);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (rows == 0 || row_bytes == 0) return out;
  // Widest packet that divides the row and keeps every row aligned.
  const auto aligned = [&](int64_t bytes) {
    const auto fits = [&](const void* p) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; };
    return row_bytes % bytes == 0 && fits(x.data_ptr()) && fits(out.data_ptr());
  };
  if (aligned(16)) {
    launch_transpose<uint4>(x, out, src_off, dst_off, chunks, rows, row_bytes);
  } else if (aligned(8)) {
    launch_transpose<uint2>(x, out, src_off, dst_off, chunks, rows, row_bytes);
  } else if (aligned(4)) {
    launch_transpose<uint32_t>(x, out, src_off, dst_off, chunks, rows, row_bytes);
  } else if (aligned(2)) {
    launch_transpose<uint16_t>(x, out, src_off, dst_off, chunks, rows, row_bytes);
  } else {
    launch_transpose<uint8_t>(x, out, src_off, dst_off, chunks, rows, row_bytes);
  }
  return out;
}

at::Tensor pack_scaled_fp16_cuda(const at::Tensor& x_ND) {
  checks::scaled_fp16_rows(x_ND, c10::kCUDA);
  const c10::cuda::CUDAGuard guard(x_ND.device());
  const int64_t rows = x_ND.size(0), hidden = x_ND.size(1);
  at::Tensor packed = at::empty({rows, hidden + 1}, x_ND.options().dtype(at::kShort));
  if (rows == 0) return packed;
  AT_DISPATCH_FLOATING_TYPES(x_ND.scalar_type(), "pack_scaled_fp16_cuda", [&] {
    const scalar_t* src = x_ND.data_ptr<scalar_t>();
    const auto kernel = hidden % cuda::kVec16<scalar_t> == 0 && cuda::aligned16(src)
                            ? pack_scaled_fp16_kernel<scalar_t, cuda::kVec16<scalar_t>>
                            : pack_scaled_fp16_kernel<scalar_t, 1>;
    const dim3 grid(static_cast<unsigned>(cuda::row_grid(kernel, rows)));
    kernel<<<grid, cuda::kThreads, 0, cuda::current_stream()>>>(src, packed.data_ptr<int16_t>(), rows, hidden);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return packed;
}

at::Tensor unpack_scaled_fp16_cuda(const at::Tensor& packed, c10::ScalarType dtype) {
  checks::scaled_fp16_packed(packed, dtype, c10::kCUDA);
  const c10::cuda::CUDAGuard guard(packed.device());
  const int64_t rows = packed.size(0), hidden = packed.size(1) - 1;
  at::Tensor x = at::empty({rows, hidden}, packed.options().dtype(dtype));
  if (rows == 0) return x;
  AT_DISPATCH_FLOATING_TYPES(dtype, "unpack_scaled_fp16_cuda", [&] {
    const auto kernel = unpack_scaled_fp16_kernel<scalar_t>;
    const dim3 grid(static_cast<unsigned>(cuda::row_grid(kernel, rows)));
    kernel<<<grid, cuda::kThreads, 0, cuda::current_stream()>>>(packed.data_ptr<int16_t>(), x.data_ptr<scalar_t>(),
                                                                 rows, hidden);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return x;
}

}  // namespace moetrain
