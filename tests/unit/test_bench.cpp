// The llama-bench-style benchmark's logic (src/eval/bench.h): list parsing as llama-bench writes
// lists, the test order, the checks made before anything runs, and run_bench on a random model
// (slot counts and KV bytes against what the policy must keep, repetitions restoring the same
// depth state). Timing figures themselves are never asserted.
#include <gtest/gtest.h>

#include <utility>

#include "common/random_model.h"
#include "common/random_model_fixture.h"
#include "common/test_util.h"
#include "core/thread_pool.h"
#include "eval/bench.h"
#include "kv/policy.h"
#include "model/model.h"
#include "runtime/engine.h"

namespace d2o {
namespace {

bool has(const std::string& s, const std::string& needle) {
  return s.find(needle) != std::string::npos;
}

TEST(BenchIntList, ListsAndRanges) {
  struct Case {
    const char* text;
    std::vector<int> want;
  };
  const std::vector<Case> cases = {
      {"512", {512}},        {"0,2048, 4096 ,8192", {0, 2048, 4096, 8192}},
      {"1-4", {1, 2, 3, 4}}, {"0-8192+4096", {0, 4096, 8192}},
      {"0-10+4", {0, 4, 8}}, {"1-100*10", {1, 10, 100}},
      {"512-512", {512}},    {"1-3,16-64*2", {1, 2, 3, 16, 32, 64}},
  };
  for (const Case& c : cases) {
    auto r = parse_int_list(c.text, "-d", 0, 1 << 20);
    ASSERT_TRUE(r.ok()) << c.text << ": " << r.status().to_string();
    EXPECT_EQ(*r, c.want) << c.text;
  }
}

TEST(BenchIntList, BadListsNameTheFlagAndTheItem) {
  struct Case {
    const char* text;
    const char* needle;
  };
  const std::vector<Case> cases = {
      {"", "empty list"},
      {"1,,2", "is empty"},
      {"x", "'x' is not a non-negative integer"},
      {"-5", "not a valid range"},
      {"1.5", "not a non-negative integer"},
      {"8-4", "end is below its start"},
      {"1-8+0", "step >= 1"},
      {"1-8*1", "multiplier >= 2"},
      {"0-8*2", "start >= 1"},
      {"1-8+x", "bad step"},
      {"2000000", "out of range"},
      {"0-100000", "more than 1024 values"},
      {"2-5*4611686018427387904", ""},  // a step that would overflow: no UB, just {2}
  };
  for (const Case& c : cases) {
    auto r = parse_int_list(c.text, "-d", 0, 1 << 20);
    if (std::string(c.needle).empty()) {
      ASSERT_TRUE(r.ok()) << c.text;
      EXPECT_EQ(*r, std::vector<int>{2});
      continue;
    }
    ASSERT_FALSE(r.ok()) << c.text;
    EXPECT_TRUE(has(r.status().message(), "-d")) << r.status().message();
    EXPECT_TRUE(has(r.status().message(), c.needle)) << c.text << ": " << r.status().message();
  }
}

TEST(BenchTests, OrderAndNamesFollowLlamaBench) {
  const std::vector<int> pp = {128, 0, 512}, tg = {0, 64}, depths = {0, 4096};
  const auto tests = make_bench_tests(pp, tg, depths);
  std::vector<std::string> names;
  for (const BenchTest& t : tests) names.push_back(t.name());
  EXPECT_EQ(names, (std::vector<std::string>{"pp128", "pp512", "tg64", "pp128 @ d4096",
                                             "pp512 @ d4096", "tg64 @ d4096"}));
}

TEST(BenchTests, ValidationBeforeAnythingRuns) {
  const std::vector<BenchTest> tests = {{BenchKind::kPrompt, 512, 0}, {BenchKind::kGen, 128, 8192}};
  BenchConfig cfg;
  cfg.n_ctx = 8192;
  Status s = validate_bench_tests(tests, 100000, cfg);
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(has(s.message(), "tg128 @ d8192 needs 8320 tokens of context")) << s.message();
  cfg.n_ctx = 0;  // no limit
  EXPECT_TRUE(validate_bench_tests(tests, 100000, cfg).ok());
  s = validate_bench_tests(tests, 8000, cfg);
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(has(s.message(), "tokens of text but the text has only 8000")) << s.message();
  cfg.repetitions = 0;
  EXPECT_FALSE(validate_bench_tests(tests, 100000, cfg).ok());
  cfg.repetitions = 1;
  EXPECT_FALSE(validate_bench_tests({}, 100000, cfg).ok());
}

class BenchRandomModel : public test::RandomModelSuite<BenchRandomModel> {
 public:
  static test::RandomModelConfig config() {
    test::RandomModelConfig c;
    c.n_layer = 2;
    c.n_head = 4;
    c.n_head_kv = 2;
    c.seed = 5;
    return c;
  }
  static const char* file() { return "bench_random.gguf"; }
};

TEST_F(BenchRandomModel, SlotsAndBytesPerPolicy) {
  ThreadPool pool(2);
  Engine engine(*model_, pool, EngineOptions{});
  const ModelHParams& hp = model_->hparams();
  const std::vector<TokenId> text = test::random_model_tokens(300, hp.n_vocab);
  const std::vector<BenchTest> tests = {{BenchKind::kPrompt, 16, 0},
                                        {BenchKind::kGen, 8, 0},
                                        {BenchKind::kPrompt, 16, 200},
                                        {BenchKind::kGen, 8, 200}};
  BenchConfig cfg;
  cfg.repetitions = 3;
  cfg.kv_type = KvType::kF32;
  // Bytes per slot of one layer and KV head: K and V rows of head_dim floats.
  const size_t row_pair = 2 * static_cast<size_t>(hp.head_dim) * sizeof(float);
  const int64_t heads = int64_t{hp.n_layer} * hp.n_head_kv;
  const int64_t layers = hp.n_layer;  // slot counts are per KV head, summed over layers

  for (const char* spec : {"full", "h2o:ratio=0.25"}) {
    SCOPED_TRACE(spec);
    auto policy = parse_kv_policy(spec);
    ASSERT_TRUE(policy.ok());
    const bool full = std::string(spec) == "full";
    std::vector<BenchResult> got;
    const std::shared_ptr<const KvPolicy> shared = std::move(policy).value();
    const Status s = run_bench(engine, text, tests, shared, cfg,
                               [&](const BenchResult& r) { got.push_back(r); });
    ASSERT_TRUE(s.ok()) << s.to_string();
    ASSERT_EQ(got.size(), tests.size());
    for (size_t i = 0; i < got.size(); ++i) {
      const BenchResult& r = got[i];
      const BenchTest& t = tests[i];
      SCOPED_TRACE(t.name());
      EXPECT_EQ(r.test.name(), t.name());
      ASSERT_EQ(r.seconds.size(), 3u);
      EXPECT_GT(r.tps_mean, 0.0);
      EXPECT_GE(r.tps_stddev, 0.0);
      // A full cache of depth + n tokens, whatever the policy kept.
      EXPECT_EQ(r.kv_bytes_full, static_cast<size_t>(heads * (t.depth + t.n)) * row_pair);
      EXPECT_LE(r.kv_bytes_used, r.kv_bytes);
      EXPECT_EQ(r.kv_bytes_used, static_cast<size_t>(r.slots * hp.n_head_kv) * row_pair);
      if (t.depth == 0) {
        EXPECT_EQ(r.slots_after_depth, 0);
        EXPECT_EQ(r.depth_seconds, 0.0);
      } else {
        EXPECT_GT(r.depth_seconds, 0.0);
      }
      if (full) {
        EXPECT_EQ(r.slots_after_depth, layers * t.depth);
        EXPECT_EQ(r.slots, layers * (t.depth + t.n));
        // No more than the longest test at this depth needs (pp16 at depth 200):
        // the depth prefill's geometric growth is not carried into the timed runs.
        if (t.depth > 0) {
          EXPECT_LE(r.kv_bytes, static_cast<size_t>(heads * (t.depth + 16)) * row_pair);
        }
      } else if (t.depth > 0) {
        // H2O at 25% of the 200-token depth keeps 50 slots per head and holds that budget
        // while the timed tokens arrive (the repetitions restore the same compressed state).
        EXPECT_EQ(r.slots_after_depth, layers * 50);
        EXPECT_EQ(r.slots, layers * 50);
      }
    }
  }
}

TEST_F(BenchRandomModel, InterleavedRunsGiveEachPolicyItsOwnState) {
  ThreadPool pool(2);
  Engine engine(*model_, pool, EngineOptions{});
  const ModelHParams& hp = model_->hparams();
  const std::vector<TokenId> text = test::random_model_tokens(300, hp.n_vocab);
  const std::vector<BenchTest> tests = {
      {BenchKind::kGen, 8, 0}, {BenchKind::kPrompt, 16, 200}, {BenchKind::kGen, 8, 200}};
  BenchConfig cfg;
  cfg.repetitions = 3;
  cfg.kv_type = KvType::kF32;
  std::vector<std::shared_ptr<const KvPolicy>> policies;
  for (const char* spec : {"full", "h2o:ratio=0.25", "d2o:ratio=0.25"}) {
    auto p = parse_kv_policy(spec);
    ASSERT_TRUE(p.ok());
    policies.emplace_back(std::move(p).value());
  }
  std::vector<std::pair<size_t, BenchResult>> got;
  const Status s =
      run_bench_interleaved(engine, text, tests, policies, cfg,
                            [&](size_t ip, const BenchResult& r) { got.emplace_back(ip, r); });
  ASSERT_TRUE(s.ok()) << s.to_string();
  ASSERT_EQ(got.size(), tests.size() * policies.size());
  // Per test, every policy in order; each holds what it holds when run alone.
  for (size_t ip = 0; ip < policies.size(); ++ip) {
    std::vector<BenchResult> alone;
    ASSERT_TRUE(run_bench(engine, text, tests, policies[ip], cfg, [&](const BenchResult& r) {
                  alone.push_back(r);
                }).ok());
    ASSERT_EQ(alone.size(), tests.size());
    for (size_t it = 0; it < tests.size(); ++it) {
      const auto& [jp, r] = got[it * policies.size() + ip];
      SCOPED_TRACE(policies[ip]->spec() + " " + tests[it].name());
      EXPECT_EQ(jp, ip);
      EXPECT_EQ(r.test.name(), tests[it].name());
      EXPECT_EQ(r.kv_spec, policies[ip]->spec());
      ASSERT_EQ(r.seconds.size(), 3u);
      EXPECT_EQ(r.peak_rss, 0u);
      EXPECT_EQ(r.slots_after_depth, alone[it].slots_after_depth);
      EXPECT_EQ(r.slots, alone[it].slots);
      EXPECT_EQ(r.kv_bytes_used, alone[it].kv_bytes_used);
      EXPECT_EQ(r.kv_bytes_full, alone[it].kv_bytes_full);
    }
  }
  // Paired ratios: the base's seconds over the policy's, repetition by repetition.
  BenchResult a, b;
  a.seconds = {1.0, 2.0, 4.0};
  b.seconds = {2.0, 2.0};
  const std::vector<double> x = paired_ratios(a, b);
  ASSERT_EQ(x.size(), 2u);
  EXPECT_DOUBLE_EQ(x[0], 2.0);
  EXPECT_DOUBLE_EQ(x[1], 1.0);

  EXPECT_FALSE(run_bench_interleaved(engine, text, tests, {}, cfg, nullptr).ok());
  const std::vector<std::shared_ptr<const KvPolicy>> with_null = {policies[0], nullptr};
  EXPECT_FALSE(run_bench_interleaved(engine, text, tests, with_null, cfg, nullptr).ok());
}

TEST_F(BenchRandomModel, ErrorsBeforeRunning) {
  ThreadPool pool(1);
  Engine engine(*model_, pool, EngineOptions{});
  const std::vector<TokenId> text = test::random_model_tokens(50, model_->hparams().n_vocab);
  const std::vector<BenchTest> tests = {{BenchKind::kGen, 8, 48}};
  int calls = 0;
  const Status s = run_bench(engine, text, tests, std::make_shared<FullPolicy>(), BenchConfig{},
                             [&](const BenchResult&) { ++calls; });
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(has(s.message(), "needs 56 tokens of text")) << s.message();
  EXPECT_EQ(calls, 0);
  EXPECT_FALSE(run_bench(engine, text, {}, nullptr, BenchConfig{}, nullptr).ok());
}

TEST(BenchBandwidth, ProbeReturnsAPositiveRate) {
  ThreadPool pool(2);
  auto bw = measure_read_bandwidth(pool, size_t{8} << 20, 2);
  ASSERT_TRUE(bw.ok()) << bw.status().to_string();
  EXPECT_GT(*bw, 0.0);
}

}  // namespace
}  // namespace d2o
