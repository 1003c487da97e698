// Fused Adam / AdamW step on fp32 master weights, in one pass over memory.
//
// Per element i (all arithmetic in fp32, hyper-parameters rounded to fp32 as torch does):
//   g      = grad[i] * (1 / grad_scale)                  grad is fp32, bf16 or fp16
//   g      = fma(p, weight_decay, g)       (Adam only: L2 penalty added to the gradient)
//   m      = fma(w, g - m, m)       when w = 1 - beta1 < 0.5,
//            fma(w - 1, g - m, g)   else                  == exp_avg.lerp_(g, 1 - beta1)
//            (torch's two-sided lerp: the end nearer the weight is the base)
//   v      = fma((1 - beta2) * g, g, v * beta2)           == exp_avg_sq.mul_(beta2).addcmul_(g, g, ..)
//   p      = p * decay - lr / (1 - beta1^step) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
//            decay = 1 - lr * weight_decay for AdamW (decoupled weight decay), else 1;
//            evaluated as fma(p, decay, (neg_step_size * m) / (sqrt(v) + eps_hat)) with
//            neg_step_size = -lr * sqrt(1 - beta2^step) / (1 - beta1^step) and
//            eps_hat = eps * sqrt(1 - beta2^step): one division instead of two, one rounding
//   out[i] = p  cast to the dtype of `param_copy_out` (fp32, bf16 or fp16; round to nearest even)
// which is `torch.optim.Adam` / `torch.optim.AdamW` (foreach=False, amsgrad=False,
// maximize=False) for the same step count, up to rounding: the moments follow torch's operation
// order (they match bit for bit for fp32 math), the weight differs by about an ulp per step
// (torch's CPU sqrt is not correctly rounded, ours is; we fold the bias correction of the
// denominator into the step size and apply the decay and the update with one rounding).
// All operations are explicit (no multiply-add left for the compiler to contract), so the
// AVX-512, AVX2 and scalar paths give bit-identical results. Bytes per element: read grad + 12 (p, m, v),
// write 12 + copy-out.
//
// The elements are cut into chunks of kChunkElems; an OpenMP loop over the chunks (of one tensor
// or of a whole list of tensors) runs a chunk kernel picked once per tensor from its dtypes and
// the SIMD level (AVX-512, AVX2+FMA+F16C or scalar; see cpu_features.h). Each vector kernel
// ends with the scalar kernel for the last numel % width elements.
//
// `adam_memory_probe_` runs the same loops over the same buffers with the arithmetic replaced by
// additions: its time is the memory roofline of one Adam step (benchmarks/cpu_adam.py).

#if defined(__x86_64__) || defined(__i386__)
// Included first, with GCC 12's false -Wmaybe-uninitialized on its own AVX-512 intrinsics
// (`_mm512_undefined_*`, GCC bug 105593) silenced for the header's lines only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include <torch/types.h>
#include <torch/library.h>

#include "cpu_features.h"
#include "ops.h"

