// Sort-based token permutation for MoE dispatch and combine (CUDA). Same ops, arguments and
// results as csrc/permute.cpp, for CUDA tensors:
//
// Legend: T tokens, K choices per token, S = T*K routing slots (slot s = t*K + j), N routed rows
// kept after the capacity cut, D hidden size.
//
//   permute_rows_cuda         : out_ND[r] = w[s] * x_TD[s / K],  s = slot_of_row[r] (s = -1: zeros)
//   unpermute_rows_cuda       : out_TD[t] = sum_j w[t,j] * y_ND[row_of_slot[t,j]]  (dropped: skipped)
//   unpermute_weight_grad_cuda: gw_TK[t,j] = <grad_TD[t], y_ND[row_of_slot[t,j]]>   (dropped: 0)
//
// Rows are fp32, fp64, bf16 or fp16; products and sums are formed in fp32 (fp64 for fp64 rows)
// and rounded once on store; the weights are fp32 (fp64 for fp64 rows). Unweighted permutes are
// bit copies. One warp per output row (per token for the two unpermute ops), 16-byte packets where
// the rows allow it, grid-stride loops on the current stream (geometry: cuda_utils.cuh).
//
// The plan's indices are validated inside the kernels (CUDA_KERNEL_ASSERT_MSG naming the argument)
// rather than on the host, which would need a device-to-host copy and a stream sync per call;
// a bad index is a device-side assert, fatal to the CUDA context, as in ATen's own index kernels.
// The plans come from build_dispatch_plan, which validates the expert ids it sorts.
// Precondition, not checked here (it would take a pass over the index per call): the indices are
// distinct, as a plan's are, i.e. no slot >= 0 twice in slot_of_row and no row >= 0 twice in
// row_of_slot. The gradients invert the index, so a repeat gives wrong gradients (the CPU kernels
// and the torch-native twins refuse it).
//
// This file also registers the CUDA kernels of every .cu file as the CUDA implementations of the
// moetrain ops (TORCH_LIBRARY_IMPL; the schemas are in bindings.cpp).
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "arg_checks.h"
#include "cuda_utils.cuh"

namespace moetrain {
namespace {

using cuda::acc_t;
using cuda::kWarpsPerBlock;
using cuda::kWarpSize;
using cuda::Packet;

// Packets a lane has in flight at once in the copy loops (loads issued before the stores).
constexpr int kUnroll = 4;
// Choices per token the unpermute kernels stage in shared memory (per warp).
constexpr int64_t kMaxChoices = 256;

// ------------------------------------------------------------------------------------------------
// Kernels. `ppr` = packets per row = D / VEC.
// ------------------------------------------------------------------------------------------------

// out[r] = w[s] * x[s / k] (kWeighted) or x[s / k] (bit copy), s = slot_of_row[r]; warp per row r.
template <typename scalar_t, int VEC, bool kWeighted>
__global__ void __launch_bounds__(cuda::kThreads)
    permute_rows_kernel(const scalar_t* __restrict__ x, const int64_t* __restrict__ slot_of_row,
                        const acc_t<scalar_t>* __restrict__ w, scalar_t* __restrict__ out, int64_t rows, int64_t ppr,
                        int64_t k, int64_t slots) {
  using P = Packet<scalar_t, VEC>;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize; r < rows;
       r += warps) {
    const int64_t s = slot_of_row[r];
    CUDA_KERNEL_ASSERT_MSG(s >= -1 && s < slots, "permute_rows_cuda: slot_of_row entry outside [-1, tokens * k)");
    P* dst = reinterpret_cast<P*>(out) + r * ppr;
    if (s < 0) {  // no source slot: a zero row (uniform across the warp)
      P zero;
#pragma unroll
      for (int e = 0; e < VEC; ++e) zero.v[e] = scalar_t(0);
      for (int64_t i = lane; i < ppr; i += kWarpSize) dst[i] = zero;
      continue;
    }
    const P* src = reinterpret_cast<const P*>(x) + (s / k) * ppr;
    acc_t<scalar_t> a = 1;
    if constexpr (kWeighted) a = w[s];
    for (int64_t i0 = lane; i0 < ppr; i0 += kWarpSize * kUnroll) {
      P p[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = i0 + u * kWarpSize;
        if (i < ppr) p[u] = src[i];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = i0 + u * kWarpSize;
        if (i >= ppr) continue;
        if constexpr (kWeighted) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            p[u].v[e] = static_cast<scalar_t>(a * static_cast<acc_t<scalar_t>>(p[u].v[e]));
          }
        }
        dst[i] = p[u];
      }
    }
  }
}

