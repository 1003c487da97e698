// What the kernel files share with bindings.cpp. Each file registers its own kernels with
// TORCH_LIBRARY_IMPL(moetrain, CPU/CUDA, m); bindings.cpp defines the op schemas.
#pragma once

#include <string>

namespace moetrain {

// The SIMD path ('avx512', 'avx2' or 'scalar') the CPU Adam kernel takes now (cpu_adam.cpp).
std::string cpu_adam_simd_path_name();

}  // namespace moetrain
