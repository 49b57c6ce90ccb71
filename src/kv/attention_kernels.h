// Inner loops of the attention kernel (src/kv/attention.cpp), one table per instruction-set level:
// portable scalar code (attention_kernels.cpp), AVX2 + FMA + F16C (attention_kernels_avx2.cpp) and
// AVX-512 (attention_kernels_avx512.cpp). Keys and values are read straight from the cache rows
// (F16 converted on load), so no per-tile copy is made.
//
// Each level is deterministic (fixed summation order), so attention results do not depend on the
// thread count; levels differ from each other only by float rounding (tests compare each level
// with a double-precision reference).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kv/kv_cache.h"
#include "ops/kernel_isa.h"

namespace d2o {

enum class ScoreAgg;  // kv/attention.h

namespace attn {

inline constexpr int kMaxRows = 4;  // query rows processed together

// Rows of one KV head: row j at base + j * row_bytes, elements of `type`.
struct KvRows {
  const uint8_t* base = nullptr;
  size_t row_bytes = 0;
  KvType type = KvType::kF16;
};

struct StatsArgs {
  const float* const* p = nullptr;  // [nb * grp] probability rows, (b, head-in-group) order; 0 where masked
  const float* inv = nullptr;       // [nb * grp] 1 / row sums
  int nb = 0;
  int grp = 1;
  int agg = 0;                      // static_cast<int>(ScoreAgg)
  int n_cols = 0;
  float* score = nullptr;           // [n_cols] += (null: not asked)
  float* window = nullptr;          // [n_cols] += for rows b >= window_from (null: not asked)
  int window_from = 0;
};

struct Kernels {
  // s[r][j] = scale * dot(q[r], key j) for r < n_rows (<= kMaxRows), j < n_keys.
  void (*scores)(const float* const* q, int n_rows, KvRows k, int n_keys, int hd, float scale, float* const* s);
  // s[j] = exp(s[j] - m) for j < n_valid, 0 for n_valid <= j < n; returns the sum of the first n_valid.
  float (*exp_sum)(float* s, int n_valid, int n, float m);
  // acc[r][d] = sum over j < n_keys of p[r][j] * v_j[d], for r < n_rows (<= kMaxRows).
  void (*pv)(const float* const* p, int n_rows, KvRows v, int n_keys, int hd, float* const* acc);
  // Column statistics of one tile (see StatsArgs).
  void (*stats)(const StatsArgs& a);
};

const Kernels& kernels_for(KernelIsa isa);  // isa must be available
const Kernels& best_kernels();

// Level implementations (defined in the per-ISA files).
const Kernels& scalar_kernels();
const Kernels& avx2_kernels();
const Kernels& avx512_kernels();

}  // namespace attn
}  // namespace d2o
