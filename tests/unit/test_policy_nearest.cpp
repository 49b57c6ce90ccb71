// nearest_rows (D2O's prefill neighbour search): every variant against a brute-force argmax in
// double precision, on odd sizes, exact ties (the lowest index wins) and all-negative similarities
// (the packing's zero padding must never win). scaled_argmax (the decode step's neighbour): every
// variant gives the index and bits of a plain running maximum. unit_row (the search's unit rows):
// every variant gives the bits of its definition.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/fp16.h"
#include "kv/policy/nearest.h"
#include "kv/policy/similarity.h"
#include "ops/kernel_isa.h"

namespace d2o {
namespace {

struct NearestCase {
  int s, dim, n_q;
};

void check_variant(KernelIsa isa, const NearestCase& k, bool negative, bool ties, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> rows(static_cast<size_t>(k.s) * k.dim), q(static_cast<size_t>(k.n_q) * k.dim);
  for (float& x : q) x = negative ? std::abs(u(rng)) + 0.1f : u(rng);
  for (float& x : rows) x = negative ? -(std::abs(u(rng)) + 0.1f) : u(rng);
  if (ties && k.s > 3) {
    // Columns 1 and s-1 both hold 10 x query 0, far above every other column's dot product
    // (|q . row| <= sum |q_d| < 10 |q|^2 here): the tie must go to index 1.
    for (int d = 0; d < k.dim; ++d) {
      rows[static_cast<size_t>(1) * k.dim + d] = 10.0f * q[static_cast<size_t>(d)];
      rows[static_cast<size_t>(k.s - 1) * k.dim + d] = 10.0f * q[static_cast<size_t>(d)];
    }
  }
  PackedRows packed;
  pack_rows(rows.data(), k.s, k.dim, packed);
  std::vector<int32_t> best(4, -1);
  std::vector<float> dot(4, 0.0f);
  nearest_rows_isa(isa, packed, q.data(), k.n_q, best.data(), dot.data());
  for (int i = 0; i < k.n_q; ++i) {
    std::vector<double> ref(static_cast<size_t>(k.s), 0.0);
    for (int c = 0; c < k.s; ++c) {
      for (int d = 0; d < k.dim; ++d) {
        ref[static_cast<size_t>(c)] += static_cast<double>(q[static_cast<size_t>(i) * k.dim + d]) *
                                       rows[static_cast<size_t>(c) * k.dim + d];
      }
    }
    int arg = 0;
    for (int c = 1; c < k.s; ++c) {
      if (ref[static_cast<size_t>(c)] > ref[static_cast<size_t>(arg)]) arg = c;
    }
    SCOPED_TRACE(::testing::Message()
                 << kernel_isa_name(isa) << " s=" << k.s << " dim=" << k.dim << " q=" << i
                 << " negative=" << negative << " ties=" << ties);
    ASSERT_GE(best[static_cast<size_t>(i)], 0);
    ASSERT_LT(best[static_cast<size_t>(i)], k.s);
    const double tol = 1e-5 * k.dim;
    // The chosen column is a maximum up to float summation order, and its reported dot is its own.
    EXPECT_NEAR(ref[static_cast<size_t>(best[static_cast<size_t>(i)])],
                ref[static_cast<size_t>(arg)], tol);
    EXPECT_NEAR(dot[static_cast<size_t>(i)], ref[static_cast<size_t>(best[static_cast<size_t>(i)])],
                tol);
    if (ties && i == 0 && k.s > 3) {
      EXPECT_EQ(best[0], 1);
    }
  }
}

TEST(PolicyNearest, EveryVariantFindsTheBruteForceMaximum) {
  const NearestCase cases[] = {{1, 64, 1},    {5, 64, 3},   {16, 3, 4},  {31, 64, 4},
                               {32, 128, 2},  {33, 64, 4},  {47, 17, 1}, {100, 64, 4},
                               {257, 128, 3}, {1531, 64, 4}};
  uint32_t seed = 1;
  for (KernelIsa isa : {KernelIsa::kScalar, KernelIsa::kAvx2, KernelIsa::kAvx512}) {
    if (!kernel_isa_available(isa)) continue;
    for (const NearestCase& k : cases) {
      for (bool negative : {false, true}) {
        for (bool ties : {false, true}) check_variant(isa, k, negative, ties, seed++);
      }
    }
  }
}

TEST(PolicyNearest, VariantsAgreeWithTheScalarKernel) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const int s = 613, dim = 128;
  std::vector<float> rows(static_cast<size_t>(s) * dim), q(4 * static_cast<size_t>(dim));
  for (float& x : rows) x = u(rng);
  for (float& x : q) x = u(rng);
  PackedRows packed;
  pack_rows(rows.data(), s, dim, packed);
  int32_t ref_best[4], best[4];
  float ref_dot[4], dot[4];
  nearest_rows_isa(KernelIsa::kScalar, packed, q.data(), 4, ref_best, ref_dot);
  for (KernelIsa isa : {KernelIsa::kAvx2, KernelIsa::kAvx512}) {
    if (!kernel_isa_available(isa)) continue;
    nearest_rows_isa(isa, packed, q.data(), 4, best, dot);
    for (int i = 0; i < 4; ++i) {
      EXPECT_EQ(best[i], ref_best[i]) << kernel_isa_name(isa);
      EXPECT_NEAR(dot[i], ref_dot[i], 1e-4) << kernel_isa_name(isa);
    }
  }
}

// unit_row's definition, written out: the squares summed in double, lane j taking the elements
// d with d % 8 == j in order, the lanes added pairwise; out = row * (float)(scale / sqrt(sum)).
std::vector<float> unit_row_reference(const std::vector<float>& row, double scale) {
  double lane[8] = {};
  for (size_t d = 0; d < row.size(); ++d) lane[d % 8] += static_cast<double>(row[d]) * row[d];
  const double n2 =
      ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
  const float f = n2 > 0.0 ? static_cast<float>(scale / std::sqrt(n2)) : 0.0f;
  std::vector<float> out(row.size());
  for (size_t d = 0; d < row.size(); ++d) out[d] = row[d] * f;
  return out;
}

TEST(PolicyNearest, UnitRowVariantsGiveTheBitsOfTheDefinition) {
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  for (int dim : {1, 7, 8, 15, 16, 17, 24, 64, 72, 100, 128, 256}) {
    for (int zero : {0, 1}) {
      std::vector<uint16_t> h(static_cast<size_t>(dim));
      for (uint16_t& x : h) x = zero ? 0 : fp32_to_fp16(nd(rng));
      std::vector<float> row(h.size());
      for (size_t d = 0; d < h.size(); ++d) row[d] = fp16_to_fp32(h[d]);
      for (double scale : {1.0, 0.5}) {
        const std::vector<float> want = unit_row_reference(row, scale);
        std::vector<float> got(h.size(), -1.0f);
        unit_row(row.data(), dim, scale, got.data());
        EXPECT_EQ(0, std::memcmp(got.data(), want.data(), want.size() * sizeof(float)))
            << "unit_row dim=" << dim;
        for (KernelIsa isa : {KernelIsa::kScalar, KernelIsa::kAvx2, KernelIsa::kAvx512}) {
          if (!kernel_isa_available(isa)) continue;
          std::fill(got.begin(), got.end(), -1.0f);
          unit_row_f16_isa(isa, h.data(), dim, scale, got.data());
          EXPECT_EQ(0, std::memcmp(got.data(), want.data(), want.size() * sizeof(float)))
              << kernel_isa_name(isa) << " dim=" << dim << " zero=" << zero;
          if (zero) {
            EXPECT_EQ(got[0], 0.0f);
          }
        }
      }
    }
  }
}

// The definition, written out: s_i = 0 + (f * dot_i) * inv_i, the first i of the running maximum
// (a later s_i replaces it only when strictly greater).
int running_max(const std::vector<float>& dot, const std::vector<float>& inv, float f,
                float* best) {
  int b = 0;
  float bs = 0.0f + f * dot[0] * inv[0];
  for (size_t i = 1; i < dot.size(); ++i) {
    const float s = 0.0f + f * dot[i] * inv[i];
    if (s > bs) {
      bs = s;
      b = static_cast<int>(i);
    }
  }
  *best = bs;
  return b;
}

TEST(PolicyNearest, ScaledArgmaxVariantsGiveTheRunningMaximum) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  int checked = 0;
  for (int n : {1, 2, 7, 8, 9, 15, 16, 17, 31, 33, 102, 1638}) {
    // 0: random; 1: ties of the maximum at several places; 2: all zero (+0 and -0, zero inverse
    // norms); 3: NaN at index 0; 4: NaN and -inf later; 5: every value equal.
    for (int pattern = 0; pattern < 6; ++pattern) {
      std::vector<float> dot(static_cast<size_t>(n)), inv(static_cast<size_t>(n));
      for (int i = 0; i < n; ++i) {
        dot[static_cast<size_t>(i)] = u(rng);
        inv[static_cast<size_t>(i)] = std::abs(u(rng));
      }
      if (pattern == 1) {
        for (int i : {n / 3, n - 1, n / 2, 5, 17}) {
          if (i < n) dot[static_cast<size_t>(i)] = 2.0f, inv[static_cast<size_t>(i)] = 1.0f;
        }
      } else if (pattern == 2) {
        for (int i = 0; i < n; ++i) {
          dot[static_cast<size_t>(i)] = i % 3 == 0 ? -0.0f : 0.0f;
          if (i % 2) inv[static_cast<size_t>(i)] = 0.0f;
        }
      } else if (pattern == 3) {
        dot[0] = nan;
      } else if (pattern == 4) {
        for (int i = 1; i < n; i += 3) dot[static_cast<size_t>(i)] = i % 2 ? nan : -inf;
      } else if (pattern == 5) {
        std::fill(dot.begin(), dot.end(), 0.5f);
        std::fill(inv.begin(), inv.end(), 0.25f);
      }
      const float f = 0.7f;
      float want_s;
      const int want = running_max(dot, inv, f, &want_s);
      if (pattern == 1 && n > 5) {
        EXPECT_EQ(want, std::min(5, n / 3));  // the first of the tied maxima
      }
      for (KernelIsa isa : {KernelIsa::kScalar, KernelIsa::kAvx2, KernelIsa::kAvx512}) {
        if (!kernel_isa_available(isa)) continue;
        SCOPED_TRACE(std::string(kernel_isa_name(isa)) + " n " + std::to_string(n) +
                     " pattern " + std::to_string(pattern));
        float got_s = 1.0f;
        const int got = scaled_argmax_isa(isa, dot.data(), inv.data(), n, f, &got_s);
        EXPECT_EQ(got, want);
        EXPECT_EQ(std::memcmp(&got_s, &want_s, sizeof(float)), 0) << got_s << " vs " << want_s;
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 0);
}

}  // namespace
}  // namespace d2o
