// Element-wise and row-wise operators of the transformer block (everything but matmul and
// attention): RMSNorm, RoPE, SwiGLU, softmax, residual adds.
//
// These are memory-light next to matmul and attention. RMSNorm's sum of squares and SwiGLU have
// AVX2 / AVX-512 variants chosen at start-up like the other kernels (SwiGLU's vector exp is within
// a few ulp of libm's; the sums of squares are in double, so levels agree to the last float bit
// in all but rare ties); the rest are plain loops the compiler vectorises. Rows are contiguous
// float vectors; `n` is the row length.
#pragma once

#include <cstdint>

#include "ops/kernel_isa.h"

namespace d2o {

// y = x / sqrt(mean(x^2) + eps) * w. x and y may alias.
void rmsnorm(const float* x, const float* w, float eps, int64_t n, float* y);
// The same at a given (available) kernel level; for tests.
void rmsnorm_isa(KernelIsa isa, const float* x, const float* w, float eps, int64_t n, float* y);

// RoPE layouts: kNorm rotates adjacent pairs (x[2i], x[2i+1]) (llama, mistral); kNeox rotates
// (x[i], x[i + d/2]) (qwen2, gemma). Only the first n_rot dims of each head rotate.
enum class RopeType { kNorm, kNeox };

struct RopeParams {
  RopeType type = RopeType::kNorm;
  int head_dim = 0;
  int n_rot = 0;  // rotated dims per head (== head_dim for most models)
  float freq_base = 10000.0f;
  float freq_scale = 1.0f;              // linear position scaling (1 = none)
  // Optional per-pair divisors of the angle [n_rot / 2], positive (Llama 3.1's rope_freqs: 1 for
  // the high frequencies, the scaling factor for the low ones, a blend between); null: all 1.
  const float* freq_factors = nullptr;
};
// Pair i (i < n_rot / 2) of a head at position pos turns by
//   freq_scale * pos * freq_base^(-2i / n_rot) / freq_factors[i].

// Rotates `n_head` heads of `x` ([n_head, head_dim], in place) for position `pos`. Fractional
// positions are allowed (re-rotating keys by a position delta).
void rope_apply(const RopeParams& p, float pos, int n_head, float* x);
// The same in two steps, so that several vectors of one position (a token's queries and keys)
// share one table: cos/sin of the n_rot / 2 angles (at most kRopeMaxPairs), then the rotation.
inline constexpr int kRopeMaxPairs = 512;  // head_dim <= 1024
void rope_tables(const RopeParams& p, float pos, float* cos_t, float* sin_t);
void rope_apply_tables(const RopeParams& p, const float* cos_t, const float* sin_t, int n_head,
                       float* x);

// y[i] = silu(gate[i]) * up[i]
void swiglu(const float* gate, const float* up, int64_t n, float* y);
void swiglu_isa(KernelIsa isa, const float* gate, const float* up, int64_t n, float* y);
// y[i] = gelu(gate[i]) * up[i], GELU in its tanh approximation (Gemma's GeGLU)
void geglu_tanh(const float* gate, const float* up, int64_t n, float* y);
void geglu_tanh_isa(KernelIsa isa, const float* gate, const float* up, int64_t n, float* y);

// One token of the gated delta rule (model/delta_net.h) on one head's state m [n, n] (row j for
// value j, column i for key i): m *= decay; d_j = (v_j - m_j . k) * beta; m_j += d_j k;
// o_j = (m_j . q) * scale. q, k, v: [n].
struct DeltaRuleToken {
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  float decay = 1.0f, beta = 0.0f, scale = 1.0f;
};
void delta_rule_step(float* m, const DeltaRuleToken& t, int64_t n, float* o);
void delta_rule_step_isa(KernelIsa isa, float* m, const DeltaRuleToken& t, int64_t n, float* o);

// In-place softmax over n values.
void softmax_inplace(float* x, int64_t n);

// y += x
void add_inplace(float* y, const float* x, int64_t n);
// acc[i] += exp(l[i] - max l) / sum_j exp(l[j] - max l), for n > 0: one query's attention over n
// keys added to their running sums. l is overwritten (with the exponentials). The SIMD levels use
// their vector exp and lane-wise sums: results within float rounding of the scalar level's.
void softmax_add(float* l, int64_t n, float* acc);
void softmax_add_isa(KernelIsa isa, float* l, int64_t n, float* acc);
// One query's log-sum-exp over n keys, lse = log sum_j exp(l[j]) (returned; -inf for n = 0), and,
// when acc is not null, its attention over these keys as part of a softmax that also spans other
// keys whose log-sum-exp is lse_other (-inf: none): acc[i] += exp(l[i] - log(exp(lse) +
// exp(lse_other))). l is overwritten (with exp(l[i] - max l)). Within float rounding of the
// scalar level at every level.
float softmax_add_lse(float* l, int64_t n, float lse_other, float* acc);
float softmax_add_lse_isa(KernelIsa isa, float* l, int64_t n, float lse_other, float* acc);

}  // namespace d2o
