// Sort-based token permutation for MoE dispatch and combine (CPU).
//
// Legend: T tokens, K choices per token, S = T*K routing slots (slot s = t*K + j), E experts,
// N routed rows kept after the capacity cut, D hidden size.
//
//   build_dispatch_plan : expert_ids_TK -> row_of_slot_S (-1 = dropped), slot_of_row_N,
//                         kept_counts_E, routed_counts_E       (a counting sort, O(S))
//   permute_rows        : out_ND[r]   = w[s] * x_TD[s / K],          s = slot_of_row[r] (-1: zeros)
//   unpermute_rows      : out_TD[t]   = sum_j w[t,j] * y_ND[row_of_slot[t,j]]  (dropped: skipped)
//   unpermute_weight_grad: gw_TK[t,j] = <grad_TD[t], y_ND[row_of_slot[t,j]]>   (dropped: 0)
//
// permute_rows is the forward of dispatch and (with weights) the backward of combine;
// unpermute_rows is the forward of combine and (without weights) the backward of dispatch.
// The indices are one to one, as build_dispatch_plan makes them: no slot >= 0 twice in slot_of_row,
// no row >= 0 twice in row_of_slot (each op's gradient inverts its index); the ops refuse repeats.
// Rows are parallelised with at::parallel_for (OpenMP); the float inner loops have AVX-512, AVX2
// and scalar variants chosen at run time (cpu_features.h). Reduced-precision rows (bf16/fp16)
// accumulate in fp32; the weights are fp32 (fp64 for fp64 rows).
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include <torch/types.h>
#include <torch/library.h>

#include "arg_checks.h"
#include "cpu_features.h"

#if MOETRAIN_X86
#include <immintrin.h>
#endif

namespace moetrain {
namespace {

// ------------------------------------------------------------------------------------------------
// Float row primitives: y = a*x, y += a*x, <x, y>.
// ------------------------------------------------------------------------------------------------
inline void scale_row_scalar(float* y, const float* x, float a, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = a * x[i];
}
inline void axpy_row_scalar(float* y, const float* x, float a, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}
inline float dot_row_scalar(const float* x, const float* y, int64_t n) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * y[i];
  return sum;
}

#if MOETRAIN_X86
MOETRAIN_TARGET_AVX2 void scale_row_avx2(float* y, const float* x, float a, int64_t n) {
  const __m256 va = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(va, _mm256_loadu_ps(x + i)));
  for (; i < n; ++i) y[i] = a * x[i];
}
MOETRAIN_TARGET_AVX2 void axpy_row_avx2(float* y, const float* x, float a, int64_t n) {
  const __m256 va = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  }
  for (; i < n; ++i) y[i] += a * x[i];
}
MOETRAIN_TARGET_AVX2 float dot_row_avx2(const float* x, const float* y, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i), acc);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  float sum = 0.f;
  for (float lane : lanes) sum += lane;
  for (; i < n; ++i) sum += x[i] * y[i];
  return sum;
}

MOETRAIN_TARGET_AVX512 void scale_row_avx512(float* y, const float* x, float a, int64_t n) {
  const __m512 va = _mm512_set1_ps(a);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_mul_ps(va, _mm512_loadu_ps(x + i)));
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1u);
    _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(va, _mm512_maskz_loadu_ps(m, x + i)));
  }
}
MOETRAIN_TARGET_AVX512 void axpy_row_avx512(float* y, const float* x, float a, int64_t n) {
  const __m512 va = _mm512_set1_ps(a);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
  }
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1u);
    const __m512 r = _mm512_fmadd_ps(va, _mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i));
    _mm512_mask_storeu_ps(y + i, m, r);
  }
}
MOETRAIN_TARGET_AVX512 float dot_row_avx512(const float* x, const float* y, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i), acc);
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1u);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
}
#endif

struct FloatRowKernels {
  void (*scale)(float*, const float*, float, int64_t);
  void (*axpy)(float*, const float*, float, int64_t);
  float (*dot)(const float*, const float*, int64_t);
};

FloatRowKernels float_row_kernels() {
#if MOETRAIN_X86
  switch (simd_level()) {
    case SimdLevel::kAVX512:
      return {scale_row_avx512, axpy_row_avx512, dot_row_avx512};
    case SimdLevel::kAVX2:
      return {scale_row_avx2, axpy_row_avx2, dot_row_avx2};
    default:
      break;
  }
#endif
  return {scale_row_scalar, axpy_row_scalar, dot_row_scalar};
}