namespace moetrain {
namespace {

// Elements per OpenMP work item: 64 KiB of each fp32 stream.
constexpr int64_t kChunkElems = 16384;

enum class GradKind { kF32, kBF16, kF16 };
enum class OutKind { kNone, kF32, kBF16, kF16 };
enum class KernelPath { kScalar, kAVX2, kAVX512 };

// Hyper-parameters of one step: computed in double (like the Python floats of torch's
// single-tensor Adam), then rounded to fp32 once.
struct AdamScalars {
  float inv_grad_scale;    // 1 / grad_scale
  float l2_weight_decay;   // Adam: weight_decay (0 for AdamW)
  bool use_l2;             // Adam with weight_decay != 0
  float lerp_coeff;        // w = 1 - beta1 when w < 0.5, else w - 1 (torch's lerp)
  bool lerp_from_grad;     // w >= 0.5: m = fma(w - 1, g - m, g), else fma(w, g - m, m)
  float beta2;             // beta2
  float one_minus_beta2;   // 1 - beta2
  float decay;             // AdamW: 1 - lr * weight_decay; Adam: 1
  float eps_hat;           // eps * sqrt(1 - beta2^step)
  float neg_step_size;     // -lr * sqrt(1 - beta2^step) / (1 - beta1^step)
};

AdamScalars make_adam_scalars(int64_t step, double lr, double beta1, double beta2, double eps,
                              double weight_decay, bool adamw, double grad_scale) {
  const double step_d = static_cast<double>(step);
  const double bias_correction1 = 1.0 - std::pow(beta1, step_d);
  const double bias_correction2 = 1.0 - std::pow(beta2, step_d);
  AdamScalars s{};
  s.inv_grad_scale = static_cast<float>(1.0 / grad_scale);
  s.use_l2 = !adamw && weight_decay != 0.0;
  s.l2_weight_decay = s.use_l2 ? static_cast<float>(weight_decay) : 0.0f;
  const float lerp_weight = static_cast<float>(1.0 - beta1);
  s.lerp_from_grad = !(std::abs(lerp_weight) < 0.5f);  // at::native::is_lerp_weight_small
  s.lerp_coeff = s.lerp_from_grad ? lerp_weight - 1.0f : lerp_weight;
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.decay = (adamw && weight_decay != 0.0) ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
  const double bias_correction2_sqrt = std::sqrt(bias_correction2);
  s.eps_hat = static_cast<float>(eps * bias_correction2_sqrt);
  s.neg_step_size = static_cast<float>(-(lr * bias_correction2_sqrt / bias_correction1));
  return s;
}

// ---------------------------------------------------------------------------------------------
// Scalar kernel (the reference formula; also the tail of the vector kernels).

template <GradKind G>
inline float load_grad_scalar(const void* grad, int64_t i) {
  if constexpr (G == GradKind::kF32) {
    return static_cast<const float*>(grad)[i];
  } else if constexpr (G == GradKind::kBF16) {
    const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(grad)[i]) << 16;
    float value;
    std::memcpy(&value, &bits, sizeof(value));
    return value;
  } else {
    return static_cast<float>(c10::Half(static_cast<const uint16_t*>(grad)[i], c10::Half::from_bits()));
  }
}

template <OutKind O>
inline void store_out_scalar(void* out, int64_t i, float value) {
  if constexpr (O == OutKind::kF32) {
    static_cast<float*>(out)[i] = value;
  } else if constexpr (O == OutKind::kBF16) {
    static_cast<uint16_t*>(out)[i] = c10::BFloat16(value).x;  // round to nearest even, NaN -> 0x7fc0
  } else if constexpr (O == OutKind::kF16) {
    static_cast<uint16_t*>(out)[i] = c10::Half(value).x;
  }
}

// kProbe: replace the Adam arithmetic with additions (same loads and stores) for the roofline.
template <GradKind G, OutKind O, bool kProbe>
void chunk_scalar(const void* grad, float* p, float* m, float* v, void* out, int64_t begin, int64_t end,
                  const AdamScalars& s) {
  for (int64_t i = begin; i < end; ++i) {
    float g = load_grad_scalar<G>(grad, i);
    float pi = p[i];
    float mi = m[i];
    float vi = v[i];
    if constexpr (kProbe) {
      pi = pi + g;
      mi = mi + g;
      vi = vi + g;
    } else {
      g = g * s.inv_grad_scale;
      if (s.use_l2) g = std::fma(pi, s.l2_weight_decay, g);
      mi = std::fma(s.lerp_coeff, g - mi, s.lerp_from_grad ? g : mi);
      vi = std::fma(s.one_minus_beta2 * g, g, vi * s.beta2);
      const float denom = std::sqrt(vi) + s.eps_hat;
      pi = std::fma(pi, s.decay, (s.neg_step_size * mi) / denom);
    }
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    store_out_scalar<O>(out, i, pi);
  }
}

template <GradKind G, OutKind O, bool kProbe>
void kernel_scalar(const void* grad, float* p, float* m, float* v, void* out, int64_t n, const AdamScalars& s) {
  chunk_scalar<G, O, kProbe>(grad, p, m, v, out, 0, n, s);
}

#if MOETRAIN_X86

// ---------------------------------------------------------------------------------------------
// AVX2 + FMA + F16C kernel: 8 lanes.

#define MOETRAIN_TARGET_AVX2_F16C __attribute__((target("avx2,fma,f16c")))

template <GradKind G>
MOETRAIN_TARGET_AVX2_F16C inline __m256 load_grad_avx2(const void* grad, int64_t i) {
  if constexpr (G == GradKind::kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(grad) + i);
  } else if constexpr (G == GradKind::kBF16) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(grad) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  } else {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(grad) + i));
    return _mm256_cvtph_ps(raw);
  }
}

