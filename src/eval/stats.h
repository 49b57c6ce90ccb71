// Uncertainty for the evaluation harness: every figure the harness reports carries one of these.
//
//  - mean_se: mean and standard error of independent samples (fidelity: over prompt samples).
//  - batch_means_se: standard error of the mean of an autocorrelated series (per-token NLLs along
//    a text) by the method of batch means: the series is cut into consecutive blocks, and the
//    spread of the block means gives the standard error. Neighbouring tokens' losses are
//    correlated, so the naive sd/sqrt(n) would understate the uncertainty.
//  - bootstrap_mean_ci: percentile bootstrap interval of a mean, with a fixed seed (deterministic).
//  - wilson_interval: binomial confidence interval for an accuracy (k successes out of n).
#pragma once

#include <cstdint>
#include <span>
#include <string>

namespace d2o::eval {

struct MeanSe {
  double mean = 0;
  double se = 0;  // standard error of the mean (0 when fewer than 2 samples)
  int64_t n = 0;
};

struct Interval {
  double lo = 0;
  double hi = 0;
};

// Mean and standard error sqrt(var / n), var the unbiased sample variance.
MeanSe mean_se(std::span<const double> x);

// Mean of x and its standard error from the means of consecutive blocks of `block` values (the
// last, partial block is folded into the previous one). With fewer than 2 blocks, se = 0.
MeanSe batch_means_se(std::span<const double> x, int block);

// Percentile bootstrap interval of the mean at `level` (e.g. 0.95) from `n_resamples` resamples
// drawn with a splitmix64 generator seeded by `seed`: the same inputs give the same interval.
Interval bootstrap_mean_ci(std::span<const double> x, int n_resamples, double level, uint64_t seed);

// Wilson score interval for a proportion k/n at normal quantile z (1.96 for 95%). n = 0: [0, 1].
Interval wilson_interval(int64_t k, int64_t n, double z);

// The verdict on a paired difference `favour` (positive favours the method under test) with
// standard error `se` over `n` pairs: "**wins**" / "**loses**" beyond two standard errors, "ties"
// within, "ties (identical)" when every pair is equal. When every pair differs by the same
// amount (se = 0, e.g. 6/6 retrievals against 0/6) there is no spread to scale by; then the
// two-sided sign test decides: resolved when 2 * 0.5^n < 0.0455 (the two-standard-error level),
// i.e. from 6 pairs on, with the p-value in the verdict.
std::string paired_verdict(double favour, double se, int64_t n);

// splitmix64: a small, fast, well-mixed generator; the harness's only source of randomness.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t next();
  // Uniform integer in [0, n), n > 0 (rejection sampling, unbiased).
  uint64_t below(uint64_t n);

 private:
  uint64_t state_;
};

// The seed of one cell of a run (a task, length, depth and trial packed into `cell` by the
// caller): the run's seed times an odd 64-bit constant, so that it reaches bits no cell key
// uses and two seeds give different trials (a seed XORed in as it is made seed 2's trials those
// of seed 1 in another order). Seed 1 gives the cells it always gave.
uint64_t cell_seed(uint64_t run_seed, uint64_t cell);

}  // namespace d2o::eval