// ------------------------------------------------------------------------------------------------
// Row access for every dtype through an fp32 (fp64 for double) accumulator.
// ------------------------------------------------------------------------------------------------
template <typename scalar_t>
struct AccType {
  using type = float;
};
template <>
struct AccType<double> {
  using type = double;
};

// Rows of reduced precision are widened into `buffer` so the float kernels can run on them.
template <typename scalar_t>
inline const float* widen_row(const scalar_t* row, float* buffer, int64_t n) {
  for (int64_t i = 0; i < n; ++i) buffer[i] = static_cast<float>(row[i]);
  return buffer;
}
template <>
inline const float* widen_row<float>(const float* row, float*, int64_t) {
  return row;
}

template <typename scalar_t>
inline void narrow_row(scalar_t* out, const float* buffer, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<scalar_t>(buffer[i]);
}

constexpr int64_t kGrainElements = 16384;  // elements per parallel task, ~64 KiB of fp32

inline int64_t row_grain(int64_t hidden) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(hidden, 1)); }

// ------------------------------------------------------------------------------------------------
// Kernels.
// ------------------------------------------------------------------------------------------------
template <typename scalar_t>
void permute_rows_kernel(const scalar_t* x, const int64_t* slot_of_row, const typename AccType<scalar_t>::type* w,
                         scalar_t* out, int64_t rows, int64_t hidden, int64_t k) {
  using acc_t = typename AccType<scalar_t>::type;
  if (w == nullptr) {
    at::parallel_for(0, rows, row_grain(hidden), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        if (slot_of_row[r] < 0) {
          std::fill(out + r * hidden, out + (r + 1) * hidden, scalar_t(0));
        } else {
          std::memcpy(out + r * hidden, x + (slot_of_row[r] / k) * hidden, sizeof(scalar_t) * hidden);
        }
      }
    });
    return;
  }
  if constexpr (std::is_same_v<acc_t, double>) {
    at::parallel_for(0, rows, row_grain(hidden), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t s = slot_of_row[r];
        if (s < 0) {
          std::fill(out + r * hidden, out + (r + 1) * hidden, 0.0);
          continue;
        }
        const scalar_t* src = x + (s / k) * hidden;
        for (int64_t i = 0; i < hidden; ++i) out[r * hidden + i] = w[s] * src[i];
      }
    });
  } else {
    const FloatRowKernels kernels = float_row_kernels();
    at::parallel_for(0, rows, row_grain(hidden), [&](int64_t begin, int64_t end) {
      std::vector<float> widened(std::is_same_v<scalar_t, float> ? 0 : hidden);
      std::vector<float> result(std::is_same_v<scalar_t, float> ? 0 : hidden);
      for (int64_t r = begin; r < end; ++r) {
        const int64_t s = slot_of_row[r];
        if (s < 0) {
          std::fill(out + r * hidden, out + (r + 1) * hidden, scalar_t(0));
          continue;
        }
        if constexpr (std::is_same_v<scalar_t, float>) {
          kernels.scale(out + r * hidden, x + (s / k) * hidden, w[s], hidden);
        } else {
          const float* src = widen_row(x + (s / k) * hidden, widened.data(), hidden);
          kernels.scale(result.data(), src, w[s], hidden);
          narrow_row(out + r * hidden, result.data(), hidden);
        }
      }
    });
  }
}

