// Nearest stored row by dot product, for many query rows at once: D2O's prefill compaction
// matches every evicted slot (thousands) against every kept slot of its head. Rows are
// pre-normalised by the caller, so the dot product is the cosine similarity.
//
// The kept rows are packed once per head, transposed in column blocks ([D][s_pad] floats), and
// queries go four at a time: the AVX-512 micro-kernel keeps 4 x 32 sums in registers, the AVX2 one
// 4 x 16, so each packed row is loaded once per four queries instead of once per query. Every
// variant returns the first (lowest-index) maximum of its sums; the variants differ only by the
// summation order of the dot products.
#pragma once

#include <cstdint>
#include <vector>

#include "ops/kernel_isa.h"

namespace d2o {

// Kept rows, transposed: column c of row d is at data[d * s_pad + c]; columns s.. s_pad-1 are 0.
struct PackedRows {
  std::vector<float> data;
  int s = 0, s_pad = 0, dim = 0;
};

// Packs rows[s][dim] (row-major floats).
void pack_rows(const float* rows, int s, int dim, PackedRows& out);

// For each of the n_q (<= 4) query rows q[i * dim ...]: the index of the packed column with the
// largest dot product (the lowest index among equal maxima) and that dot product.
void nearest_rows(const PackedRows& b, const float* q, int n_q, int32_t* best, float* best_dot);
void nearest_rows_isa(KernelIsa isa, const PackedRows& b, const float* q, int n_q, int32_t* best,
                      float* best_dot);

// The query and kept rows of that search: out[dim] = row * f, f = (float)(scale / |row|) (0 for a
// zero row), the squares summed in double in eight interleaved partial sums (lane j takes the
// elements d with d % 8 == j; then ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))): the same
// bits from every variant. unit_row takes F32 rows, unit_row_f16 F16 rows.
void unit_row(const float* row, int dim, double scale, float* out);
void unit_row_f16(const uint16_t* row, int dim, double scale, float* out);
void unit_row_f16_isa(KernelIsa isa, const uint16_t* row, int dim, double scale, float* out);

namespace simd {
// The SIMD variants' last step: out[dim] holds the row as floats and s[8] the lanes' sums of the
// squares of its first d elements; adds the tail's squares to lanes d % 8, combines the lanes as
// unit_row does and scales out[] (compiled without SIMD flags: the same bits for every level).
void finish_unit_row(double* s, int d, int dim, double scale, float* out);
// Its factor alone: (float)(scale / sqrt(n2)) for the lanes' sums s[8] combined as above, 0 when
// n2 is 0 (for variants that scale the row themselves; a float product is the same bits anywhere).
float unit_row_factor(const double* s, double scale);
void unit_row_f16_avx2(const uint16_t* row, int dim, double scale, float* out);
void unit_row_f16_avx512(const uint16_t* row, int dim, double scale, float* out);
void nearest_rows_avx2(const PackedRows& b, const float* q, int n_q, int32_t* best,
                       float* best_dot);
void nearest_rows_avx512(const PackedRows& b, const float* q, int n_q, int32_t* best,
                         float* best_dot);
}  // namespace simd

}  // namespace d2o