template <OutKind O>
MOETRAIN_TARGET_AVX2_F16C inline void store_out_avx2(void* out, int64_t i, __m256 value) {
  if constexpr (O == OutKind::kF32) {
    _mm256_storeu_ps(static_cast<float*>(out) + i, value);
  } else if constexpr (O == OutKind::kBF16) {
    // Round to nearest even: (bits + 0x7fff + ((bits >> 16) & 1)) >> 16; NaN -> 0x7fc0.
    const __m256i bits = _mm256_castps_si256(value);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256 is_nan = _mm256_cmp_ps(value, value, _CMP_UNORD_Q);
    rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(is_nan));
    // Pack 8 x u32 -> 8 x u16 (packus works per 128-bit lane; the permute gathers both halves).
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0xD8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i), _mm256_castsi256_si128(packed));
  } else if constexpr (O == OutKind::kF16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i),
                     _mm256_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

template <GradKind G, OutKind O, bool kProbe>
MOETRAIN_TARGET_AVX2_F16C void kernel_avx2(const void* grad, float* p, float* m, float* v, void* out, int64_t n,
                                           const AdamScalars& s) {
  const __m256 inv_grad_scale = _mm256_set1_ps(s.inv_grad_scale);
  const __m256 l2_weight_decay = _mm256_set1_ps(s.l2_weight_decay);
  const __m256 lerp_coeff = _mm256_set1_ps(s.lerp_coeff);
  const __m256 beta2 = _mm256_set1_ps(s.beta2);
  const __m256 one_minus_beta2 = _mm256_set1_ps(s.one_minus_beta2);
  const __m256 decay = _mm256_set1_ps(s.decay);
  const __m256 eps_hat = _mm256_set1_ps(s.eps_hat);
  const __m256 neg_step_size = _mm256_set1_ps(s.neg_step_size);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 g = load_grad_avx2<G>(grad, i);
    __m256 pv = _mm256_loadu_ps(p + i);
    __m256 mv = _mm256_loadu_ps(m + i);
    __m256 vv = _mm256_loadu_ps(v + i);
    if constexpr (kProbe) {
      pv = _mm256_add_ps(pv, g);
      mv = _mm256_add_ps(mv, g);
      vv = _mm256_add_ps(vv, g);
    } else {
      g = _mm256_mul_ps(g, inv_grad_scale);
      if (s.use_l2) g = _mm256_fmadd_ps(pv, l2_weight_decay, g);
      mv = _mm256_fmadd_ps(lerp_coeff, _mm256_sub_ps(g, mv), s.lerp_from_grad ? g : mv);
      vv = _mm256_fmadd_ps(_mm256_mul_ps(one_minus_beta2, g), g, _mm256_mul_ps(vv, beta2));
      const __m256 denom = _mm256_add_ps(_mm256_sqrt_ps(vv), eps_hat);
      pv = _mm256_fmadd_ps(pv, decay, _mm256_div_ps(_mm256_mul_ps(neg_step_size, mv), denom));
    }
    _mm256_storeu_ps(p + i, pv);
    _mm256_storeu_ps(m + i, mv);
    _mm256_storeu_ps(v + i, vv);
    store_out_avx2<O>(out, i, pv);
  }
  chunk_scalar<G, O, kProbe>(grad, p, m, v, out, i, n, s);
}