template <typename scalar_t>
void unpermute_rows_kernel(const scalar_t* y, const int64_t* row_of_slot, const typename AccType<scalar_t>::type* w,
                           scalar_t* out, int64_t tokens, int64_t hidden, int64_t k) {
  using acc_t = typename AccType<scalar_t>::type;
  if constexpr (std::is_same_v<acc_t, double>) {
    at::parallel_for(0, tokens, row_grain(hidden * k), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        double* dst = out + t * hidden;
        std::fill(dst, dst + hidden, 0.0);
        for (int64_t j = 0; j < k; ++j) {
          const int64_t row = row_of_slot[t * k + j];
          if (row < 0) continue;
          const double a = w == nullptr ? 1.0 : w[t * k + j];
          const double* src = y + row * hidden;
          for (int64_t i = 0; i < hidden; ++i) dst[i] += a * src[i];
        }
      }
    });
  } else {
    const FloatRowKernels kernels = float_row_kernels();
    at::parallel_for(0, tokens, row_grain(hidden * k), [&](int64_t begin, int64_t end) {
      constexpr bool kFloat = std::is_same_v<scalar_t, float>;
      std::vector<float> widened(kFloat ? 0 : hidden);
      std::vector<float> accumulator(kFloat ? 0 : hidden);
      for (int64_t t = begin; t < end; ++t) {
        float* acc = kFloat ? reinterpret_cast<float*>(out + t * hidden) : accumulator.data();
        std::fill(acc, acc + hidden, 0.f);
        for (int64_t j = 0; j < k; ++j) {
          const int64_t row = row_of_slot[t * k + j];
          if (row < 0) continue;
          const float a = w == nullptr ? 1.f : w[t * k + j];
          const float* src = widen_row(y + row * hidden, widened.data(), hidden);
          kernels.axpy(acc, src, a, hidden);
        }
        if constexpr (!kFloat) narrow_row(out + t * hidden, acc, hidden);
      }
    });
  }
}

template <typename scalar_t>
void unpermute_weight_grad_kernel(const scalar_t* grad, const scalar_t* y, const int64_t* row_of_slot,
                                  typename AccType<scalar_t>::type* gw, int64_t tokens, int64_t hidden, int64_t k) {
  using acc_t = typename AccType<scalar_t>::type;
  if constexpr (std::is_same_v<acc_t, double>) {
    at::parallel_for(0, tokens, row_grain(hidden * k), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t j = 0; j < k; ++j) {
          const int64_t row = row_of_slot[t * k + j];
          double sum = 0.0;
          if (row >= 0) {
            for (int64_t i = 0; i < hidden; ++i) sum += grad[t * hidden + i] * y[row * hidden + i];
          }
          gw[t * k + j] = sum;
        }
      }
    });
  } else {
    const FloatRowKernels kernels = float_row_kernels();
    at::parallel_for(0, tokens, row_grain(hidden * k), [&](int64_t begin, int64_t end) {
      std::vector<float> widened_grad(std::is_same_v<scalar_t, float> ? 0 : hidden);
      std::vector<float> widened_y(std::is_same_v<scalar_t, float> ? 0 : hidden);
      for (int64_t t = begin; t < end; ++t) {
        const float* g = widen_row(grad + t * hidden, widened_grad.data(), hidden);
        for (int64_t j = 0; j < k; ++j) {
          const int64_t row = row_of_slot[t * k + j];
          gw[t * k + j] =
              row < 0 ? 0.f : kernels.dot(g, widen_row(y + row * hidden, widened_y.data(), hidden), hidden);
        }
      }
    });
  }
}

using checks::acc_dtype;

#define MOETRAIN_DISPATCH_ROWS(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, TYPE, NAME, __VA_ARGS__)

// ------------------------------------------------------------------------------------------------
// Ops.
// ------------------------------------------------------------------------------------------------

