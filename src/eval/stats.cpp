#include "eval/stats.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

namespace d2o::eval {

MeanSe mean_se(std::span<const double> x) {
  MeanSe r;
  r.n = static_cast<int64_t>(x.size());
  if (x.empty()) return r;
  double s = 0;
  for (double v : x) s += v;
  r.mean = s / static_cast<double>(x.size());
  if (x.size() < 2) return r;
  // Two-pass variance: no cancellation when the mean is large relative to the spread.
  double ss = 0;
  for (double v : x) ss += (v - r.mean) * (v - r.mean);
  const double var = ss / static_cast<double>(x.size() - 1);
  r.se = std::sqrt(var / static_cast<double>(x.size()));
  return r;
}

MeanSe batch_means_se(std::span<const double> x, int block) {
  MeanSe r;
  r.n = static_cast<int64_t>(x.size());
  if (x.empty()) return r;
  double s = 0;
  for (double v : x) s += v;
  r.mean = s / static_cast<double>(x.size());
  if (block < 1) block = 1;
  const size_t n_blocks = x.size() / static_cast<size_t>(block);
  if (n_blocks < 2) return r;
  // Block means weighted by their lengths (the last block absorbs the remainder), so that the
  // weighted mean of the block means is exactly the overall mean.
  std::vector<double> means(n_blocks), weights(n_blocks);
  for (size_t b = 0; b < n_blocks; ++b) {
    const size_t begin = b * static_cast<size_t>(block);
    const size_t end = b + 1 == n_blocks ? x.size() : begin + static_cast<size_t>(block);
    double bs = 0;
    for (size_t i = begin; i < end; ++i) bs += x[i];
    weights[b] = static_cast<double>(end - begin);
    means[b] = bs / weights[b];
  }
  // Var(mean) ~= sum w_b^2 (m_b - m)^2 / (N^2) * B / (B - 1)  (ratio-estimator form).
  double acc = 0;
  for (size_t b = 0; b < n_blocks; ++b) {
    const double d = means[b] - r.mean;
    acc += weights[b] * weights[b] * d * d;
  }
  const double nb = static_cast<double>(n_blocks);
  const double n = static_cast<double>(x.size());
  r.se = std::sqrt(acc / (n * n) * nb / (nb - 1.0));
  return r;
}

uint64_t SplitMix64::next() {
  uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t SplitMix64::below(uint64_t n) {
  // Reject the top partial range so every residue is equally likely.
  const uint64_t limit = UINT64_MAX - UINT64_MAX % n;
  uint64_t v;
  do v = next();
  while (v >= limit);
  return v % n;
}

Interval bootstrap_mean_ci(std::span<const double> x, int n_resamples, double level,
                           uint64_t seed) {
  Interval iv;
  if (x.empty()) return iv;
  if (x.size() == 1 || n_resamples < 1) {
    iv.lo = iv.hi = x[0];
    if (x.size() > 1) iv.lo = iv.hi = mean_se(x).mean;
    return iv;
  }
  SplitMix64 rng(seed);
  std::vector<double> means(static_cast<size_t>(n_resamples));
  const uint64_t n = x.size();
  for (double& m : means) {
    double s = 0;
    for (uint64_t i = 0; i < n; ++i) s += x[rng.below(n)];
    m = s / static_cast<double>(n);
  }
  std::sort(means.begin(), means.end());
  const double a = (1.0 - level) / 2.0;
  // Percentiles by the nearest-rank rule on the sorted resample means.
  auto at = [&](double q) {
    const double idx = q * static_cast<double>(n_resamples - 1);
    return means[static_cast<size_t>(
        std::clamp(std::lround(idx), 0l, static_cast<long>(n_resamples - 1)))];
  };
  iv.lo = at(a);
  iv.hi = at(1.0 - a);
  return iv;
}

Interval wilson_interval(int64_t k, int64_t n, double z) {
  if (n <= 0) return {0.0, 1.0};
  const double nn = static_cast<double>(n);
  const double p = static_cast<double>(k) / nn;
  const double z2 = z * z;
  const double denom = 1.0 + z2 / nn;
  const double centre = (p + z2 / (2.0 * nn)) / denom;
  const double half = z * std::sqrt(p * (1.0 - p) / nn + z2 / (4.0 * nn * nn)) / denom;
  return {std::max(0.0, centre - half), std::min(1.0, centre + half)};
}

std::string paired_verdict(double favour, double se, int64_t n) {
  if (std::isnan(favour)) return "-";
  if (se > 0 && favour > 2 * se) return "**wins**";
  if (se > 0 && favour < -2 * se) return "**loses**";
  if (se > 0) return "ties";
  if (favour == 0) return "ties (identical)";
  if (n < 2) return "not resolved (one pair: no standard error)";
  const double p = 2.0 * std::pow(0.5, static_cast<double>(n));
  char buf[96];
  if (p < 0.0455) {
    std::snprintf(buf, sizeof buf, " (all %lld pairs, sign test p = %.2g)",
                  static_cast<long long>(n), p);
    return std::string(favour > 0 ? "**wins**" : "**loses**") + buf;
  }
  std::snprintf(buf, sizeof buf,
                "not resolved (all %lld pairs differ alike; sign test p = %.2g)",
                static_cast<long long>(n), p);
  return buf;
}

uint64_t cell_seed(uint64_t run_seed, uint64_t cell) {
  constexpr uint64_t kSpread = 0x9E3779B97F4A7C15ull;
  SplitMix64 mix(cell ^ 1u ^ ((run_seed - 1u) * kSpread));
  return mix.next();
}

}  // namespace d2o::eval
