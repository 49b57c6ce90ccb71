// RMSNorm and SwiGLU at every kernel level against double-precision references, on odd lengths
// (vector tails), extreme gate values (exp overflow and underflow) and aliased outputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "ops/ops.h"
#include "unit/unit_helpers.h"

namespace d2o {
namespace {

double ulp_distance(float a, float b) {
  if (a == b) return 0.0;
  return std::abs(static_cast<double>(a) - b) /
         std::max(std::numeric_limits<float>::denorm_min(),
                  std::nextafter(std::abs(b), INFINITY) - std::abs(b));
}

TEST(Ops, SwigluEveryLevelNearDoubleReference) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 4.0f);
  for (const int n : {1, 7, 8, 15, 16, 17, 33, 1536}) {
    std::vector<float> g(static_cast<size_t>(n)), u(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) {
      g[static_cast<size_t>(i)] = nd(rng);
      u[static_cast<size_t>(i)] = nd(rng);
    }
    // Extremes: exp(-g) overflows (g very negative) or vanishes (g very positive).
    const float extremes[] = {-200.0f, -100.0f, -88.5f, -87.0f, 0.0f, -0.0f, 88.0f, 100.0f, 300.0f};
    for (int i = 0; i < n && i < 9; ++i) g[static_cast<size_t>(i * n / 9)] = extremes[i];
    for (KernelIsa isa : test::available_isas()) {
      std::vector<float> y(static_cast<size_t>(n));
      swiglu_isa(isa, g.data(), u.data(), n, y.data());
      for (int i = 0; i < n; ++i) {
        const double gd = g[static_cast<size_t>(i)];
        const double ref = gd / (1.0 + std::exp(-gd)) * u[static_cast<size_t>(i)];
        const float got = y[static_cast<size_t>(i)];
        ASSERT_TRUE(std::isfinite(got)) << kernel_isa_name(isa) << " n=" << n << " g=" << gd;
        if (std::abs(ref) < 1e-30) {
          EXPECT_LT(std::abs(got), 1e-30) << kernel_isa_name(isa) << " g=" << gd;
        } else {
          EXPECT_LE(ulp_distance(got, static_cast<float>(ref)), 8.0)
              << kernel_isa_name(isa) << " n=" << n << " i=" << i << " g=" << gd;
        }
      }
      // In place (y aliasing gate), as the engine calls it.
      std::vector<float> inplace = g;
      swiglu_isa(isa, inplace.data(), u.data(), n, inplace.data());
      EXPECT_EQ(inplace, y) << kernel_isa_name(isa);
    }
  }
}

// One query's softmax added to running sums, at every level: within float rounding of the
// double-precision softmax, on odd lengths, with logits far below the maximum (exp underflow).
TEST(Ops, SoftmaxAddEveryLevelNearDoubleReference) {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  for (const int n : {1, 7, 8, 15, 16, 17, 33, 700}) {
    std::vector<float> l(static_cast<size_t>(n)), base(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) {
      l[static_cast<size_t>(i)] = nd(rng);
      base[static_cast<size_t>(i)] = std::abs(nd(rng));
    }
    if (n > 2) l[1] = l[0] - 200.0f;  // exp underflows to 0
    const double m = *std::max_element(l.begin(), l.end());
    double z = 0;
    for (float x : l) z += std::exp(x - m);
    for (KernelIsa isa : test::available_isas()) {
      std::vector<float> acc = base, work = l;
      softmax_add_isa(isa, work.data(), n, acc.data());
      double total = 0;
      for (int i = 0; i < n; ++i) {
        const double p = std::exp(l[static_cast<size_t>(i)] - m) / z;
        const double got = acc[static_cast<size_t>(i)] - base[static_cast<size_t>(i)];
        total += got;
        EXPECT_NEAR(got, p, 1e-6 + 1e-5 * p) << kernel_isa_name(isa) << " n=" << n << " i=" << i;
      }
      EXPECT_NEAR(total, 1.0, 1e-4) << kernel_isa_name(isa) << " n=" << n;
    }
  }
}