// Counting sort of the S = T*K routing slots by expert. Slots are visited in `priority_order`
// (default: choice-major, i.e. every token's j-th choice before any (j+1)-th choice, tokens in
// position order); an expert keeps the first `capacity` slots it receives (capacity < 0: all).
// Returns (row_of_slot_S, slot_of_row_N, kept_counts_E, routed_counts_E); expert e's rows are
// [sum(kept[:e]), sum(kept[:e+1])), in priority order, then `num_rows - sum(kept)` padding rows.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> build_dispatch_plan(const torch::Tensor& expert_ids_TK,
                                               const c10::optional<torch::Tensor>& priority_order_S,
                                               int64_t num_experts, int64_t capacity,
                                               c10::optional<int64_t> num_rows) {
  checks::index(expert_ids_TK, "expert_ids", c10::Device(c10::kCPU));
  TORCH_CHECK(expert_ids_TK.dim() == 2, "expert_ids must be 2-D [tokens, k], got ", expert_ids_TK.dim(), "-D");
  TORCH_CHECK(num_experts >= 1, "num_experts must be >= 1, got ", num_experts);
  const int64_t tokens = expert_ids_TK.size(0);
  const int64_t k = expert_ids_TK.size(1);
  const int64_t slots = tokens * k;
  const int64_t* expert = expert_ids_TK.data_ptr<int64_t>();
  const int64_t* order = nullptr;
  if (priority_order_S.has_value()) {
    checks::index(*priority_order_S, "priority_order", c10::Device(c10::kCPU));
    TORCH_CHECK(priority_order_S->numel() == slots, "priority_order must have tokens*k = ", slots,
                " elements, got ", priority_order_S->numel());
    order = priority_order_S->data_ptr<int64_t>();
  }
  auto slot_at = [&](int64_t q) -> int64_t { return order ? order[q] : (q % tokens) * k + q / tokens; };

  const auto index_options = expert_ids_TK.options();
  torch::Tensor routed_counts = torch::zeros({num_experts}, index_options);
  torch::Tensor row_of_slot = torch::empty({slots}, index_options);
  int64_t* routed = routed_counts.data_ptr<int64_t>();
  int64_t* row_of = row_of_slot.data_ptr<int64_t>();

  // Pass 1: rank of each slot inside its expert, in priority order (stored in row_of for now).
  std::vector<uint8_t> seen(order ? slots : 0, 0);
  for (int64_t q = 0; q < slots; ++q) {
    const int64_t s = slot_at(q);
    TORCH_CHECK(s >= 0 && s < slots, "priority_order[", q, "] = ", s, " is not a slot index in [0, ", slots, ")");
    if (order) {
      TORCH_CHECK(!seen[s], "priority_order must be a permutation; slot ", s, " appears twice");
      seen[s] = 1;
    }
    const int64_t e = expert[s];
    TORCH_CHECK(e >= 0 && e < num_experts, "expert_ids contains ", e, ", outside [0, ", num_experts, ")");
    row_of[s] = routed[e]++;
  }
  torch::Tensor kept_counts = capacity < 0 ? routed_counts.clone() : routed_counts.clamp_max(capacity);
  const int64_t* kept = kept_counts.data_ptr<int64_t>();
  std::vector<int64_t> offset(num_experts + 1, 0);
  for (int64_t e = 0; e < num_experts; ++e) offset[e + 1] = offset[e] + kept[e];

  // Pass 2: turn ranks into rows, dropping ranks beyond the capacity; padding rows get slot -1.
  const int64_t kept_rows = offset[num_experts];
  TORCH_CHECK(!num_rows.has_value() || *num_rows >= kept_rows, "num_rows = ", num_rows.value_or(0),
              " is less than the ", kept_rows, " rows the plan keeps");
  torch::Tensor slot_of_row = torch::empty({num_rows.value_or(kept_rows)}, index_options);
  int64_t* slot_of = slot_of_row.data_ptr<int64_t>();
  std::fill(slot_of + kept_rows, slot_of + slot_of_row.numel(), int64_t{-1});
  for (int64_t s = 0; s < slots; ++s) {
    const int64_t e = expert[s];
    const int64_t rank = row_of[s];
    if (rank < kept[e]) {
      row_of[s] = offset[e] + rank;
      slot_of[offset[e] + rank] = s;
    } else {
      row_of[s] = -1;
    }
  }
  return {row_of_slot.view({tokens, k}), slot_of_row, kept_counts, routed_counts};
}

torch::Tensor permute_rows(const torch::Tensor& x_TD, const torch::Tensor& slot_of_row_N, int64_t k,
                           const c10::optional<torch::Tensor>& weights_S) {
  checks::rows(x_TD, "x", c10::kCPU);
  checks::index(slot_of_row_N, "slot_of_row", x_TD.device());
  checks::choices(k);
  checks::weights(weights_S, x_TD.size(0) * k, x_TD, "weights");
  const int64_t rows = slot_of_row_N.numel();
  const int64_t hidden = x_TD.size(1);
  const int64_t slots = x_TD.size(0) * k;
  const int64_t* slot_of = slot_of_row_N.data_ptr<int64_t>();
  std::vector<bool> seen(slots, false);  // a repeated slot would get only one row's gradient
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t s = slot_of[r];
    TORCH_CHECK(s >= -1 && s < slots, "slot_of_row[", r, "] = ", s, " outside [-1, ", slots, ")");
    if (s < 0) continue;
    TORCH_CHECK(!seen[s], "slot_of_row must hold distinct slots; slot ", s, " appears twice (again at [", r, "])");
    seen[s] = true;
  }
  torch::Tensor out = torch::empty({rows, hidden}, x_TD.options());
  MOETRAIN_DISPATCH_ROWS(x_TD.scalar_type(), "permute_rows", [&] {
    using acc_t = typename AccType<scalar_t>::type;
    const acc_t* w = weights_S.has_value() ? weights_S->data_ptr<acc_t>() : nullptr;
    permute_rows_kernel<scalar_t>(x_TD.data_ptr<scalar_t>(), slot_of, w, out.data_ptr<scalar_t>(), rows, hidden, k);
  });
  return out;
}

