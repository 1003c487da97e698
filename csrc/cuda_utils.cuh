// Shared pieces of moetrain's CUDA kernels (permute_cuda.cu, a2a_layout_cuda.cu): the launch geometry,
// 16-byte packets, warp reductions, and the host functions each file exports. Their argument checks
// are in arg_checks.cpp, compiled as host C++ (why: arg_checks.h).
//
// Geometry used by every row kernel: blocks of kThreads = 256 threads = 8 warps; one warp owns one
// row at a time and walks the rows with a grid-stride loop (row = warp id, warp id + total warps,
// ...), its 32 lanes striding over the row's packets. A packet is VEC consecutive elements moved by
// one load/store: 16 bytes (VEC = 16 / sizeof(element)) when the row size in bytes is a multiple
// of 16 and the base pointers are 16-byte aligned, one element otherwise. The grid is capped at
// the number of blocks the GPU holds at once for that kernel (row_grid), so a launch is one wave.
//
// Only ATen/c10 headers are included (no torch/extension.h, no ATen/cuda/CUDAContext.h): they keep
// nvcc fast and need no cuBLAS/cuSPARSE headers, so the files also compile against a CPU-only torch
// (tests/gpu/test_cuda_compile.py).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Optional.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

namespace moetrain {
namespace cuda {

constexpr int kThreads = 256;
constexpr int kWarpSize = 32;
constexpr int kWarpsPerBlock = kThreads / kWarpSize;
constexpr unsigned kFullMask = 0xffffffffu;

// VEC elements of one row moved by a single load or store (16 bytes for the vector path).
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Packet {
  T v[VEC];
};

template <typename T>
constexpr int kVec16 = 16 / static_cast<int>(sizeof(T));

// Accumulator of a row dtype: fp64 for fp64 rows, fp32 for fp32/bf16/fp16 rows.
template <typename T>
struct AccType {
  using type = float;
};
template <>
struct AccType<double> {
  using type = double;
};
template <typename T>
using acc_t = typename AccType<T>::type;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Blocks of kThreads for a grid-stride loop of `kernel` over `warp_tasks` warp-sized tasks: enough
// for every task, at most one wave (SMs x the kernel's resident blocks per SM at its register and
// shared-memory use) on the current device, so no block waits for another to finish.
template <typename Kernel>
int64_t row_grid(Kernel kernel, int64_t warp_tasks, size_t shared_bytes = 0) {
  const int device = c10::cuda::current_device();
  int sms = 0, blocks_per_sm = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, kThreads, shared_bytes));
  const int64_t wave = static_cast<int64_t>(sms) * std::max(1, blocks_per_sm);
  return std::max<int64_t>(1, std::min(ceil_div(warp_tasks, kWarpsPerBlock), wave));
}

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// ---- warp reductions (device) ----------------------------------------------------------------

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

// Maximum that ignores NaN like `(m < v) ? v : m` (the CPU loop's std::max): NaN never wins.
template <typename T>
__device__ __forceinline__ T max_ignoring_nan(T m, T v) {
  return (m < v) ? v : m;
}

template <typename T>
__device__ __forceinline__ T warp_max(T v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v = max_ignoring_nan(v, __shfl_xor_sync(kFullMask, v, offset));
  }
  return v;
}

}  // namespace cuda

// ---- host functions exported by the .cu files (registered as CUDA kernels in permute_cuda.cu) ----

// permute_cuda.cu
at::Tensor permute_rows_cuda(const at::Tensor& x_TD, const at::Tensor& slot_of_row_N, int64_t k,
                             const c10::optional<at::Tensor>& weights_S);
at::Tensor unpermute_rows_cuda(const at::Tensor& y_ND, const at::Tensor& row_of_slot_TK,
                               const c10::optional<at::Tensor>& weights_TK);
at::Tensor unpermute_weight_grad_cuda(const at::Tensor& grad_TD, const at::Tensor& y_ND,
                                      const at::Tensor& row_of_slot_TK);
// a2a_layout_cuda.cu
at::Tensor transpose_chunks_cuda(const at::Tensor& x, const at::Tensor& sizes_AB);
at::Tensor pack_scaled_fp16_cuda(const at::Tensor& x_ND);
at::Tensor unpack_scaled_fp16_cuda(const at::Tensor& packed, c10::ScalarType dtype);

}  // namespace moetrain
