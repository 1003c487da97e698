// Argument checks of the ops, shared by the CPU kernels (permute.cpp, a2a_layout.cpp) and the CUDA
// kernels (permute_cuda.cu, a2a_layout_cuda.cu): one set of one-line messages for both devices.
//
// They are compiled here, in a host C++ file, so that no failing check runs in a translation unit
// nvcc compiled: on an H100 with torch 2.11 (2026-11-26) every TORCH_CHECK in a .cu file that failed
// with an integer in its message crashed the process (SIGSEGV) instead of raising (docs/gpu.md).
//
// `device` is the device type the op's kernel runs on (kCPU or kCUDA); the messages name it.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>

namespace moetrain {
namespace checks {

// The accumulator (and gate-weight) dtype of a row dtype: fp64 for fp64 rows, else fp32.
at::ScalarType acc_dtype(at::ScalarType rows);

// t: 2-D [rows, hidden], contiguous, fp32/fp64/bf16/fp16, on a `device` device.
void rows(const at::Tensor& t, const char* name, c10::DeviceType device);

// t: int64, contiguous, on `device`.
void index(const at::Tensor& t, const char* name, const c10::Device& device);

// w (when given): `numel` contiguous elements of acc_dtype(rows) on the rows' device.
void weights(const c10::optional<at::Tensor>& w, int64_t numel, const at::Tensor& rows, const char* name);

// k, the choices per token: >= 1.
void choices(int64_t k);

// row_of_slot_TK: an index on the rows' device, 2-D [tokens, k], k <= max_choices (max_choices < 0: any).
void row_of_slot(const at::Tensor& row_of_slot_TK, const at::Tensor& rows, int64_t max_choices);

// unpermute_weight_grad's grad_TD against y_ND and row_of_slot_TK: same device, dtype, hidden size,
// and one grad row per token.
void weight_grad(const at::Tensor& grad_TD, const at::Tensor& y_ND, const at::Tensor& row_of_slot_TK);

// transpose_chunks' x (contiguous, >= 1-D, on a `device` device) and sizes_AB (2-D int64, on the CPU
// or on x's device).
void chunk_layout(const at::Tensor& x, const at::Tensor& sizes_AB, c10::DeviceType device);

// The values of contiguous CPU sizes_AB (or of an empty one anywhere): every size >= 0, and they sum
// to `rows` (each size is checked against the rows left, so no sum can wrap around).
void chunk_sizes(const at::Tensor& sizes_AB, int64_t rows);

// pack_scaled_fp16's x: contiguous 2-D fp32/fp64 on a `device` device.
void scaled_fp16_rows(const at::Tensor& x, c10::DeviceType device);

// unpack_scaled_fp16's packed (contiguous 2-D int16 [N, D + 1] on a `device` device) and dtype
// (fp32 or fp64).
void scaled_fp16_packed(const at::Tensor& packed, at::ScalarType dtype, c10::DeviceType device);

}  // namespace checks
}  // namespace moetrain