// ---------------------------------------------------------------------------------------------
// AVX-512 kernel: 16 lanes.

template <GradKind G>
MOETRAIN_TARGET_AVX512 inline __m512 load_grad_avx512(const void* grad, int64_t i) {
  if constexpr (G == GradKind::kF32) {
    return _mm512_loadu_ps(static_cast<const float*>(grad) + i);
  } else if constexpr (G == GradKind::kBF16) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(grad) + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  } else {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(grad) + i));
    return _mm512_cvtph_ps(raw);
  }
}

template <OutKind O>
MOETRAIN_TARGET_AVX512 inline void store_out_avx512(void* out, int64_t i, __m512 value) {
  if constexpr (O == OutKind::kF32) {
    _mm512_storeu_ps(static_cast<float*>(out) + i, value);
  } else if constexpr (O == OutKind::kBF16) {
    // Round to nearest even: (bits + 0x7fff + ((bits >> 16) & 1)) >> 16; NaN -> 0x7fc0.
    const __m512i bits = _mm512_castps_si512(value);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __mmask16 is_nan = _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, is_nan, _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i), _mm512_cvtepi32_epi16(rounded));
  } else if constexpr (O == OutKind::kF16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i),
                        _mm512_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

template <GradKind G, OutKind O, bool kProbe>
MOETRAIN_TARGET_AVX512 void kernel_avx512(const void* grad, float* p, float* m, float* v, void* out, int64_t n,
                                          const AdamScalars& s) {
  const __m512 inv_grad_scale = _mm512_set1_ps(s.inv_grad_scale);
  const __m512 l2_weight_decay = _mm512_set1_ps(s.l2_weight_decay);
  const __m512 lerp_coeff = _mm512_set1_ps(s.lerp_coeff);
  const __m512 beta2 = _mm512_set1_ps(s.beta2);
  const __m512 one_minus_beta2 = _mm512_set1_ps(s.one_minus_beta2);
  const __m512 decay = _mm512_set1_ps(s.decay);
  const __m512 eps_hat = _mm512_set1_ps(s.eps_hat);
  const __m512 neg_step_size = _mm512_set1_ps(s.neg_step_size);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 g = load_grad_avx512<G>(grad, i);
    __m512 pv = _mm512_loadu_ps(p + i);
    __m512 mv = _mm512_loadu_ps(m + i);
    __m512 vv = _mm512_loadu_ps(v + i);
    if constexpr (kProbe) {
      pv = _mm512_add_ps(pv, g);
      mv = _mm512_add_ps(mv, g);
      vv = _mm512_add_ps(vv, g);
    } else {
      g = _mm512_mul_ps(g, inv_grad_scale);
      if (s.use_l2) g = _mm512_fmadd_ps(pv, l2_weight_decay, g);
      mv = _mm512_fmadd_ps(lerp_coeff, _mm512_sub_ps(g, mv), s.lerp_from_grad ? g : mv);
      vv = _mm512_fmadd_ps(_mm512_mul_ps(one_minus_beta2, g), g, _mm512_mul_ps(vv, beta2));
      const __m512 denom = _mm512_add_ps(_mm512_sqrt_ps(vv), eps_hat);
      pv = _mm512_fmadd_ps(pv, decay, _mm512_div_ps(_mm512_mul_ps(neg_step_size, mv), denom));
    }
    _mm512_storeu_ps(p + i, pv);
    _mm512_storeu_ps(m + i, mv);
    _mm512_storeu_ps(v + i, vv);
    store_out_avx512<O>(out, i, pv);
  }
  chunk_scalar<G, O, kProbe>(grad, p, m, v, out, i, n, s);
}

#endif  // MOETRAIN_X86

// ---------------------------------------------------------------------------------------------
// Dispatch.