// A query's log-sum-exp over some keys, and its attention over them as part of a softmax that
// also spans keys whose log-sum-exp is given (none: -inf, the plain softmax), at every level:
// within float rounding of double precision.
TEST(Ops, SoftmaxAddLseEveryLevelNearDoubleReference) {
  std::mt19937 rng(6);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  const float inf = std::numeric_limits<float>::infinity();
  for (const int n : {1, 7, 16, 17, 700}) {
    std::vector<float> l(static_cast<size_t>(n)), base(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) {
      l[static_cast<size_t>(i)] = nd(rng);
      base[static_cast<size_t>(i)] = std::abs(nd(rng));
    }
    const double m = *std::max_element(l.begin(), l.end());
    double z = 0;
    for (float x : l) z += std::exp(x - m);
    const double lse = m + std::log(z);
    for (const float other : {-inf, -30.0f, 0.0f, static_cast<float>(lse) + 2.0f, 80.0f}) {
      const double total = other == -inf ? lse : std::log(std::exp(lse) + std::exp(double(other)));
      for (KernelIsa isa : test::available_isas()) {
        std::vector<float> acc = base, work = l;
        const float got_lse = softmax_add_lse_isa(isa, work.data(), n, other, acc.data());
        EXPECT_NEAR(got_lse, lse, 1e-5 * (1 + std::abs(lse))) << kernel_isa_name(isa);
        double share = 0;
        for (int i = 0; i < n; ++i) {
          const double p = std::exp(l[static_cast<size_t>(i)] - total);
          const double got = acc[static_cast<size_t>(i)] - base[static_cast<size_t>(i)];
          share += got;
          EXPECT_NEAR(got, p, 1e-6 + 1e-5 * p)
              << kernel_isa_name(isa) << " n=" << n << " other=" << other << " i=" << i;
        }
        EXPECT_NEAR(share, std::exp(lse - total), 1e-4) << kernel_isa_name(isa) << " n=" << n;
        // Without running sums: the log-sum-exp alone.
        work = l;
        EXPECT_EQ(softmax_add_lse_isa(isa, work.data(), n, other, nullptr), got_lse);
      }
    }
  }
}

TEST(Ops, GegluTanhEveryLevelNearDoubleReference) {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  for (const int n : {1, 7, 8, 15, 16, 17, 33, 2048}) {
    std::vector<float> g(static_cast<size_t>(n)), u(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) {
      g[static_cast<size_t>(i)] = nd(rng);
      u[static_cast<size_t>(i)] = nd(rng);
    }
    // Extremes: the exponent clamps (g very negative) or the exp vanishes (g very positive).
    const float extremes[] = {-300.0f, -12.0f, -10.0f, -5.0f, 0.0f, -0.0f, 10.0f, 100.0f, 300.0f};
    for (int i = 0; i < n && i < 9; ++i) g[static_cast<size_t>(i * n / 9)] = extremes[i];
    for (KernelIsa isa : test::available_isas()) {
      std::vector<float> y(static_cast<size_t>(n));
      geglu_tanh_isa(isa, g.data(), u.data(), n, y.data());
      for (int i = 0; i < n; ++i) {
        // GELU's tanh form in double, 0.5 g (1 + tanh(t)) = g sigmoid(2t) (the sigmoid form, so
        // that 1 + tanh(t) does not cancel for very negative g).
        const double gd = g[static_cast<size_t>(i)];
        const double t = std::sqrt(2.0 / M_PI) * (gd + 0.044715 * gd * gd * gd);
        const double gelu = gd / (1.0 + std::exp(-2.0 * t));
        const double ref = gelu * u[static_cast<size_t>(i)];
        const float got = y[static_cast<size_t>(i)];
        ASSERT_TRUE(std::isfinite(got)) << kernel_isa_name(isa) << " n=" << n << " g=" << gd;
        if (std::abs(ref) < 1e-30) {
          EXPECT_LT(std::abs(got), 1e-30) << kernel_isa_name(isa) << " g=" << gd;
        } else {
          // The exponent -2t is formed in float with four roundings (g^2, two products, a sum),
          // each up to 2^-24 of it: exp turns that into a relative error of up to |2t| 2^-22,
          // i.e. |2t| * 4 ulps, on top of the rest (tiny values: g / e^|2t|).
          EXPECT_LE(ulp_distance(got, static_cast<float>(ref)), 16.0 + 8.0 * std::fabs(t))
              << kernel_isa_name(isa) << " n=" << n << " i=" << i << " g=" << gd;
        }
      }
      std::vector<float> inplace = g;
      geglu_tanh_isa(isa, inplace.data(), u.data(), n, inplace.data());
      EXPECT_EQ(inplace, y) << kernel_isa_name(isa);
    }
  }
}

