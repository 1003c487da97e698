// Layout transforms around the all-to-all exchanges (CPU).
//
// transpose_chunks: the rows of x form an A x B matrix of chunks stored row-major ([a][b], chunk
// (a, b) has sizes[a][b] rows); the output stores the same chunks column-major ([b][a]). It is the
// local step of the 2-D (hierarchical) all-to-all — after the intra-node exchange a rank holds
// [source local rank][destination node] and must send [destination node][source local rank] — and
// it regroups received tokens from [source rank][local expert] to [local expert][source rank]
// for the expert GEMMs. Its inverse is transpose_chunks(y, sizes^T).
//
// pack_scaled_fp16 / unpack_scaled_fp16: fp16 wire format for fp32/fp64 rows that cannot overflow:
// each row r is divided by 2^e_r, e_r the smallest power of two making max|x_r| <= 2^15, and sent as
// D fp16 values followed by e_r stored in one 16-bit slot. Power-of-two scales are exact, so the
// only error is fp16 rounding (relative 2^-11) for values within 2^-24 of their row's maximum.
// e_r comes from frexp (exact, the CUDA twin's rule) and is at least kMinExponent, so 2^-e_r stays
// finite: fp64 rows whose max is at most 2^(kMinExponent + 14) (~1.5e-297) are scaled less than
// they need, so their values keep fp16's relative rounding only down to 2^-1014, become fp16
// subnormals below it and arrive as zeros from 2^-1025 (moetrain/comm/compression.py).
// NaN is ignored when taking the max (and arrives as NaN); rows holding inf are sent unscaled, so
// non-finite values arrive as they left and still reach the loss scaler.
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {
constexpr int kMinExponent = -1000;

// ceil(log2(amax)) - 15 for finite amax > 0 (else 0), exact: amax = m * 2^p with m in [0.5, 1).
int row_exponent(double amax) {
  if (!(amax > 0) || std::isinf(amax)) return 0;
  int p = 0;
  const double m = std::frexp(amax, &p);
  return std::max((m == 0.5 ? p - 1 : p) - 15, kMinExponent);
}
}  // namespace

#include <torch/types.h>
#include <torch/library.h>

#include "arg_checks.h"
#include "cpu_features.h"

#if MOETRAIN_X86
#include <immintrin.h>
#endif

namespace moetrain {
namespace {

torch::Tensor transpose_chunks(const torch::Tensor& x, const torch::Tensor& sizes_AB) {
  checks::chunk_layout(x, sizes_AB, c10::kCPU);
  const torch::Tensor sizes = sizes_AB.contiguous();
  checks::chunk_sizes(sizes, x.size(0));
  const int64_t a_count = sizes.size(0);
  const int64_t b_count = sizes.size(1);
  const int64_t* size = sizes.data_ptr<int64_t>();
  const int64_t rows = x.size(0);
  const int64_t row_bytes = rows == 0 ? 0 : static_cast<int64_t>(x.nbytes() / rows);

  // Source offsets in [a][b] order and destination offsets in [b][a] order.
  std::vector<int64_t> src_offset(a_count * b_count), dst_offset(a_count * b_count);
  int64_t total = 0;
  for (int64_t a = 0; a < a_count; ++a) {
    for (int64_t b = 0; b < b_count; ++b) {
      src_offset[a * b_count + b] = total;
      total += size[a * b_count + b];
    }
  }
  int64_t offset = 0;
  for (int64_t b = 0; b < b_count; ++b) {
    for (int64_t a = 0; a < a_count; ++a) {
      dst_offset[a * b_count + b] = offset;
      offset += size[a * b_count + b];
    }
  }

  torch::Tensor out = torch::empty_like(x);
  const char* src = static_cast<const char*>(x.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(row_bytes, 1));
  // Parallel over rows: each row finds its chunk by walking the (small) chunk table once per task.
  at::parallel_for(0, a_count * b_count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      const int64_t n = size[chunk];
      for (int64_t r = 0; r < n; r += grain) {
        const int64_t count = std::min(grain, n - r);
        std::memcpy(dst + (dst_offset[chunk] + r) * row_bytes, src + (src_offset[chunk] + r) * row_bytes,
                    count * row_bytes);
      }
    }
  });
  return out;
}

// One fp32 row of the scaled fp16 format, 8 lanes at a time (AVX2 + F16C). Same results as the
// scalar loop: the max ignores NaN (MAXPS returns its second operand when the first is NaN); a
// power-of-two scale that is a normal float makes the product exact (in float as in double), so
// the only rounding is the one to fp16 (round to nearest even, as c10::Half). Returns false, having
// written nothing, when 2^-e is not a normal float (rows whose max is below ~2^-112): the caller
// takes the scalar loop.
#if MOETRAIN_X86
#define MOETRAIN_TARGET_AVX2_F16C __attribute__((target("avx2,fma,f16c")))

MOETRAIN_TARGET_AVX2_F16C bool pack_row_f32_avx2(const float* row, int64_t hidden, int16_t* out) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 vmax = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= hidden; i += 8) vmax = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(row + i)), vmax);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  double amax = 0.0;
  for (float lane : lanes) amax = std::max(amax, static_cast<double>(lane));
  for (; i < hidden; ++i) amax = std::max(amax, std::abs(static_cast<double>(row[i])));
  const int exponent = row_exponent(amax);
  if (exponent > 126 || exponent < -127) return false;
  const float inv_scale = std::ldexp(1.0f, -exponent);
  const __m256 vscale = _mm256_set1_ps(inv_scale);
  for (i = 0; i + 8 <= hidden; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_mul_ps(_mm256_loadu_ps(row + i), vscale),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
  }
  for (; i < hidden; ++i) {
    const c10::Half h(row[i] * inv_scale);
    std::memcpy(out + i, &h, sizeof(int16_t));
  }
  out[hidden] = static_cast<int16_t>(exponent);
  return true;
}