// Processes elements [0, n) of buffers that already point at the chunk's first element.
using ChunkKernel = void (*)(const void* grad, float* p, float* m, float* v, void* out, int64_t n,
                             const AdamScalars& s);

// The path the kernels take now: simd_level() (capped by set_max_simd_level); the AVX2 variant
// also needs F16C.
KernelPath current_kernel_path() {
  const SimdLevel level = simd_level();
  if (level == SimdLevel::kAVX512) return KernelPath::kAVX512;
  if (level == SimdLevel::kAVX2 && cpu_has_f16c()) return KernelPath::kAVX2;
  return KernelPath::kScalar;
}

const char* kernel_path_name(KernelPath path) {
  switch (path) {
    case KernelPath::kAVX512:
      return "avx512";
    case KernelPath::kAVX2:
      return "avx2";
    default:
      return "scalar";
  }
}

template <GradKind G, OutKind O, bool kProbe>
ChunkKernel pick_for_path(KernelPath path) {
#if MOETRAIN_X86
  if (path == KernelPath::kAVX512) return &kernel_avx512<G, O, kProbe>;
  if (path == KernelPath::kAVX2) return &kernel_avx2<G, O, kProbe>;
#endif
  (void)path;
  return &kernel_scalar<G, O, kProbe>;
}

template <GradKind G, bool kProbe>
ChunkKernel pick_for_out(OutKind out, KernelPath path) {
  switch (out) {
    case OutKind::kF32:
      return pick_for_path<G, OutKind::kF32, kProbe>(path);
    case OutKind::kBF16:
      return pick_for_path<G, OutKind::kBF16, kProbe>(path);
    case OutKind::kF16:
      return pick_for_path<G, OutKind::kF16, kProbe>(path);
    default:
      return pick_for_path<G, OutKind::kNone, kProbe>(path);
  }
}

template <bool kProbe>
ChunkKernel pick_kernel(GradKind grad, OutKind out, KernelPath path) {
  switch (grad) {
    case GradKind::kBF16:
      return pick_for_out<GradKind::kBF16, kProbe>(out, path);
    case GradKind::kF16:
      return pick_for_out<GradKind::kF16, kProbe>(out, path);
    default:
      return pick_for_out<GradKind::kF32, kProbe>(out, path);
  }
}

// ---------------------------------------------------------------------------------------------
// Validation and the OpenMP loop.

GradKind grad_kind_of(const at::Tensor& grad) {
  switch (grad.scalar_type()) {
    case at::kBFloat16:
      return GradKind::kBF16;
    case at::kHalf:
      return GradKind::kF16;
    default:
      return GradKind::kF32;
  }
}

OutKind out_kind_of(const std::optional<at::Tensor>& out) {
  if (!out.has_value()) return OutKind::kNone;
  switch (out->scalar_type()) {
    case at::kBFloat16:
      return OutKind::kBF16;
    case at::kHalf:
      return OutKind::kF16;
    default:
      return OutKind::kF32;
  }
}

void check_dense_cpu(const at::Tensor& t, const std::string& op, const std::string& name) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is an undefined tensor");
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor, got device ", t.device());
  TORCH_CHECK(t.layout() == at::kStrided, op, ": ", name, " must be a dense (strided) tensor");
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous (sizes ", t.sizes(), ", strides ", t.strides(),
              ")");
}

bool is_low_or_full_float(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
}

// One tensor's buffers, validated.
struct AdamTensors {
  const char* grad;
  float* param;
  float* exp_avg;
  float* exp_avg_sq;
  char* out;
  int64_t grad_elem_size;
  int64_t out_elem_size;
  int64_t numel;
  GradKind grad_kind;
  OutKind out_kind;
};