TEST(Ops, RmsnormEveryLevelNearDoubleReference) {
  std::mt19937 rng(4);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (const int n : {1, 5, 8, 16, 31, 576, 4099}) {
    std::vector<float> x(static_cast<size_t>(n)), w(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) {
      x[static_cast<size_t>(i)] = nd(rng) * 30.0f;
      w[static_cast<size_t>(i)] = 1.0f + 0.1f * nd(rng);
    }
    double ss = 0.0;
    for (float v : x) ss += static_cast<double>(v) * v;
    const double scale = 1.0 / std::sqrt(ss / n + 1e-5);
    std::vector<float> y0;
    for (KernelIsa isa : test::available_isas()) {
      std::vector<float> y(static_cast<size_t>(n));
      rmsnorm_isa(isa, x.data(), w.data(), 1e-5f, n, y.data());
      for (int i = 0; i < n; ++i) {
        const double ref = x[static_cast<size_t>(i)] * scale * w[static_cast<size_t>(i)];
        EXPECT_LE(ulp_distance(y[static_cast<size_t>(i)], static_cast<float>(ref)), 2.0)
            << kernel_isa_name(isa) << " n=" << n << " i=" << i;
      }
      if (y0.empty()) y0 = y;
      // Sums of squares in double: the float results of all levels agree here.
      EXPECT_EQ(y, y0) << kernel_isa_name(isa) << " n=" << n;
      std::vector<float> inplace = x;
      rmsnorm_isa(isa, inplace.data(), w.data(), 1e-5f, n, inplace.data());
      EXPECT_EQ(inplace, y) << kernel_isa_name(isa);
    }
  }
}

}  // namespace
// The delta rule's step at every kernel level against the scalar reference, on odd sizes and
// misaligned rows, several tokens in a row (the state carries rounding from one to the next).
TEST(Ops, DeltaRuleStepEveryLevelNearScalar) {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (const int n : {1, 7, 16, 33, 128}) {
    const size_t nn = static_cast<size_t>(n) * n;
    std::vector<float> q(static_cast<size_t>(n) + 1), k(q.size()), v(q.size()), m0(nn + 1);
    for (auto* x : {&q, &k, &v, &m0})
      for (float& e : *x) e = nd(rng) * 0.3f;
    std::vector<float> ref_o(static_cast<size_t>(n));
    DeltaRuleToken t;
    t.q = q.data() + 1;  // misaligned
    t.k = k.data() + 1;
    t.v = v.data() + 1;
    t.beta = 0.7f;
    t.scale = 1.0f / std::sqrt(static_cast<float>(n));
    for (KernelIsa isa : test::available_isas()) {
      std::vector<float> m = m0, o(static_cast<size_t>(n) + 1), want_m(m0.begin() + 1, m0.end());
      for (int step = 0; step < 3; ++step) {
        t.decay = 0.9f - 0.1f * static_cast<float>(step);
        delta_rule_step_isa(KernelIsa::kScalar, want_m.data(), t, n, ref_o.data());
        delta_rule_step_isa(isa, m.data() + 1, t, n, o.data() + 1);
        for (int j = 0; j < n; ++j)
          EXPECT_NEAR(o[static_cast<size_t>(j) + 1], ref_o[static_cast<size_t>(j)], 1e-5f)
              << kernel_isa_name(isa) << " n=" << n << " j=" << j;
      }
      for (size_t i = 0; i < nn; ++i)
        ASSERT_NEAR(m[i + 1], want_m[i], 1e-5f) << kernel_isa_name(isa) << " n=" << n;
    }
  }
}

}  // namespace d2o
