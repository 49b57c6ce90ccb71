// Sampler: greedy picks the first maximum (checked against std::max_element on rows with ties and
// odd lengths), and a request's random stream survives being swapped in and out of a shared
// Sampler (set_stream / rng_state), as the scheduler does.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include "runtime/sampler.h"

namespace d2o {
namespace {

TEST(Sampler, GreedyIsTheFirstMaximum) {
  std::mt19937 rng(3);
  for (int n : {1, 2, 15, 16, 17, 31, 33, 100, 49152}) {
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<float> l(static_cast<size_t>(n));
      // Few distinct values, so ties are common; sometimes -inf everywhere but one.
      for (float& x : l) x = static_cast<float>(static_cast<int>(rng() % 7)) - 3.0f;
      if (trial % 5 == 0) {
        std::fill(l.begin(), l.end(), -INFINITY);
        l[rng() % static_cast<uint32_t>(n)] = -1.0f;
      }
      Sampler s(SamplerParams{}, n);
      EXPECT_EQ(s.sample(l.data(), {}), std::max_element(l.begin(), l.end()) - l.begin()) << n;
    }
  }
}

TEST(Sampler, RepetitionPenaltyStillApplies) {
  std::vector<float> l = {1.0f, 2.0f, 1.9f};
  SamplerParams p;
  p.repeat_penalty = 1.5f;
  Sampler s(p, 3);
  const std::vector<int32_t> hist = {1};
  EXPECT_EQ(s.sample(l.data(), hist), 2);  // 2.0 / 1.5 < 1.9
  EXPECT_EQ(s.sample(l.data(), {}), 1);
}

TEST(Sampler, SwappedStreamsDrawLikeOwnSamplers) {
  const int n = 50;
  std::vector<float> l(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) l[static_cast<size_t>(i)] = static_cast<float>((i * 7) % 11) * 0.3f;
  SamplerParams a, b;
  a.temperature = 1.0f;
  a.seed = 1;
  a.top_k = 0;
  a.min_p = 0;
  b = a;
  b.seed = 2;
  b.top_p = 0.8f;
  Sampler own_a(a, n), own_b(b, n), shared(SamplerParams{}, n);
  uint64_t ra = Sampler::initial_rng_state(a.seed), rb = Sampler::initial_rng_state(b.seed);
  int differ = 0;
  for (int step = 0; step < 200; ++step) {
    shared.set_stream(a, ra);
    const int32_t x = shared.sample(l.data(), {});
    ra = shared.rng_state();
    shared.set_stream(b, rb);
    const int32_t y = shared.sample(l.data(), {});
    rb = shared.rng_state();
    EXPECT_EQ(x, own_a.sample(l.data(), {}));
    EXPECT_EQ(y, own_b.sample(l.data(), {}));
    differ += x != y;
  }
  EXPECT_GT(differ, 0);
}

}  // namespace
}  // namespace d2o
