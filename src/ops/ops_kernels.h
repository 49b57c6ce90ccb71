// Internal: the per-ISA variants of the element-wise operators in ops.h (ops.cpp picks one).
#pragma once

#include <cstdint>

#include "ops/kernel_isa.h"
#include "ops/ops.h"

namespace d2o::ops {

struct Kernels {
  // y[i] = gate[i] / (1 + exp(-gate[i])) * up[i]; y may alias gate or up.
  void (*swiglu)(const float* gate, const float* up, int64_t n, float* y);
  // y[i] = gelu_tanh(gate[i]) * up[i], gelu_tanh(g) = g / (1 + exp(g * (kGeluA + kGeluB g^2)))
  // (the tanh form 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) rewritten with one exp; the
  // exponent clamped at 88); y may alias gate or up.
  void (*geglu_tanh)(const float* gate, const float* up, int64_t n, float* y);
  // sum of x[i]^2, accumulated in double.
  double (*sum_squares)(const float* x, int64_t n);
  // y[i] = x[i] * s * w[i] (in this order); y may alias x.
  void (*scale_mul)(const float* x, float s, const float* w, int64_t n, float* y);
  // y[i] += x[i]
  void (*add)(float* y, const float* x, int64_t n);
  // delta_rule_step (ops.h): per row, the decay and m_j . k in one sweep, the write and m_j . q
  // in a second (the SIMD levels with fused multiply-adds and lane-wise partial sums).
  void (*delta_rule)(float* m, const DeltaRuleToken& t, int64_t n, float* o);
  // softmax_add (ops.h): acc[i] += softmax(l)[i]; l is overwritten.
  void (*softmax_add)(float* l, int64_t n, float* acc);
  // l[i] = exp(l[i] - m), m = max l, stored in *m; returns the sum of the exponentials (n > 0).
  float (*exp_shifted)(float* l, int64_t n, float* m);
  // acc[i] += l[i] * c
  void (*scaled_add)(const float* l, int64_t n, float c, float* acc);
};

// -2 sqrt(2 / pi) and -2 sqrt(2 / pi) * 0.044715.
inline constexpr float kGeluA = -1.5957691216057308f;
inline constexpr float kGeluB = -0.07135481627159271f;

const Kernels& scalar_kernels();
const Kernels& avx2_kernels();
const Kernels& avx512_kernels();
// The kernels of an available level.
const Kernels& kernels_for(KernelIsa isa);

}  // namespace d2o::ops
