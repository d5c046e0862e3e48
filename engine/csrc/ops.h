// What every kernel of ours includes instead of <torch/extension.h>: ATen's Tensor, the factory functions the
// kernels call, at::parallel_for and the operator registry. No pybind11 and no torch C++ frontend: on 2 cores a
// kernel that included <torch/extension.h> took ~37 s of g++ for its headers alone, against ~6 s with these (each
// ISA level builds every kernel once, so a fresh CI machine built 5 to 20 of them).
//
// A kernel registers its functions as operators of the namespace TORCH_EXTENSION_NAME (the build name:
// prefix, ISA level and a hash, so two levels' builds load side by side in one process):
//
//     PDSERVE_OPS(m) { m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor", &rms_norm); }
//
// and Python calls them as torch.ops.<build name>.<function> (engine.cpu_ext.build returns that namespace).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#define PDSERVE_OPS_IN_(ns, m) TORCH_LIBRARY(ns, m)
#define PDSERVE_OPS_IN(ns, m) PDSERVE_OPS_IN_(ns, m)  // expands TORCH_EXTENSION_NAME before TORCH_LIBRARY pastes it
#define PDSERVE_OPS(m) PDSERVE_OPS_IN(TORCH_EXTENSION_NAME, m)
