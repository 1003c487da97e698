// Run-time selection of the SIMD code path for the CPU kernels.
//
// Every kernel with vector code has three variants compiled into the same translation unit with
// GCC/Clang function target attributes: AVX-512 (avx512f+avx512bw+avx512vl), AVX2 (avx2+fma) and
// a portable scalar variant. `simd_level()` answers the best level this CPU supports, clamped by
// `set_max_simd_level()` so tests can exercise the AVX2 and scalar paths on an AVX-512 machine.
#pragma once

#include <atomic>
#include <stdexcept>
#include <string>

namespace moetrain {

enum class SimdLevel : int { kScalar = 0, kAVX2 = 1, kAVX512 = 2 };

#if defined(__x86_64__) || defined(__i386__)
#define MOETRAIN_X86 1
#define MOETRAIN_TARGET_AVX2 __attribute__((target("avx2,fma")))
#define MOETRAIN_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))
#else
#define MOETRAIN_X86 0
#define MOETRAIN_TARGET_AVX2
#define MOETRAIN_TARGET_AVX512
#endif

inline SimdLevel detected_simd_level() {
#if MOETRAIN_X86
  static const SimdLevel level = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl")) {
      return SimdLevel::kAVX512;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return SimdLevel::kAVX2;
    return SimdLevel::kScalar;
  }();
  return level;
#else
  return SimdLevel::kScalar;
#endif
}

// F16C (fp16 <-> fp32 conversion), which the AVX2 kernels that read or write fp16 also need.
inline bool cpu_has_f16c() {
#if MOETRAIN_X86
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("f16c") != 0;
  }();
  return has;
#else
  return false;
#endif
}

inline std::atomic<int>& max_simd_level_storage() {
  static std::atomic<int> value{static_cast<int>(SimdLevel::kAVX512)};
  return value;
}

// The level kernels use: the CPU's best, never above the cap set by `set_max_simd_level`.
inline SimdLevel simd_level() {
  const int detected = static_cast<int>(detected_simd_level());
  const int cap = max_simd_level_storage().load(std::memory_order_relaxed);
  return static_cast<SimdLevel>(detected < cap ? detected : cap);
}

inline const char* simd_level_name(SimdLevel level) {
  switch (level) {
    case SimdLevel::kAVX512:
      return "avx512";
    case SimdLevel::kAVX2:
      return "avx2";
    default:
      return "scalar";
  }
}

inline SimdLevel parse_simd_level(const std::string& name) {
  if (name == "avx512") return SimdLevel::kAVX512;
  if (name == "avx2") return SimdLevel::kAVX2;
  if (name == "scalar") return SimdLevel::kScalar;
  throw std::invalid_argument("simd level must be one of 'avx512', 'avx2', 'scalar', got '" +
                              name + "'");
}

// Caps the SIMD level for every kernel (for tests and for comparing code paths in benchmarks).
inline void set_max_simd_level(SimdLevel level) {
  max_simd_level_storage().store(static_cast<int>(level), std::memory_order_relaxed);
}

}  // namespace moetrain
