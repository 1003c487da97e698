// Argument checks shared by the CPU and CUDA kernels (declarations and why: arg_checks.h).
#include "arg_checks.h"

#include <c10/util/Exception.h>

namespace moetrain {
namespace checks {
namespace {

const char* device_word(c10::DeviceType device) { return device == c10::DeviceType::CUDA ? "CUDA" : "CPU"; }

const char* contiguity(const at::Tensor& t) { return t.is_contiguous() ? "contiguous" : "non-contiguous"; }

bool is_row_dtype(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 || dtype == at::kHalf;
}

}  // namespace

at::ScalarType acc_dtype(at::ScalarType rows) { return rows == at::kDouble ? at::kDouble : at::kFloat; }

void rows(const at::Tensor& t, const char* name, c10::DeviceType device) {
  TORCH_CHECK(t.device().type() == device, name, " must be a ", device_word(device), " tensor, got one on ",
              t.device());
  TORCH_CHECK(t.dim() == 2, name, " must be 2-D [rows, hidden], got ", t.dim(), "-D");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(is_row_dtype(t.scalar_type()), name, " must be float32, float64, bfloat16 or float16, got ",
              t.scalar_type());
}

void index(const at::Tensor& t, const char* name, const c10::Device& device) {
  TORCH_CHECK(t.device() == device, name, " must be on ", device, ", got ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kLong, name, " must be int64, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void weights(const c10::optional<at::Tensor>& w, int64_t numel, const at::Tensor& rows, const char* name) {
  if (!w.has_value()) return;
  TORCH_CHECK(w->device() == rows.device() && w->is_contiguous(), name, " must be a contiguous tensor on ",
              rows.device(), ", got a ", contiguity(*w), " one on ", w->device());
  TORCH_CHECK(w->numel() == numel, name, " must have ", numel, " elements, got ", w->numel());
  TORCH_CHECK(w->scalar_type() == acc_dtype(rows.scalar_type()), name, " must be ", acc_dtype(rows.scalar_type()),
              " for ", rows.scalar_type(), " rows, got ", w->scalar_type());
}

void choices(int64_t k) { TORCH_CHECK(k >= 1, "k must be >= 1, got ", k); }

void row_of_slot(const at::Tensor& row_of_slot_TK, const at::Tensor& rows, int64_t max_choices) {
  index(row_of_slot_TK, "row_of_slot", rows.device());
  TORCH_CHECK(row_of_slot_TK.dim() == 2, "row_of_slot must be 2-D [tokens, k], got ", row_of_slot_TK.dim(), "-D");
  TORCH_CHECK(max_choices < 0 || row_of_slot_TK.size(1) <= max_choices, "row_of_slot has k = ",
              row_of_slot_TK.size(1), " choices per token; the ", device_word(rows.device().type()),
              " kernels support at most ", max_choices);
}

void weight_grad(const at::Tensor& grad_TD, const at::Tensor& y_ND, const at::Tensor& row_of_slot_TK) {
  TORCH_CHECK(grad_TD.device() == y_ND.device(), "grad and y must be on the same device, got ", grad_TD.device(),
              " and ", y_ND.device());
  TORCH_CHECK(grad_TD.scalar_type() == y_ND.scalar_type(), "grad and y must have the same dtype, got ",
              grad_TD.scalar_type(), " and ", y_ND.scalar_type());
  TORCH_CHECK(grad_TD.size(1) == y_ND.size(1), "grad and y must have the same hidden size, got ", grad_TD.size(1),
              " and ", y_ND.size(1));
  TORCH_CHECK(grad_TD.size(0) == row_of_slot_TK.size(0), "grad has ", grad_TD.size(0), " rows but row_of_slot has ",
              row_of_slot_TK.size(0), " tokens");
}

void chunk_layout(const at::Tensor& x, const at::Tensor& sizes_AB, c10::DeviceType device) {
  TORCH_CHECK(x.device().type() == device && x.is_contiguous(), "x must be a contiguous ", device_word(device),
              " tensor, got a ", contiguity(x), " one on ", x.device());
  TORCH_CHECK(x.dim() >= 1, "x must have a row dimension");
  const bool on_cpu_or_x = sizes_AB.is_cpu() || sizes_AB.device() == x.device();
  TORCH_CHECK(sizes_AB.scalar_type() == at::kLong && sizes_AB.dim() == 2 && on_cpu_or_x,
              "sizes must be a 2-D int64 tensor [A, B] on the CPU or on x's device, got a ", sizes_AB.dim(), "-D ",
              sizes_AB.scalar_type(), " one on ", sizes_AB.device());
}

void chunk_sizes(const at::Tensor& sizes_AB, int64_t rows) {
  int64_t total = 0;
  if (sizes_AB.numel() > 0) {
    TORCH_CHECK(sizes_AB.is_cpu() && sizes_AB.is_contiguous(), "sizes must be contiguous on the CPU here");
    const int64_t* size = sizes_AB.data_ptr<int64_t>();
    const int64_t b_count = sizes_AB.size(1);
    for (int64_t c = 0; c < sizes_AB.numel(); ++c) {
      TORCH_CHECK(size[c] >= 0, "sizes must be >= 0, got ", size[c], " at [", c / b_count, ", ", c % b_count, "]");
    }
    for (int64_t c = 0; c < sizes_AB.numel(); ++c) {
      // total <= rows here, so rows - total cannot overflow (total + size[c] could: a sum that wraps
      // around to rows would pass the final check and send the copies outside x)
      TORCH_CHECK(size[c] <= rows - total, "sizes sum past the ", rows, " rows of x at [", c / b_count, ", ",
                  c % b_count, "] (size ", size[c], ", ", rows - total, " rows left)");
      total += size[c];
    }
  }
  TORCH_CHECK(total == rows, "sizes sum to ", total, " but x has ", rows, " rows");
}

void scaled_fp16_rows(const at::Tensor& x, c10::DeviceType device) {
  TORCH_CHECK(x.device().type() == device && x.is_contiguous() && x.dim() == 2, "x must be a contiguous 2-D ",
              device_word(device), " tensor, got a ", x.dim(), "-D ", contiguity(x), " one on ", x.device());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble, "x must be float32 or float64, got ",
              x.scalar_type());
}

void scaled_fp16_packed(const at::Tensor& packed, at::ScalarType dtype, c10::DeviceType device) {
  TORCH_CHECK(packed.device().type() == device && packed.is_contiguous() && packed.dim() == 2 &&
                  packed.scalar_type() == at::kShort && packed.size(1) >= 1,
              "packed must be a contiguous 2-D int16 ", device_word(device), " tensor [N, D + 1], got a ",
              packed.dim(), "-D ", packed.scalar_type(), " one on ", packed.device());
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble, "dtype must be float32 or float64, got ", dtype);
}

}  // namespace checks
}  // namespace moetrain
