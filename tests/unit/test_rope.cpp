// RoPE (src/ops: rope_tables, rope_apply_tables, rope_apply) against a double-precision
// reference written from the formula: both layouts, partial rotation, linear position scaling and
// Llama 3.1's per-pair frequency factors, fractional and long positions. RoPE has one
// implementation (plain loops, no per-ISA kernels), so there is no other level to compare.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "common/random_model.h"
#include "ops/ops.h"

namespace d2o {
namespace {

// Pair i of every head turns by freq_scale * pos * base^(-2i/n_rot) / ff[i]; kNorm pairs
// (2i, 2i+1), kNeox pairs (i, i + n_rot/2); dimensions from n_rot on stay.
std::vector<double> reference(const RopeParams& p, double pos, int n_head,
                              const std::vector<float>& x) {
  std::vector<double> y(x.begin(), x.end());
  const int half = p.n_rot / 2;
  for (int h = 0; h < n_head; ++h) {
    double* v = y.data() + static_cast<size_t>(h) * p.head_dim;
    for (int i = 0; i < half; ++i) {
      const double ff = p.freq_factors ? p.freq_factors[i] : 1.0;
      const double th =
          p.freq_scale * pos * std::pow(static_cast<double>(p.freq_base), -2.0 * i / p.n_rot) / ff;
      const int a = p.type == RopeType::kNorm ? 2 * i : i;
      const int b = p.type == RopeType::kNorm ? 2 * i + 1 : i + half;
      const double x0 = v[a], x1 = v[b];
      v[a] = x0 * std::cos(th) - x1 * std::sin(th);
      v[b] = x0 * std::sin(th) + x1 * std::cos(th);
    }
  }
  return y;
}

std::vector<float> random_heads(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = u(rng);
  return x;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<double>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

// The float table's angle error grows with the position (the angle is built by repeated float
// multiplication, as llama.cpp builds it): tolerance for |x| <= 1.
double tolerance(double pos) { return 2e-6 + 4e-7 * pos; }

constexpr int kHeadDim = 64, kRopeHeads = 3;
const std::vector<float>& llama31_factors() {
  // The converter's formula for Llama 3.1 (factor 8, low 1, high 4, original context 8192) with
  // base 500000: 1 for the high frequencies, 8 for the low ones, a blend between.
  static const std::vector<float> ff =
      test::llama3_rope_freqs(kHeadDim, 500000.0, 8.0, 1.0, 4.0, 8192.0);
  return ff;
}

TEST(Rope, EveryVariantMatchesADoubleReference) {
  const std::vector<float>& ff = llama31_factors();
  int n_checked = 0;
  for (RopeType type : {RopeType::kNorm, RopeType::kNeox})
  for (int n_rot : {kHeadDim, kHeadDim / 2})
  for (float freq_scale : {1.0f, 0.25f})
  for (bool factors : {false, true})
  for (double pos : {0.0, 1.0, 17.0, 255.5, 4000.0, 20000.0}) {
    RopeParams p;
    p.type = type;
    p.head_dim = kHeadDim;
    p.n_rot = n_rot;
    p.freq_base = 500000.0f;
    p.freq_scale = freq_scale;
    p.freq_factors = factors ? ff.data() : nullptr;
    SCOPED_TRACE(::testing::Message() << (type == RopeType::kNorm ? "norm" : "neox") << " n_rot "
                                      << n_rot << " scale " << freq_scale << " factors "
                                      << factors << " pos " << pos);
    const std::vector<float> x =
        random_heads(kHeadDim * kRopeHeads, static_cast<uint32_t>(n_checked));
    std::vector<float> y = x;
    rope_apply(p, static_cast<float>(pos), kRopeHeads, y.data());
    EXPECT_LE(max_abs_diff(y, reference(p, pos, kRopeHeads, x)), tolerance(pos));
    // Unrotated dimensions are left exactly as they were.
    for (int h = 0; h < kRopeHeads; ++h)
      for (int d = n_rot; d < kHeadDim; ++d)
        EXPECT_EQ(y[static_cast<size_t>(h * kHeadDim + d)],
                  x[static_cast<size_t>(h * kHeadDim + d)]);
    ++n_checked;
  }
  EXPECT_EQ(n_checked, 2 * 2 * 2 * 2 * 6);
}

// The comparison above can fail: at a position past the shortest scaled wavelength, rotating
// without the factors (or with a wrong linear scale) is far outside the tolerance.
TEST(Rope, TheReferenceComparisonSeesMissingFactorsAndScales) {
  RopeParams p;
  p.type = RopeType::kNorm;
  p.head_dim = kHeadDim;
  p.n_rot = kHeadDim;
  p.freq_base = 500000.0f;
  p.freq_factors = llama31_factors().data();
  const double pos = 4000.0;
  const std::vector<float> x = random_heads(kHeadDim * kRopeHeads, 7);
  const std::vector<double> want = reference(p, pos, kRopeHeads, x);
  RopeParams no_factors = p;
  no_factors.freq_factors = nullptr;
  std::vector<float> y = x;
  rope_apply(no_factors, static_cast<float>(pos), kRopeHeads, y.data());
  EXPECT_GT(max_abs_diff(y, want), 100 * tolerance(pos));
  RopeParams scaled = p;
  scaled.freq_scale = 0.5f;
  y = x;
  rope_apply(scaled, static_cast<float>(pos), kRopeHeads, y.data());
  EXPECT_GT(max_abs_diff(y, want), 100 * tolerance(pos));
}

// The table's float roundings are llama.cpp's (ggml_rope_cache_init): theta = pos, times
// base^(-2/n_rot) once per pair; angle = freq_scale * (theta / factor). Same bits, so that a
// RoPE-scaled model's keys are the reference's to the last bit, not only within tolerance.
TEST(Rope, TablesFollowTheReferenceRoundingOrder) {
  for (float freq_scale : {1.0f, 0.125f, 0.3f}) {
    RopeParams p;
    p.head_dim = kHeadDim;
    p.n_rot = kHeadDim;
    p.freq_base = 500000.0f;
    p.freq_scale = freq_scale;
    p.freq_factors = llama31_factors().data();
    for (float pos : {3.0f, 1234.0f, 77777.0f}) {
      float cos_t[kRopeMaxPairs], sin_t[kRopeMaxPairs];
      rope_tables(p, pos, cos_t, sin_t);
      const float theta_scale = std::pow(p.freq_base, -2.0f / static_cast<float>(p.n_rot));
      float theta = pos;
      for (int i = 0; i < kHeadDim / 2; ++i) {
        const float t = freq_scale * (theta / p.freq_factors[i]);
        EXPECT_EQ(cos_t[i], std::cos(t)) << "pair " << i << " pos " << pos;
        EXPECT_EQ(sin_t[i], std::sin(t)) << "pair " << i << " pos " << pos;
        theta *= theta_scale;
      }
    }
  }
}

// rope_apply is rope_tables + rope_apply_tables (the forward pass shares one table per token
// between queries and keys), and rotating by a then by b is rotating by a + b (the KV policies
// re-rotate kept keys by a position delta with the model's RoPE, factors included).
TEST(Rope, TablesAndRerotationAgree) {
  RopeParams p;
  p.type = RopeType::kNeox;
  p.head_dim = kHeadDim;
  p.n_rot = kHeadDim;
  p.freq_base = 500000.0f;
  p.freq_factors = llama31_factors().data();
  const std::vector<float> x = random_heads(kHeadDim * kRopeHeads, 11);
  std::vector<float> a = x, b = x;
  rope_apply(p, 300.0f, kRopeHeads, a.data());
  float cos_t[kRopeMaxPairs], sin_t[kRopeMaxPairs];
  rope_tables(p, 300.0f, cos_t, sin_t);
  rope_apply_tables(p, cos_t, sin_t, kRopeHeads, b.data());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);

  std::vector<float> twice = x;
  rope_apply(p, 1000.0f, kRopeHeads, twice.data());
  rope_apply(p, -250.0f, kRopeHeads, twice.data());
  EXPECT_LE(max_abs_diff(twice, reference(p, 750.0, kRopeHeads, x)), 2 * tolerance(1000.0));
}

}  // namespace
}  // namespace d2o
