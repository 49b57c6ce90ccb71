#include "ops/ops.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/assert.h"
#include "ops/ops_kernels.h"

namespace d2o {

namespace ops {

namespace {

void swiglu_scalar(const float* gate, const float* up, int64_t n, float* y) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    y[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

void geglu_tanh_scalar(const float* gate, const float* up, int64_t n, float* y) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    y[i] = g / (1.0f + std::exp(std::min(g * (kGeluA + kGeluB * g * g), 88.0f))) * up[i];
  }
}

double sum_squares_scalar(const float* x, int64_t n) {
  double ss = 0.0;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  return ss;
}

void scale_mul_scalar(const float* x, float s, const float* w, int64_t n, float* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * s * w[i];
}

void add_scalar(float* y, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

void delta_rule_scalar(float* m, const DeltaRuleToken& t, int64_t n, float* o) {
  for (int64_t j = 0; j < n; ++j) {
    float* row = m + j * n;
    float mk = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
      row[i] *= t.decay;
      mk += row[i] * t.k[i];
    }
    const float d = (t.v[j] - mk) * t.beta;
    float mq = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
      row[i] += d * t.k[i];
      mq += row[i] * t.q[i];
    }
    o[j] = mq * t.scale;
  }
}

float exp_shifted_scalar(float* l, int64_t n, float* m_out) {
  const float m = *std::max_element(l, l + n);
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    l[i] = std::exp(l[i] - m);
    sum += l[i];
  }
  *m_out = m;
  return sum;
}

void scaled_add_scalar(const float* l, int64_t n, float c, float* acc) {
  for (int64_t i = 0; i < n; ++i) acc[i] += l[i] * c;
}

void softmax_add_scalar(float* l, int64_t n, float* acc) {
  float m;
  const float sum = exp_shifted_scalar(l, n, &m);
  scaled_add_scalar(l, n, 1.0f / sum, acc);
}

}  // namespace

const Kernels& scalar_kernels() {
  static const Kernels k{swiglu_scalar,      geglu_tanh_scalar,  sum_squares_scalar,
                         scale_mul_scalar,   add_scalar,         delta_rule_scalar,
                         softmax_add_scalar, exp_shifted_scalar, scaled_add_scalar};
  return k;
}

const Kernels& kernels_for(KernelIsa isa) {
  D2O_ASSERT(kernel_isa_available(isa));
  switch (isa) {
    case KernelIsa::kAvx512:
      return avx512_kernels();
    case KernelIsa::kAvx2:
      return avx2_kernels();
    default:
      return scalar_kernels();
  }
}

}  // namespace ops

namespace {
const ops::Kernels& best_ops() {
  static const ops::Kernels& k = ops::kernels_for(best_kernel_isa());
  return k;
}
}  // namespace

namespace {
void rmsnorm_with(const ops::Kernels& k, const float* x, const float* w, float eps, int64_t n,
                  float* y) {
  // Accumulate in double: the mean of squares of a 576..8192-wide row in float loses digits
  // that then differ from other implementations' (pairwise or vectorised) sums.
  const double ss = k.sum_squares(x, n);
  const float scale = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(n) + eps));
  k.scale_mul(x, scale, w, n, y);
}
}  // namespace

void rmsnorm_isa(KernelIsa isa, const float* x, const float* w, float eps, int64_t n, float* y) {
  rmsnorm_with(ops::kernels_for(isa), x, w, eps, n, y);
}

void rmsnorm(const float* x, const float* w, float eps, int64_t n, float* y) {
  rmsnorm_with(best_ops(), x, w, eps, n, y);
}

void delta_rule_step(float* m, const DeltaRuleToken& t, int64_t n, float* o) {
  best_ops().delta_rule(m, t, n, o);
}

void delta_rule_step_isa(KernelIsa isa, float* m, const DeltaRuleToken& t, int64_t n, float* o) {
  ops::kernels_for(isa).delta_rule(m, t, n, o);
}

