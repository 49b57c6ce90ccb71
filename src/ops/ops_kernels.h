// Internal: the per-ISA variants of the element-wise operators in ops.h (ops.cpp picks one).
#pragma once

#include <cstdint>

#include "ops/kernel_isa.h"

namespace d2o::ops {

struct Kernels {
  // y[i] = gate[i] / (1 + exp(-gate[i])) * up[i]; y may alias gate or up.
  void (*swiglu)(const float* gate, const float* up, int64_t n, float* y);
  // sum of x[i]^2, accumulated in double.
  double (*sum_squares)(const float* x, int64_t n);
  // y[i] = x[i] * s * w[i] (in this order); y may alias x.
  void (*scale_mul)(const float* x, float s, const float* w, int64_t n, float* y);
  // y[i] += x[i]
  void (*add)(float* y, const float* x, int64_t n);
};

const Kernels& scalar_kernels();
const Kernels& avx2_kernels();
const Kernels& avx512_kernels();
// The kernels of an available level.
const Kernels& kernels_for(KernelIsa isa);

}  // namespace d2o::ops