// The values of row_of_slot (its layout passed checks::row_of_slot): every entry in [-1, rows of y)
// and no row >= 0 twice (the gradients invert the index: a repeated row would get one slot's share).
void check_row_of_slot_values(const torch::Tensor& row_of_slot_TK, const torch::Tensor& y_ND) {
  const int64_t rows = y_ND.size(0);
  const int64_t* row_of = row_of_slot_TK.data_ptr<int64_t>();
  std::vector<bool> seen(rows, false);
  for (int64_t s = 0; s < row_of_slot_TK.numel(); ++s) {
    const int64_t row = row_of[s];
    TORCH_CHECK(row >= -1 && row < rows, "row_of_slot[", s, "] = ", row, " outside [-1, ", rows, ")");
    if (row < 0) continue;
    TORCH_CHECK(!seen[row], "row_of_slot must hold distinct rows; row ", row, " appears twice (again at [", s, "])");
    seen[row] = true;
  }
}

torch::Tensor unpermute_rows(const torch::Tensor& y_ND, const torch::Tensor& row_of_slot_TK,
                             const c10::optional<torch::Tensor>& weights_TK) {
  checks::rows(y_ND, "y", c10::kCPU);
  checks::row_of_slot(row_of_slot_TK, y_ND, /*max_choices=*/-1);
  check_row_of_slot_values(row_of_slot_TK, y_ND);
  const int64_t tokens = row_of_slot_TK.size(0);
  const int64_t k = row_of_slot_TK.size(1);
  checks::weights(weights_TK, tokens * k, y_ND, "weights");
  const int64_t hidden = y_ND.size(1);
  torch::Tensor out = torch::empty({tokens, hidden}, y_ND.options());
  MOETRAIN_DISPATCH_ROWS(y_ND.scalar_type(), "unpermute_rows", [&] {
    using acc_t = typename AccType<scalar_t>::type;
    const acc_t* w = weights_TK.has_value() ? weights_TK->data_ptr<acc_t>() : nullptr;
    unpermute_rows_kernel<scalar_t>(y_ND.data_ptr<scalar_t>(), row_of_slot_TK.data_ptr<int64_t>(), w,
                                    out.data_ptr<scalar_t>(), tokens, hidden, k);
  });
  return out;
}

torch::Tensor unpermute_weight_grad(const torch::Tensor& grad_TD, const torch::Tensor& y_ND,
                                    const torch::Tensor& row_of_slot_TK) {
  checks::rows(grad_TD, "grad", c10::kCPU);
  checks::rows(y_ND, "y", c10::kCPU);
  checks::row_of_slot(row_of_slot_TK, y_ND, /*max_choices=*/-1);
  checks::weight_grad(grad_TD, y_ND, row_of_slot_TK);
  check_row_of_slot_values(row_of_slot_TK, y_ND);
  const int64_t tokens = row_of_slot_TK.size(0);
  const int64_t k = row_of_slot_TK.size(1);
  torch::Tensor gw = torch::empty({tokens, k}, grad_TD.options().dtype(acc_dtype(grad_TD.scalar_type())));
  MOETRAIN_DISPATCH_ROWS(grad_TD.scalar_type(), "unpermute_weight_grad", [&] {
    using acc_t = typename AccType<scalar_t>::type;
    unpermute_weight_grad_kernel<scalar_t>(grad_TD.data_ptr<scalar_t>(), y_ND.data_ptr<scalar_t>(),
                                           row_of_slot_TK.data_ptr<int64_t>(), gw.data_ptr<acc_t>(), tokens,
                                           grad_TD.size(1), k);
  });
  return gw;
}

}  // namespace

}  // namespace moetrain

TORCH_LIBRARY_IMPL(moetrain, CPU, m) {
  m.impl("build_dispatch_plan", &moetrain::build_dispatch_plan);
  m.impl("permute_rows", &moetrain::permute_rows);
  m.impl("unpermute_rows", &moetrain::unpermute_rows);
  m.impl("unpermute_weight_grad", &moetrain::unpermute_weight_grad);
}