// Validates one parameter's tensors; error messages name them `param`, `grad`, ... for the
// single-tensor op (suffix "") and `params[i]`, `grads[i]`, ... for the list op (suffix "[i]").
AdamTensors check_adam_tensors(const std::string& op, const std::string& suffix, const at::Tensor& param,
                               const at::Tensor& grad, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                               const std::optional<at::Tensor>& param_copy_out, const std::string& out_name) {
  const std::string param_name = (suffix.empty() ? "param" : "params") + suffix;
  const std::string grad_name = (suffix.empty() ? "grad" : "grads") + suffix;
  const std::string exp_avg_name = (suffix.empty() ? "exp_avg" : "exp_avgs") + suffix;
  const std::string exp_avg_sq_name = (suffix.empty() ? "exp_avg_sq" : "exp_avg_sqs") + suffix;
  check_dense_cpu(param, op, param_name);
  check_dense_cpu(grad, op, grad_name);
  check_dense_cpu(exp_avg, op, exp_avg_name);
  check_dense_cpu(exp_avg_sq, op, exp_avg_sq_name);
  TORCH_CHECK(param.scalar_type() == at::kFloat, op, ": ", param_name, " (the master weight) must be float32, got ",
              param.scalar_type());
  TORCH_CHECK(exp_avg.scalar_type() == at::kFloat, op, ": ", exp_avg_name, " must be float32, got ",
              exp_avg.scalar_type());
  TORCH_CHECK(exp_avg_sq.scalar_type() == at::kFloat, op, ": ", exp_avg_sq_name, " must be float32, got ",
              exp_avg_sq.scalar_type());
  TORCH_CHECK(is_low_or_full_float(grad.scalar_type()), op, ": ", grad_name,
              " must be float32, bfloat16 or float16, got ", grad.scalar_type());
  const int64_t numel = param.numel();
  TORCH_CHECK(grad.numel() == numel, op, ": ", grad_name, " has ", grad.numel(), " elements but ", param_name,
              " has ", numel);
  TORCH_CHECK(exp_avg.numel() == numel, op, ": ", exp_avg_name, " has ", exp_avg.numel(), " elements but ",
              param_name, " has ", numel);
  TORCH_CHECK(exp_avg_sq.numel() == numel, op, ": ", exp_avg_sq_name, " has ", exp_avg_sq.numel(),
              " elements but ", param_name, " has ", numel);
  TORCH_CHECK(!exp_avg.is_same(param) && !exp_avg_sq.is_same(param) && !exp_avg_sq.is_same(exp_avg), op, ": ",
              param_name, ", ", exp_avg_name, " and ", exp_avg_sq_name, " must be distinct tensors");
  AdamTensors t{};
  t.grad = static_cast<const char*>(grad.const_data_ptr());
  t.param = param.data_ptr<float>();
  t.exp_avg = exp_avg.data_ptr<float>();
  t.exp_avg_sq = exp_avg_sq.data_ptr<float>();
  t.grad_elem_size = grad.element_size();
  t.numel = numel;
  t.grad_kind = grad_kind_of(grad);
  t.out_kind = out_kind_of(param_copy_out);
  t.out = nullptr;
  t.out_elem_size = 0;
  if (param_copy_out.has_value()) {
    const at::Tensor& out = *param_copy_out;
    check_dense_cpu(out, op, out_name);
    TORCH_CHECK(is_low_or_full_float(out.scalar_type()), op, ": ", out_name,
                " must be float32, bfloat16 or float16, got ", out.scalar_type());
    TORCH_CHECK(out.numel() == numel, op, ": ", out_name, " has ", out.numel(), " elements but ", param_name,
                " has ", numel);
    t.out = static_cast<char*>(out.data_ptr());
    t.out_elem_size = out.element_size();
  }
  return t;
}

void check_step(const std::string& op, const std::string& name, int64_t step) {
  TORCH_CHECK_VALUE(step >= 1, op, ": ", name, " must be >= 1 (the step count after this update), got ", step);
}

