// Declarations of the registration functions of each kernel family; bindings.cpp calls them all.
#pragma once

#include <torch/extension.h>

namespace moetrain {

void register_permute_ops(pybind11::module_& m);
void register_a2a_layout_ops(pybind11::module_& m);
void register_cpu_adam_ops(pybind11::module_& m);

}  // namespace moetrain
