// Declarations of the registration functions of each kernel family; bindings.cpp calls them all.
#pragma once

#include <torch/extension.h>

namespace moetrain {

void register_permute_ops(pybind11::module_& m);
void register_a2a_layout_ops(pybind11::module_& m);
void register_cpu_adam_ops(pybind11::module_& m);

#ifdef MOETRAIN_WITH_CUDA
// CUDA kernels of permute.cu and a2a_layout.cu (the *_cuda ops); defined in permute.cu.
void register_cuda_ops(pybind11::module_& m);
#endif

}  // namespace moetrain