void rope_tables(const RopeParams& p, float pos, float* cos_t, float* sin_t) {
  const int half = p.n_rot / 2;
  // theta_i = freq_scale * (pos * base^(-2i/n_rot) / ff_i): pos * base^(-2i/n_rot) by repeated
  // multiplication in float, divided by pair i's frequency factor (Llama 3's long-context
  // scaling; 1 without), then the linear scaling; in this order because it is how the reference
  // implementation builds its table (same float roundings). With freq_scale 1 and no factors
  // both steps are exact.
  const float theta_scale = std::pow(p.freq_base, -2.0f / static_cast<float>(p.n_rot));
  float theta = pos;
  for (int i = 0; i < half; ++i) {
    const float ff = p.freq_factors ? p.freq_factors[i] : 1.0f;
    const float t = p.freq_scale * (theta / ff);
    cos_t[i] = std::cos(t);
    sin_t[i] = std::sin(t);
    theta *= theta_scale;
  }
}

void rope_apply_tables(const RopeParams& p, const float* cos_t, const float* sin_t, int n_head,
                       float* x) {
  const int half = p.n_rot / 2;
  for (int h = 0; h < n_head; ++h) {
    float* v = x + static_cast<int64_t>(h) * p.head_dim;
    if (p.type == RopeType::kNorm) {
      for (int i = 0; i < half; ++i) {
        const float x0 = v[2 * i], x1 = v[2 * i + 1];
        v[2 * i] = x0 * cos_t[i] - x1 * sin_t[i];
        v[2 * i + 1] = x0 * sin_t[i] + x1 * cos_t[i];
      }
    } else {
      for (int i = 0; i < half; ++i) {
        const float x0 = v[i], x1 = v[i + half];
        v[i] = x0 * cos_t[i] - x1 * sin_t[i];
        v[i + half] = x0 * sin_t[i] + x1 * cos_t[i];
      }
    }
  }
}

void rope_apply(const RopeParams& p, float pos, int n_head, float* x) {
  float cos_t[kRopeMaxPairs], sin_t[kRopeMaxPairs];
  rope_tables(p, pos, cos_t, sin_t);
  rope_apply_tables(p, cos_t, sin_t, n_head, x);
}

void swiglu(const float* gate, const float* up, int64_t n, float* y) {
  best_ops().swiglu(gate, up, n, y);
}

void swiglu_isa(KernelIsa isa, const float* gate, const float* up, int64_t n, float* y) {
  ops::kernels_for(isa).swiglu(gate, up, n, y);
}

void geglu_tanh(const float* gate, const float* up, int64_t n, float* y) {
  best_ops().geglu_tanh(gate, up, n, y);
}

void geglu_tanh_isa(KernelIsa isa, const float* gate, const float* up, int64_t n, float* y) {
  ops::kernels_for(isa).geglu_tanh(gate, up, n, y);
}

void softmax_inplace(float* x, int64_t n) {
  if (n <= 0) return;
  const float m = *std::max_element(x, x + n);
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - m);
    sum += x[i];
  }
  const float inv = static_cast<float>(1.0 / sum);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

void add_inplace(float* y, const float* x, int64_t n) {
  best_ops().add(y, x, n);
}

void softmax_add(float* l, int64_t n, float* acc) {
  if (n > 0) best_ops().softmax_add(l, n, acc);
}

void softmax_add_isa(KernelIsa isa, float* l, int64_t n, float* acc) {
  if (n > 0) ops::kernels_for(isa).softmax_add(l, n, acc);
}

namespace {

float softmax_add_lse_with(const ops::Kernels& k, float* l, int64_t n, float lse_other,
                           float* acc) {
  if (n <= 0) return -std::numeric_limits<float>::infinity();
  float m;
  const float sum = k.exp_shifted(l, n, &m);
  const float lse = m + std::log(sum);
  if (acc) {
    // log(exp(lse) + exp(lse_other)), the larger one factored out.
    const float hi = std::max(lse, lse_other), lo = std::min(lse, lse_other);
    const float total =
        lo == -std::numeric_limits<float>::infinity() ? hi : hi + std::log1p(std::exp(lo - hi));
    k.scaled_add(l, n, std::exp(m - total), acc);
  }
  return lse;
}

}  // namespace

float softmax_add_lse(float* l, int64_t n, float lse_other, float* acc) {
  return softmax_add_lse_with(best_ops(), l, n, lse_other, acc);
}

float softmax_add_lse_isa(KernelIsa isa, float* l, int64_t n, float lse_other, float* acc) {
  return softmax_add_lse_with(ops::kernels_for(isa), l, n, lse_other, acc);
}

}  // namespace d2o
