// Inner loops of the attention kernel (src/kv/attention.cpp), one table per instruction-set level:
// portable scalar code (attention_kernels.cpp), AVX2 + FMA + F16C (attention_kernels_avx2.cpp) and
// AVX-512 (attention_kernels_avx512.cpp). Keys and values are read straight from the cache rows
// (F16 converted, Q8_0 / Q4_0 dequantised on load) or from an F32 copy of a chunk; both give the
// same values.
//
// Each level is deterministic and computes every row on its own: a query row's results never
// depend on which other rows, or how many keys past its own, are processed in the same call. The
// attention kernel relies on this to give a query the same output whatever the thread count and
// however its tokens are grouped into passes and blocks. Levels differ from each other only by
// float rounding (tests compare each level with a double-precision reference).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kv/kv_cache.h"
#include "ops/kernel_isa.h"

namespace d2o {

enum class ScoreAgg;  // kv/attention.h

namespace attn {

// Rows of one KV head: row j at base + (idx ? idx[j] : j) * row_bytes, elements of `type`
// (idx: the cache's row map, kv_cache.h; null for rows in order, e.g. an F32 copy of a chunk).
//   prefetch (optional, a hint): rows of the same size that the caller reads next; scores() asks
//   for row j of them while it reads key j. The hardware prefetchers only get going on long
//   streams: a head with a few hundred slots (a compressed cache) is read as two short streams,
//   keys then values, and the values would otherwise start from memory latency again.
struct KvRows {
  const uint8_t* base = nullptr;
  size_t row_bytes = 0;
  KvElemType type = KvElemType::kF16;  // any; Q8_0 / Q4_0 rows: head_dim a multiple of 32
  const uint8_t* prefetch = nullptr;
  const int32_t* idx = nullptr;  // prefetch rows are found through it too

  size_t offset(int j) const { return static_cast<size_t>(idx ? idx[j] : j) * row_bytes; }
  const uint8_t* row(int j) const { return base + offset(j); }
  // As row(), with idx known to be set (kMap) or null: the kernels' loops are instantiated for
  // both, so rows in order (a cache never compacted, an F32 copy of a chunk) carry no lookup.
  template <bool kMap>
  const uint8_t* row_at(int j) const {
    return base + static_cast<size_t>(kMap ? idx[j] : j) * row_bytes;
  }
  // The hint: rows [j, j + n) of `prefetch`, one request per cache line (rows through idx: each
  // row's first and last line).
  template <bool kMap>
  void prefetch_rows(int j, int n) const {
    if (kMap) {
      for (int i = 0; i < n; ++i) {
        const uint8_t* p = prefetch + static_cast<size_t>(idx[j + i]) * row_bytes;
        __builtin_prefetch(p, 0, 3);
        __builtin_prefetch(p + row_bytes - 1, 0, 3);
      }
      return;
    }
    const uint8_t* p = prefetch + static_cast<size_t>(j) * row_bytes;
    const size_t bytes = static_cast<size_t>(n) * row_bytes;
    for (size_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 3);
  }
};

// Column statistics of one chunk of slots for the query rows of one block and one KV head.
//   a_b[j] = agg over the group's heads hh (in order) of p[b * grp + hh][j] * f[b * grp + hh]
//   score[j] += sum over b (in order) of a_b[j];  window[j] += the same over b >= window_from
// The sums over b are formed first (starting from 0) and then added to score / window, so adding
// the column sums of a block later (attention.cpp, per-block buffers) gives the same bits.
struct StatsArgs {
  const float* const* p = nullptr;  // [nb * grp] rows of exp(s - m_chunk), 0 where masked
  const float* f = nullptr;         // [nb * grp] exp(m_chunk - m_row) / l_row: p * f = probability
  int nb = 0;
  int grp = 1;
  int agg = 0;  // static_cast<int>(ScoreAgg)
  int n_cols = 0;
  float* score = nullptr;   // [n_cols] += (null: not asked)
  float* window = nullptr;  // [n_cols] += for rows b >= window_from (null: not asked)
  int window_from = 0;
  // window[j] = max(window[j], the most any row b >= window_from gives j) instead of the sum.
  bool window_max = false;
};

struct Kernels {
  // s[r][j] = scale * dot(q[r], key j) for r < n_rows, j < n_keys (any n_rows).
  void (*scores)(const float* const* q, int n_rows, KvRows k, int n_keys, int hd, float scale,
                 float* const* s);
  // Largest of s[0, n) (-inf for n == 0).
  float (*max)(const float* s, int n);
  // s[j] = exp(s[j] - m) for j < n_valid, 0 for n_valid <= j < n; returns the sum of the first
  // n_valid.
  float (*exp_sum)(float* s, int n_valid, int n, float m);
  // acc[r][d] = sum over j < n_keys (in order) of p[r][j] * v_j[d], for r < n_rows (any n_rows).
  void (*pv)(const float* const* p, int n_rows, KvRows v, int n_keys, int hd, float* const* acc);
  // o[d] = o[d] * a + x[d] * b for d < n (two products and a sum, no fused multiply-add).
  void (*rescale_add)(float* o, const float* x, float a, float b, int n);
  // Column statistics of one chunk (see StatsArgs).
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