void check_hyper(const std::string& op, double lr, double beta1, double beta2, double eps, double weight_decay,
                 double grad_scale) {
  TORCH_CHECK_VALUE(std::isfinite(lr) && lr >= 0.0, op, ": lr must be finite and >= 0, got ", lr);
  TORCH_CHECK_VALUE(beta1 >= 0.0 && beta1 < 1.0, op, ": beta1 must be in [0, 1), got ", beta1);
  TORCH_CHECK_VALUE(beta2 >= 0.0 && beta2 < 1.0, op, ": beta2 must be in [0, 1), got ", beta2);
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0.0, op, ": eps must be finite and >= 0, got ", eps);
  TORCH_CHECK_VALUE(std::isfinite(weight_decay) && weight_decay >= 0.0, op,
                    ": weight_decay must be finite and >= 0, got ", weight_decay);
  TORCH_CHECK_VALUE(std::isfinite(grad_scale) && grad_scale > 0.0, op, ": grad_scale must be finite and > 0, got ",
                    grad_scale);
}

// Marks the tensors an op writes as modified in place (autograd's version counter, as torch's own
// in-place ops do), so autograd refuses a backward through a graph that saved their old values.
void bump_versions(const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                   const std::optional<at::Tensor>& param_copy_out) {
  param.unsafeGetTensorImpl()->bump_version();
  exp_avg.unsafeGetTensorImpl()->bump_version();
  exp_avg_sq.unsafeGetTensorImpl()->bump_version();
  if (param_copy_out.has_value()) param_copy_out->unsafeGetTensorImpl()->bump_version();
}

// One OpenMP work item: up to kChunkElems elements of one tensor.
struct ChunkTask {
  ChunkKernel kernel;
  const AdamTensors* tensors;
  const AdamScalars* scalars;
  int64_t begin;
  int64_t count;
};

void run_chunk(const ChunkTask& task) {
  const AdamTensors& t = *task.tensors;
  const int64_t b = task.begin;
  void* out = t.out == nullptr ? nullptr : static_cast<void*>(t.out + b * t.out_elem_size);
  task.kernel(t.grad + b * t.grad_elem_size, t.param + b, t.exp_avg + b, t.exp_avg_sq + b, out, task.count,
              *task.scalars);
}

// Runs `kernels[i]` over every element of `tensors[i]`, chunk by chunk, on up to
// at::get_num_threads() OpenMP threads: one thread per kChunkElems elements in total at most, so
// small steps (many small tensors included) stay on the calling thread.
void run_chunks(const std::vector<AdamTensors>& tensors, const std::vector<AdamScalars>& scalars,
                const std::vector<ChunkKernel>& kernels) {
  std::vector<ChunkTask> tasks;
  int64_t total_elems = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    total_elems += tensors[i].numel;
    for (int64_t begin = 0; begin < tensors[i].numel; begin += kChunkElems) {
      const int64_t count = std::min(kChunkElems, tensors[i].numel - begin);
      tasks.push_back(ChunkTask{kernels[i], &tensors[i], &scalars[i], begin, count});
    }
  }
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  if (num_tasks == 0) return;
  const int64_t useful_threads = std::min<int64_t>(num_tasks, (total_elems + kChunkElems - 1) / kChunkElems);
  const int num_threads =
      static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), useful_threads)));
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
  for (int64_t i = 0; i < num_tasks; ++i) {
    run_chunk(tasks[i]);
  }
}

// ---------------------------------------------------------------------------------------------
// Ops.

void adam_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
               const at::Tensor& exp_avg_sq, int64_t step, double lr, double beta1, double beta2, double eps,
               double weight_decay, bool adamw, double grad_scale, const std::optional<at::Tensor>& param_copy_out) {
  const std::string op = "adam_step_";
  check_step(op, "step", step);
  check_hyper(op, lr, beta1, beta2, eps, weight_decay, grad_scale);
  std::vector<AdamTensors> tensors{
      check_adam_tensors(op, "", param, grad, exp_avg, exp_avg_sq, param_copy_out, "param_copy_out")};
  std::vector<AdamScalars> scalars{make_adam_scalars(step, lr, beta1, beta2, eps, weight_decay, adamw, grad_scale)};
  const KernelPath path = current_kernel_path();
  std::vector<ChunkKernel> kernels{pick_kernel<false>(tensors[0].grad_kind, tensors[0].out_kind, path)};
  bump_versions(param, exp_avg, exp_avg_sq, param_copy_out);
  run_chunks(tensors, scalars, kernels);
}

