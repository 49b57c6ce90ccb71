// Dot products of one query vector with many stored rows: the inner loop of D2O's nearest-
// neighbour search (cosine similarity of an evicted key to every kept key of its head) when a
// compaction evicts a few slots, or compares values. A decode step's one evicted key, compared as
// stored, takes the attention kernels' scores instead (D2oHeadMerge::all_dots).
//
// Rows are read straight from KV storage (F32 or F16, converted on the fly; Q8_0 / Q4_0,
// dequantised a few rows at a time) or from a float matrix. Variants: scalar (portable), AVX2 +
// FMA + F16C (similarity_avx2.cpp) and AVX-512 (similarity_avx512.cpp), chosen once from
// cpu_features() like the ops/ kernels. Results of the variants differ only by float summation
// order.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ops/ggml_type.h"
#include "ops/kernel_isa.h"

namespace d2o {

struct RowDots {
  // Row r starts at base + map[x] * row_bytes (map null: x * row_bytes), x = rows ? rows[r] : r
  // (map: a KV cache's row map, rows: slot indices).
  const uint8_t* base = nullptr;
  size_t row_bytes = 0;
  bool f16 = false;               // rows hold IEEE halves (else floats)
  GgmlType quant = GgmlType::kF32;  // Q8_0 / Q4_0: rows hold such blocks (dim a multiple of 32)
  int dim = 0;                    // elements per row
  const int32_t* rows = nullptr;  // [n] row indices, or null for rows 0..n-1
  int n = 0;
  const float* q = nullptr;   // [dim]
  float* dot = nullptr;       // [n] out: q . row
  float* inv_norm = nullptr;  // [n] out: 1 / |row| (0 for a zero row), or null when not wanted
                              // (then no norms are formed; the dots are the same bits either way)
  const int32_t* map = nullptr;

  const uint8_t* row(int r) const {
    const int32_t x = rows ? rows[r] : r;
    return base + static_cast<size_t>(map ? map[x] : x) * row_bytes;
  }
  // Rows through a map are scattered, which the hardware prefetchers do not follow: the loops ask
  // for the rows kPrefetchRows ahead (each row's first and last byte) when map is set.
  static constexpr int kPrefetchRows = 16;
  void prefetch(int r) const {
    if (!map || r >= n) return;
    const uint8_t* p = row(r);
    __builtin_prefetch(p);
    __builtin_prefetch(p + row_bytes - 1);
  }
};

void row_dots(const RowDots& a);                     // best available variant
void row_dots_isa(KernelIsa isa, const RowDots& a);  // a given variant (must be available)

// Several queries against the same rows: dot[j * ld + r] = (q_j . row r) * scale for j < n_q,
// r < a.n, q_j = qs + j * q_stride, each dot with the bits row_dots gives it for q_j alone, then
// multiplied by `scale` (a.q, a.dot and a.inv_norm unused). F32 rows read in order (no a.rows or
// a.map) go a few queries and rows at a time, each row load serving several queries; any other
// rows, query by query through row_dots.
void row_dots_queries(const RowDots& a, const float* qs, size_t q_stride, int n_q, float scale,
                      float* dot, size_t ld);
void row_dots_queries_isa(KernelIsa isa, const RowDots& a, const float* qs, size_t q_stride,
                          int n_q, float scale, float* dot, size_t ld);

// Row r's inverse norm alone (a.q, a.dot and a.inv_norm unused), with the bits row_dots' loop of
// four rows gives it at the same level: a norm formed for one new slot equals the one formed
// with its neighbours. F32 and F16 rows only (not a.quant).
float row_inv_norm(const RowDots& a, int r);
float row_inv_norm_isa(KernelIsa isa, const RowDots& a, int r);

// The nearest row of one query from row_dots' output: s_i = 0 + (f * dot[i]) * inv[i] (f: the
// query's inverse norm times a scale), evaluated in that order. Returns the first index of the
// largest s_i (NaN never wins; a NaN s_0 stays the answer, as in a running maximum started at
// s_0) and that s_i in *best. Every variant gives the same index and bits. n >= 1.
int scaled_argmax(const float* dot, const float* inv, int n, float f, float* best);
int scaled_argmax_isa(KernelIsa isa, const float* dot, const float* inv, int n, float f,
                      float* best);

// The slot a one-slot eviction removes: the last index of the smallest s_i, i < n, as the running
// minimum started at s_0 that s_j replaces when s_j <= it (a NaN never wins; a NaN s_0 stays the
// answer). Every variant gives the same index. n >= 1.
int last_min_index(const float* s, int n);
int last_min_index_isa(KernelIsa isa, const float* s, int n);

// Mean attention (norm=queries): out_j = score_j / float(max(1, next - pos_j)), the slot at
// position pos_j having been seen by the queries pos_j .. next - 1. One IEEE division per slot,
// so every variant gives the same bits. Positions are non-negative.
void mean_attention(const float* score, const int32_t* pos, int n, int64_t next, float* out);
void mean_attention_isa(KernelIsa isa, const float* score, const int32_t* pos, int n, int64_t next,
                        float* out);

// last_min_index of the mean attention mean_attention would write, without writing it: the
// same quotients, so the same index on every variant. n >= 1.
int last_min_mean_index(const float* score, const int32_t* pos, int n, int64_t next);
int last_min_mean_index_isa(KernelIsa isa, const float* score, const int32_t* pos, int n,
                            int64_t next);

namespace simd {
int last_min_mean_index_avx2(const float* score, const int32_t* pos, int n, int32_t next);
int last_min_mean_index_avx512(const float* score, const int32_t* pos, int n, int32_t next);
void mean_attention_avx2(const float* score, const int32_t* pos, int n, int32_t next, float* out);
void mean_attention_avx512(const float* score, const int32_t* pos, int n, int32_t next, float* out);
void row_dots_avx2(const RowDots& a);
void row_dots_avx512(const RowDots& a);
// row_dots_queries over F32 rows read in order: the queries done (a multiple of the variant's
// block; the rest is the caller's), their rows up to the last multiple of four (likewise).
int row_dots_queries_avx2(const RowDots& a, const float* qs, size_t q_stride, int n_q, float scale,
                          float* dot, size_t ld);
int row_dots_queries_avx512(const RowDots& a, const float* qs, size_t q_stride, int n_q,
                            float scale, float* dot, size_t ld);
float row_inv_norm_avx2(const RowDots& a, int r);
float row_inv_norm_avx512(const RowDots& a, int r);
int scaled_argmax_avx2(const float* dot, const float* inv, int n, float f, float* best);
int scaled_argmax_avx512(const float* dot, const float* inv, int n, float f, float* best);
int last_min_index_avx2(const float* s, int n);
int last_min_index_avx512(const float* s, int n);
}  // namespace simd

}  // namespace d2o