// out[t] = sum_j w[t, j] * y[row_of_slot[t, j]] over the kept slots (w = 1 unless kWeighted);
// warp per token t. The token's k rows (and weights) are staged in the warp's shared-memory slice.
template <typename scalar_t, int VEC, bool kWeighted>
__global__ void __launch_bounds__(cuda::kThreads)
    unpermute_rows_kernel(const scalar_t* __restrict__ y, const int64_t* __restrict__ row_of_slot,
                          const acc_t<scalar_t>* __restrict__ w, scalar_t* __restrict__ out, int64_t tokens,
                          int64_t ppr, int64_t k, int64_t y_rows) {
  using acc = acc_t<scalar_t>;
  using P = Packet<scalar_t, VEC>;
  constexpr int kU = 2;  // packets per lane per step: kU * VEC accumulators in registers
  extern __shared__ __align__(16) unsigned char shared[];
  const int warp_in_block = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  int64_t* rows_k = reinterpret_cast<int64_t*>(shared) + warp_in_block * k;
  acc* weights_k = reinterpret_cast<acc*>(shared + sizeof(int64_t) * kWarpsPerBlock * k) + warp_in_block * k;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp_in_block; t < tokens; t += warps) {
    __syncwarp();  // the previous token's reads of rows_k / weights_k are done
    for (int64_t j = lane; j < k; j += kWarpSize) {
      const int64_t row = row_of_slot[t * k + j];
      CUDA_KERNEL_ASSERT_MSG(row >= -1 && row < y_rows, "unpermute_rows_cuda: row_of_slot entry outside [-1, rows of y)");
      rows_k[j] = row;
      weights_k[j] = kWeighted ? w[t * k + j] : acc(1);
    }
    __syncwarp();
    P* dst = reinterpret_cast<P*>(out) + t * ppr;
    for (int64_t i0 = lane; i0 < ppr; i0 += kWarpSize * kU) {
      acc sum[kU][VEC];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) sum[u][e] = acc(0);
      }
      for (int64_t j = 0; j < k; ++j) {
        const int64_t row = rows_k[j];
        if (row < 0) continue;  // dropped slot (uniform across the warp)
        const acc a = weights_k[j];
        const P* src = reinterpret_cast<const P*>(y) + row * ppr;
        P p[kU];
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int64_t i = i0 + u * kWarpSize;
          if (i < ppr) p[u] = src[i];
        }
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          if (i0 + u * kWarpSize >= ppr) continue;
#pragma unroll
          for (int e = 0; e < VEC; ++e) sum[u][e] += a * static_cast<acc>(p[u].v[e]);
        }
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int64_t i = i0 + u * kWarpSize;
        if (i >= ppr) continue;
        P o;
#pragma unroll
        for (int e = 0; e < VEC; ++e) o.v[e] = static_cast<scalar_t>(sum[u][e]);
        dst[i] = o;
      }
    }
  }
}

// gw[t, j] = <grad[t], y[row_of_slot[t, j]]> (0 for dropped slots); warp per token t. The token's
// choices are taken kGroup at a time: each grad packet is loaded once per group and multiplied into
// the packets of the group's y rows, so grad[t] is read ceil(k / kGroup) times rather than k, and a
// lane has kU * (kGroup + 1) loads in flight. Each lane sums its packets' products in packet order
// (i = lane, lane + 32, ...), then the warp reduces each choice's sum with shuffles.
template <typename scalar_t, int VEC, int kGroup>
__global__ void __launch_bounds__(cuda::kThreads)
    unpermute_weight_grad_kernel(const scalar_t* __restrict__ grad, const scalar_t* __restrict__ y,
                                 const int64_t* __restrict__ row_of_slot, acc_t<scalar_t>* __restrict__ gw,
                                 int64_t tokens, int64_t ppr, int64_t k, int64_t y_rows) {
  using acc = acc_t<scalar_t>;
  using P = Packet<scalar_t, VEC>;
  constexpr int kU = 2;  // packets of each row per lane per step
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize; t < tokens;
       t += warps) {
    const P* g = reinterpret_cast<const P*>(grad) + t * ppr;
    for (int64_t j0 = 0; j0 < k; j0 += kGroup) {
      const P* src[kGroup];  // nullptr: a dropped slot or past k (uniform across the warp)
      acc sum[kGroup];
#pragma unroll
      for (int q = 0; q < kGroup; ++q) {
        int64_t row = -1;
        if (j0 + q < k) {
          row = row_of_slot[t * k + j0 + q];
          CUDA_KERNEL_ASSERT_MSG(row >= -1 && row < y_rows,
                                 "unpermute_weight_grad_cuda: row_of_slot entry outside [-1, rows of y)");
        }
        src[q] = row >= 0 ? reinterpret_cast<const P*>(y) + row * ppr : nullptr;
        sum[q] = acc(0);
      }
      for (int64_t i0 = lane; i0 < ppr; i0 += kWarpSize * kU) {
        P a[kU];
        P b[kU][kGroup];
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int64_t i = i0 + u * kWarpSize;
          if (i >= ppr) continue;
          a[u] = g[i];
#pragma unroll
          for (int q = 0; q < kGroup; ++q) {
            if (src[q] != nullptr) b[u][q] = src[q][i];
          }
        }
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          if (i0 + u * kWarpSize >= ppr) continue;
#pragma unroll
          for (int q = 0; q < kGroup; ++q) {
            if (src[q] == nullptr) continue;
#pragma unroll
            for (int e = 0; e < VEC; ++e) sum[q] += static_cast<acc>(a[u].v[e]) * static_cast<acc>(b[u][q].v[e]);
          }
        }
      }
