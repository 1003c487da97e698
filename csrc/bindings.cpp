// The one Python module of moetrain's C++/CUDA kernels: `moetrain._C`.
#include <string>

#include "cpu_features.h"
#include "ops.h"

#include "moetrain_source_fingerprint.h"  // written by setup.py into build/generated/

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "moetrain C++ kernels: token permutation, all-to-all layout, CPU Adam";
  m.def("source_fingerprint", [] { return std::string(MOETRAIN_SOURCE_FINGERPRINT); },
        "Fingerprint of the csrc/ sources this extension was built from.");
  m.def("simd_level", [] { return std::string(moetrain::simd_level_name(moetrain::simd_level())); },
        "SIMD code path the CPU kernels use now: 'avx512', 'avx2' or 'scalar'.");
  m.def("detected_simd_level",
        [] { return std::string(moetrain::simd_level_name(moetrain::detected_simd_level())); },
        "Best SIMD code path this CPU supports.");
  m.def("set_max_simd_level",
        [](const std::string& name) { moetrain::set_max_simd_level(moetrain::parse_simd_level(name)); },
        pybind11::arg("level"), "Cap the SIMD code path ('avx512', 'avx2' or 'scalar'); for tests and benchmarks.");
  moetrain::register_permute_ops(m);
  moetrain::register_a2a_layout_ops(m);
  moetrain::register_cpu_adam_ops(m);
#ifdef MOETRAIN_WITH_CUDA
  moetrain::register_cuda_ops(m);
#endif
}