void adam_step_multi(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                     at::IntArrayRef steps, double lr, double beta1, double beta2, double eps, double weight_decay,
                     bool adamw, double grad_scale, at::TensorList param_copies_out, at::IntArrayRef copy_index) {
  const std::string op = "adam_step_multi_";
  const size_t n = params.size();
  TORCH_CHECK_VALUE(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && steps.size() == n, op,
                    ": params, grads, exp_avgs, exp_avg_sqs and steps must have the same length, got ", n, ", ",
                    grads.size(), ", ", exp_avgs.size(), ", ", exp_avg_sqs.size(), " and ", steps.size());
  TORCH_CHECK_VALUE(copy_index.empty() || copy_index.size() == n, op,
                    ": copy_index must be empty (no copies) or have one entry per param, got ", copy_index.size(),
                    " entries for ", n, " params");
  for (size_t i = 0; i < copy_index.size(); ++i) {
    TORCH_CHECK_VALUE(copy_index[i] >= -1 && copy_index[i] < static_cast<int64_t>(param_copies_out.size()), op,
                      ": copy_index[", i, "] = ", copy_index[i], " is neither -1 nor an index of param_copies_out (",
                      param_copies_out.size(), " tensors)");
  }
  auto copy_of = [&](size_t i) -> std::optional<at::Tensor> {
    if (copy_index.empty() || copy_index[i] < 0) return std::nullopt;
    return param_copies_out[copy_index[i]];
  };
  check_hyper(op, lr, beta1, beta2, eps, weight_decay, grad_scale);
  const KernelPath path = current_kernel_path();
  std::vector<AdamTensors> tensors;
  std::vector<AdamScalars> scalars;
  std::vector<ChunkKernel> kernels;
  tensors.reserve(n);
  scalars.reserve(n);
  kernels.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const std::string suffix = "[" + std::to_string(i) + "]";
    check_step(op, "steps" + suffix, steps[i]);
    tensors.push_back(check_adam_tensors(op, suffix, params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], copy_of(i),
                                         "param_copies_out" + suffix));
    scalars.push_back(make_adam_scalars(steps[i], lr, beta1, beta2, eps, weight_decay, adamw, grad_scale));
    kernels.push_back(pick_kernel<false>(tensors.back().grad_kind, tensors.back().out_kind, path));
  }
  for (size_t i = 0; i < n; ++i) bump_versions(params[i], exp_avgs[i], exp_avg_sqs[i], copy_of(i));
  run_chunks(tensors, scalars, kernels);
}

void adam_memory_probe(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                       const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& param_copy_out) {
  const std::string op = "adam_memory_probe_";
  std::vector<AdamTensors> tensors{
      check_adam_tensors(op, "", param, grad, exp_avg, exp_avg_sq, param_copy_out, "param_copy_out")};
  std::vector<AdamScalars> scalars{AdamScalars{}};
  const KernelPath path = current_kernel_path();
  std::vector<ChunkKernel> kernels{pick_kernel<true>(tensors[0].grad_kind, tensors[0].out_kind, path)};
  bump_versions(param, exp_avg, exp_avg_sq, param_copy_out);
  run_chunks(tensors, scalars, kernels);
}

}  // namespace

std::string cpu_adam_simd_path_name() { return kernel_path_name(current_kernel_path()); }

}  // namespace moetrain

// Each op runs on at::get_num_threads() OpenMP threads; torch.ops releases the GIL around it.
TORCH_LIBRARY_IMPL(moetrain, CPU, m) {
  m.impl("adam_step_", &moetrain::adam_step);
  m.impl("adam_step_multi_", &moetrain::adam_step_multi);
  m.impl("adam_memory_probe_", &moetrain::adam_memory_probe);
}
