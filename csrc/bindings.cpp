// The op schemas of moetrain's kernels (TORCH_LIBRARY, namespace `moetrain`) and the Python
// module `moetrain._C`, which holds only the build facts and SIMD switches: the kernels are called
// as torch operators, `torch.ops.moetrain.<name>`.
//
// Kernels: csrc/permute.cpp, csrc/a2a_layout.cpp, csrc/cpu_adam.cpp (CPU) and csrc/permute_cuda.cu,
// csrc/a2a_layout_cuda.cu (CUDA; build_dispatch_plan's CUDA kernel is torch-native, registered from
// Python). Fake (meta) implementations, autograd formulas and the torch-native twins are in
// moetrain/kernels/. Legend of the names: T tokens, K choices, S = T*K slots, N kept rows,
// E experts, D hidden size.
#include <pybind11/pybind11.h>
#include <torch/library.h>

#include <string>

#include "cpu_features.h"
#include "ops.h"

#include "moetrain_build_info.h"  // written by setup.py into build/generated/

namespace {
// Literals moetrain/_ext.py finds in the binary without loading it: a build against another torch
// may fail to load with an undefined symbol, and a loaded build has registered its operators, so a
// stale one must be recognised before it is loaded (the just-in-time build then takes its place).
constexpr char kTorchVersionRecord[] = "moetrain-built-against-torch=" MOETRAIN_TORCH_VERSION ";";
constexpr size_t kTorchVersionPrefix = sizeof("moetrain-built-against-torch=") - 1;
constexpr char kSourceRecord[] = "moetrain-source-fingerprint=" MOETRAIN_SOURCE_FINGERPRINT ";";
constexpr size_t kSourcePrefix = sizeof("moetrain-source-fingerprint=") - 1;
}  // namespace

TORCH_LIBRARY(moetrain, m) {
  // Counting sort of the S routing slots by expert with a capacity cut (capacity < 0: none).
  // num_rows: slot_of_row's length, padded with -1 after the kept rows (a shape that does not
  // depend on the data, for compiled graphs); None: exactly the kept rows.
  // The sizes are SymInt: a compiled graph passes them as symbols of the token count, which an
  // `int` would specialise (one graph per length); the kernel, taking int64_t, gets them concrete.
  m.def(
      "build_dispatch_plan(Tensor expert_ids, Tensor? priority_order, SymInt num_experts, SymInt capacity, "
      "SymInt? num_rows=None) -> (Tensor row_of_slot, Tensor slot_of_row, Tensor kept_counts, "
      "Tensor routed_counts)");
  // The three row ops take the indices of one plan, which are one to one: the slots >= 0 in
  // slot_of_row are distinct, and so are the rows >= 0 in row_of_slot (each op's gradient inverts its
  // index). The CPU kernels and the twins refuse a repeat; the CUDA kernels do not check it (that
  // would cost a pass over the index per call): a repeat there gives wrong gradients.
  // out[r] = weights[s] * x[s // k] with s = slot_of_row[r]; s = -1 gives a zero row.
  m.def("permute_rows(Tensor x, Tensor slot_of_row, int k, Tensor? weights) -> Tensor");
  // out[t] = sum_j weights[t, j] * y[row_of_slot[t, j]], dropped slots (-1) skipped.
  m.def("unpermute_rows(Tensor y, Tensor row_of_slot, Tensor? weights) -> Tensor");
  // gw[t, j] = <grad[t], y[row_of_slot[t, j]]>, 0 for dropped slots.
  m.def("unpermute_weight_grad(Tensor grad, Tensor y, Tensor row_of_slot) -> Tensor");
  // Rows grouped as chunks [a][b] (sizes [A, B]) -> the same chunks in [b][a] order.
  m.def("transpose_chunks(Tensor x, Tensor sizes) -> Tensor");
  // [N, D] fp32/fp64 -> [N, D+1] int16: fp16 of x / 2^e per row, then e.
  m.def("pack_scaled_fp16(Tensor x) -> Tensor");
  m.def("unpack_scaled_fp16(Tensor packed, ScalarType dtype) -> Tensor");
  // Fused Adam/AdamW step on fp32 master weights, in place (an optimizer step: no autograd).
  m.def(
      "adam_step_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, *, int step, "
      "float lr, float beta1, float beta2, float eps, float weight_decay, bool adamw, float grad_scale=1., "
      "Tensor(d!)? param_copy_out=None) -> ()");
  // adam_step_ over lists; params[i]'s low-precision copy is param_copies_out[copy_index[i]]
  // (copy_index[i] = -1: none; copy_index empty: no copies).
  m.def(
      "adam_step_multi_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, *, "
      "int[] steps, float lr, float beta1, float beta2, float eps, float weight_decay, bool adamw, "
      "float grad_scale, Tensor(d!)[] param_copies_out, int[] copy_index) -> ()");
  // The memory roofline of adam_step_: p += g, m += g, v += g, copy = p (benchmarks only).
  m.def(
      "adam_memory_probe_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "Tensor(d!)? param_copy_out=None) -> ()");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "moetrain's build facts and SIMD switches; the kernels are torch.ops.moetrain.*";
  m.def("source_fingerprint",
        [] {
          const std::string record(kSourceRecord);
          return record.substr(kSourcePrefix, record.size() - kSourcePrefix - 1);
        },
        "Fingerprint of the csrc/ sources this extension was built from.");
  m.def("torch_version",
        [] {
          const std::string record(kTorchVersionRecord);
          return record.substr(kTorchVersionPrefix, record.size() - kTorchVersionPrefix - 1);
        },
        "torch.__version__ of the torch this extension was built against.");
  m.def("simd_level", [] { return std::string(moetrain::simd_level_name(moetrain::simd_level())); },
        "SIMD code path the CPU kernels use now: 'avx512', 'avx2' or 'scalar'.");
  m.def("detected_simd_level",
        [] { return std::string(moetrain::simd_level_name(moetrain::detected_simd_level())); },
        "Best SIMD code path this CPU supports.");
  m.def("set_max_simd_level",
        [](const std::string& name) { moetrain::set_max_simd_level(moetrain::parse_simd_level(name)); },
        pybind11::arg("level"), "Cap the SIMD code path ('avx512', 'avx2' or 'scalar'); for tests and benchmarks.");
  m.def("cpu_adam_simd_path", &moetrain::cpu_adam_simd_path_name,
        "The SIMD path ('avx512', 'avx2' or 'scalar') adam_step_ takes now: the CPU's best, capped by "
        "set_max_simd_level (the AVX2 path also needs F16C).");
}