// The inverse for one row to fp32 (false when 2^e is not a normal float: the scalar loop).
MOETRAIN_TARGET_AVX2_F16C bool unpack_row_f32_avx2(const int16_t* in, int64_t hidden, float* out) {
  const int exponent = in[hidden];
  if (exponent > 127 || exponent < -126) return false;
  const float scale = std::ldexp(1.0f, exponent);
  const __m256 vscale = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= hidden; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtph_ps(h), vscale));
  }
  for (; i < hidden; ++i) {
    c10::Half h;
    std::memcpy(&h, in + i, sizeof(int16_t));
    out[i] = static_cast<float>(h) * scale;
  }
  return true;
}
#endif

// The vector row routines where they exist (fp32 rows on x86; ``avx2``: the CPU path allows AVX2,
// read once per call by the caller); false: take the scalar loop.
inline bool pack_row_vector(bool avx2, const float* row, int64_t hidden, int16_t* out) {
#if MOETRAIN_X86
  return avx2 && pack_row_f32_avx2(row, hidden, out);
#else
  return false;
#endif
}
inline bool pack_row_vector(bool, const double*, int64_t, int16_t*) { return false; }

inline bool unpack_row_vector(bool avx2, const int16_t* in, int64_t hidden, float* out) {
#if MOETRAIN_X86
  return avx2 && unpack_row_f32_avx2(in, hidden, out);
#else
  return false;
#endif
}
inline bool unpack_row_vector(bool, const int16_t*, int64_t, double*) { return false; }

// x [N, D] float/double -> packed [N, D + 1] int16 (fp16 bit patterns, then the exponent).
torch::Tensor pack_scaled_fp16(const torch::Tensor& x) {
  checks::scaled_fp16_rows(x, c10::kCPU);
  const int64_t rows = x.size(0), hidden = x.size(1);
  torch::Tensor packed = torch::empty({rows, hidden + 1}, x.options().dtype(at::kShort));
  const bool avx2 = simd_level() >= SimdLevel::kAVX2 && cpu_has_f16c();  // the row code uses F16C
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "pack_scaled_fp16", [&] {
    const scalar_t* src = x.data_ptr<scalar_t>();
    int16_t* dst = packed.data_ptr<int16_t>();
    at::parallel_for(0, rows, std::max<int64_t>(1, 8192 / std::max<int64_t>(hidden, 1)), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const scalar_t* row = src + r * hidden;
        if (pack_row_vector(avx2, row, hidden, dst + r * (hidden + 1))) continue;
        double amax = 0.0;
        for (int64_t i = 0; i < hidden; ++i) amax = std::max(amax, std::abs(static_cast<double>(row[i])));
        const int exponent = row_exponent(amax);
        const double inv_scale = std::ldexp(1.0, -exponent);
        int16_t* out = dst + r * (hidden + 1);
        for (int64_t i = 0; i < hidden; ++i) {
          const c10::Half h(static_cast<float>(static_cast<double>(row[i]) * inv_scale));
          std::memcpy(out + i, &h, sizeof(int16_t));
        }
        out[hidden] = static_cast<int16_t>(exponent);
      }
    });
  });
  return packed;
}

torch::Tensor unpack_scaled_fp16(const torch::Tensor& packed, c10::ScalarType dtype) {
  checks::scaled_fp16_packed(packed, dtype, c10::kCPU);
  const int64_t rows = packed.size(0), hidden = packed.size(1) - 1;
  torch::Tensor x = torch::empty({rows, hidden}, packed.options().dtype(dtype));
  const bool avx2 = simd_level() >= SimdLevel::kAVX2 && cpu_has_f16c();  // the row code uses F16C
  AT_DISPATCH_FLOATING_TYPES(dtype, "unpack_scaled_fp16", [&] {
    const int16_t* src = packed.data_ptr<int16_t>();
    scalar_t* dst = x.data_ptr<scalar_t>();
    at::parallel_for(0, rows, std::max<int64_t>(1, 8192 / std::max<int64_t>(hidden, 1)), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const int16_t* in = src + r * (hidden + 1);
        if (unpack_row_vector(avx2, in, hidden, dst + r * hidden)) continue;
        const double scale = std::ldexp(1.0, in[hidden]);
        for (int64_t i = 0; i < hidden; ++i) {
          c10::Half h;
          std::memcpy(&h, in + i, sizeof(int16_t));
          dst[r * hidden + i] = static_cast<scalar_t>(static_cast<double>(static_cast<float>(h)) * scale);
        }
      }
    });
  });
  return x;
}

}  // namespace

}  // namespace moetrain

TORCH_LIBRARY_IMPL(moetrain, CPU, m) {
  m.impl("transpose_chunks", &moetrain::transpose_chunks);
  m.impl("pack_scaled_fp16", &moetrain::pack_scaled_fp16);
  m.impl("unpack_scaled_fp16", &moetrain::unpack_scaled_fp16);
}