#pragma unroll
      for (int q = 0; q < kGroup; ++q) sum[q] = cuda::warp_sum(sum[q]);
      if (lane == 0) {
#pragma unroll
        for (int q = 0; q < kGroup; ++q) {
          if (j0 + q < k) gw[t * k + j0 + q] = sum[q];
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Launchers: pick the 16-byte packet path when every row starts 16-byte aligned.
// ------------------------------------------------------------------------------------------------

template <typename scalar_t, int VEC>
void launch_permute(const at::Tensor& x, const int64_t* slot_of_row, const acc_t<scalar_t>* w, at::Tensor& out,
                    int64_t rows, int64_t k) {
  const int64_t ppr = x.size(1) / VEC;
  const int64_t slots = x.size(0) * k;
  const auto kernel =
      w != nullptr ? permute_rows_kernel<scalar_t, VEC, true> : permute_rows_kernel<scalar_t, VEC, false>;
  const dim3 grid(static_cast<unsigned>(cuda::row_grid(kernel, rows)));
  kernel<<<grid, cuda::kThreads, 0, cuda::current_stream()>>>(x.data_ptr<scalar_t>(), slot_of_row, w,
                                                               out.data_ptr<scalar_t>(), rows, ppr, k, slots);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, int VEC>
void launch_unpermute(const at::Tensor& y, const int64_t* row_of_slot, const acc_t<scalar_t>* w, at::Tensor& out,
                      int64_t tokens, int64_t k) {
  const int64_t ppr = y.size(1) / VEC;
  const size_t shared_bytes = static_cast<size_t>(kWarpsPerBlock * k) * (sizeof(int64_t) + sizeof(acc_t<scalar_t>));
  const auto kernel =
      w != nullptr ? unpermute_rows_kernel<scalar_t, VEC, true> : unpermute_rows_kernel<scalar_t, VEC, false>;
  const dim3 grid(static_cast<unsigned>(cuda::row_grid(kernel, tokens, shared_bytes)));
  kernel<<<grid, cuda::kThreads, shared_bytes, cuda::current_stream()>>>(
      y.data_ptr<scalar_t>(), row_of_slot, w, out.data_ptr<scalar_t>(), tokens, ppr, k, y.size(0));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Choices per group (unpermute_weight_grad_kernel): 2 for top-1 and top-2 routing, 8 beyond.
template <typename scalar_t, int VEC>
void launch_weight_grad(const at::Tensor& grad, const at::Tensor& y, const int64_t* row_of_slot, at::Tensor& gw,
                        int64_t tokens, int64_t k) {
  const int64_t ppr = grad.size(1) / VEC;
  const auto kernel =
      k <= 2 ? unpermute_weight_grad_kernel<scalar_t, VEC, 2> : unpermute_weight_grad_kernel<scalar_t, VEC, 8>;
  const dim3 grid(static_cast<unsigned>(cuda::row_grid(kernel, tokens)));
  kernel<<<grid, cuda::kThreads, 0, cuda::current_stream()>>>(
      grad.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), row_of_slot, gw.data_ptr<acc_t<scalar_t>>(), tokens, ppr,
      k, y.size(0));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// True when rows of `hidden` elements of scalar_t can move as 16-byte packets for all `tensors`.
template <typename scalar_t>
bool use_packets(int64_t hidden, std::initializer_list<const at::Tensor*> tensors) {
  if (hidden % cuda::kVec16<scalar_t> != 0) return false;
  for (const at::Tensor* t : tensors) {
    if (!cuda::aligned16(t->data_ptr())) return false;
  }
  return true;
}

#define MOETRAIN_DISPATCH_ROWS(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, TYPE, NAME, __VA_ARGS__)

}  // namespace

// ------------------------------------------------------------------------------------------------
// Ops.
// ------------------------------------------------------------------------------------------------

at::Tensor permute_rows_cuda(const at::Tensor& x_TD, const at::Tensor& slot_of_row_N, int64_t k,
                             const c10::optional<at::Tensor>& weights_S) {
  checks::rows(x_TD, "x", c10::kCUDA);
  checks::index(slot_of_row_N, "slot_of_row", x_TD.device());
  checks::choices(k);
  checks::weights(weights_S, x_TD.size(0) * k, x_TD, "weights");
  const c10::cuda::CUDAGuard guard(x_TD.device());
  const int64_t rows = slot_of_row_N.numel();
  const int64_t hidden = x_TD.size(1);
  at::Tensor out = at::empty({rows, hidden}, x_TD.options());
  if (rows == 0 || hidden == 0) return out;
  MOETRAIN_DISPATCH_ROWS(x_TD.scalar_type(), "permute_rows_cuda", [&] {
    const acc_t<scalar_t>* w = weights_S.has_value() ? weights_S->data_ptr<acc_t<scalar_t>>() : nullptr;
    const int64_t* slot_of = slot_of_row_N.data_ptr<int64_t>();
    if (use_packets<scalar_t>(hidden, {&x_TD, &out})) {
      launch_permute<scalar_t, cuda::kVec16<scalar_t>>(x_TD, slot_of, w, out, rows, k);
    } else {
      launch_permute<scalar_t, 1>(x_TD, slot_of, w, out, rows, k);
    }
  });
  return out;
}

at::Tensor unpermute_rows_cuda(const at::Tensor& y_ND, const at::Tensor& row_of_slot_TK,
                               const c10::optional<at::Tensor>& weights_TK) {
  checks::rows(y_ND, "y", c10::kCUDA);
  checks::row_of_slot(row_of_slot_TK, y_ND, kMaxChoices);
  const int64_t tokens = row_of_slot_TK.size(0);
  const int64_t k = row_of_slot_TK.size(1);
  checks::weights(weights_TK, tokens * k, y_ND, "weights");
  const c10::cuda::CUDAGuard guard(y_ND.device());
  const int64_t hidden = y_ND.size(1);
  at::Tensor out = at::empty({tokens, hidden}, y_ND.options());
  if (tokens == 0 || hidden == 0) return out;
  MOETRAIN_DISPATCH_ROWS(y_ND.scalar_type(), "unpermute_rows_cuda", [&] {
    const acc_t<scalar_t>* w = weights_TK.has_value() ? weights_TK->data_ptr<acc_t<scalar_t>>() : nullptr;
    const int64_t* row_of = row_of_slot_TK.data_ptr<int64_t>();
    if (use_packets<scalar_t>(hidden, {&y_ND, &out})) {
      launch_unpermute<scalar_t, cuda::kVec16<scalar_t>>(y_ND, row_of, w, out, tokens, k);
    } else {
      launch_unpermute<scalar_t, 1>(y_ND, row_of, w, out, tokens, k);
    }
  });
  return out;
}

at::Tensor unpermute_weight_grad_cuda(const at::Tensor& grad_TD, const at::Tensor& y_ND,
                                      const at::Tensor& row_of_slot_TK) {
  checks::rows(grad_TD, "grad", c10::kCUDA);
  checks::rows(y_ND, "y", c10::kCUDA);
  checks::row_of_slot(row_of_slot_TK, y_ND, kMaxChoices);
  checks::weight_grad(grad_TD, y_ND, row_of_slot_TK);
  const c10::cuda::CUDAGuard guard(grad_TD.device());
  const int64_t tokens = row_of_slot_TK.size(0);
  const int64_t k = row_of_slot_TK.size(1);
  at::Tensor gw = at::empty({tokens, k}, grad_TD.options().dtype(checks::acc_dtype(grad_TD.scalar_type())));
  if (tokens == 0 || k == 0) return gw;
  MOETRAIN_DISPATCH_ROWS(grad_TD.scalar_type(), "unpermute_weight_grad_cuda", [&] {
    const int64_t* row_of = row_of_slot_TK.data_ptr<int64_t>();
    if (use_packets<scalar_t>(grad_TD.size(1), {&grad_TD, &y_ND})) {
      launch_weight_grad<scalar_t, cuda::kVec16<scalar_t>>(grad_TD, y_ND, row_of, gw, tokens, k);
    } else {
      launch_weight_grad<scalar_t, 1>(grad_TD, y_ND, row_of, gw, tokens, k);
    }
  });
  return gw;
}

}  // namespace moetrain

TORCH_LIBRARY_IMPL(moetrain, CUDA, m) {
  m.impl("permute_rows", &moetrain::permute_rows_cuda);
  m.impl("unpermute_rows", &moetrain::unpermute_rows_cuda);
  m.impl("unpermute_weight_grad", &moetrain::unpermute_weight_grad_cuda);
  m.impl("transpose_chunks", &moetrain::transpose_chunks_cuda);
  m.impl("pack_scaled_fp16", &moetrain::pack_scaled_fp16_cuda);
  m.impl("unpack_scaled_fp16", &moetrain::unpack_scaled_fp16_cuda);
}
