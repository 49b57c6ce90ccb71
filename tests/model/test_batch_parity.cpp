// Batched generation on the real SmolLM2-135M: greedy outputs of a request served together with
// seven others (chunked prefill interleaved with decoding, attention split across sequences, two
// threads) equal its outputs served alone (one thread), for every KV policy; and the KV accounting
// holds at every step.
#include <gtest/gtest.h>

#include <algorithm>

#include "common/test_util.h"
#include "gguf/gguf.h"
#include "model/model.h"
#include "runtime/engine.h"
#include "runtime/scheduler.h"
#include "runtime/tokenizer.h"

namespace d2o {
namespace {

// Long enough for every compacting policy to compact at every step for a while (the prompts are
// compressed right after prefill), short enough for eight policies in a CI run.
constexpr int kGen = 32;

struct Fixture {
  std::unique_ptr<Model> model;
  std::vector<std::vector<TokenId>> prompts;  // 8 prompts of different lengths
};

// Loads the model once; prompts are KJV passages from 8 offsets, 37 to 300 tokens (the longer
// ones take three prefill passes of 128 and outgrow every compacting policy's budget).
Fixture* fixture() {
  static Fixture* f = [] {
    auto* fx = new Fixture;
    const std::string path = test::default_model_path();
    const std::string text = test::read_file(test::text_dir() + "/kjv.txt");
    if (!test::file_exists(path) || text.size() < 100000) return fx;
    auto file = GgufFile::open(path);
    if (!file.ok()) return fx;
    auto model = Model::load(**file);
    auto tok = Tokenizer::from_gguf(**file);
    if (!model.ok() || !tok.ok()) return fx;
    fx->model = std::move(model).value();
    const std::vector<int> lens = {37, 300, 90, 256, 150, 200, 64, 280};
    EncodeOptions enc;
    enc.add_special = false;
    for (size_t i = 0; i < lens.size(); ++i) {
      const size_t at = text.find('\n', text.size() / 9 * (i + 1)) + 1;
      auto ids = (*tok)->encode(std::string_view(text).substr(at, 8000), enc);
      if (!ids.ok() || ids->size() < static_cast<size_t>(lens[i])) return fx;
      ids->resize(static_cast<size_t>(lens[i]));
      fx->prompts.push_back(std::move(ids).value());
    }
    return fx;
  }();
  return f;
}

std::vector<RequestResult> serve(Engine& engine, const SchedulerParams& sp,
                                 const std::vector<Request>& reqs) {
  auto s = Scheduler::create(engine, sp);
  EXPECT_TRUE(s.ok()) << s.status().to_string();
  if (!s.ok()) return {};
  for (const Request& r : reqs) EXPECT_TRUE((*s)->submit(r).ok());
  while (!(*s)->idle()) {
    const Status st = (*s)->step();
    EXPECT_TRUE(st.ok()) << st.to_string();
    if (!st.ok()) break;
    const StepStats& ls = (*s)->last_step();
    EXPECT_LE(ls.kv_reserved, sp.kv_mem_bytes);
    EXPECT_LE(ls.kv_allocated, ls.kv_reserved);
  }
  auto out = (*s)->take_finished();
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.id < b.id; });
  return out;
}

class BatchParity : public ::testing::TestWithParam<const char*> {};

TEST_P(BatchParity, GreedyOutputsInABatchEqualOutputsAlone) {
  D2O_REQUIRE_MODEL(model_path);
  Fixture* fx = fixture();
  ASSERT_TRUE(fx->model) << "could not load the model or the KJV text (" << test::text_dir() << ")";
  ASSERT_EQ(fx->prompts.size(), 8u);
  // The batch on two threads (decode attention split across sequences), each request alone on
  // one thread: the outputs may depend on neither.
  ThreadPool pool2(2), pool1(1);
  EngineOptions eo;
  eo.n_ubatch = 8 + 128;
  Engine engine(*fx->model, pool2, eo), engine_alone(*fx->model, pool1, eo);
  SchedulerParams sp;
  sp.kv_mem_bytes = size_t{1} << 30;
  sp.prefill_chunk = 128;  // the longer prompts take several passes
  sp.max_running = 8;
  std::vector<Request> reqs;
  for (const auto& p : fx->prompts) {
    Request r;
    r.prompt = p;
    r.max_new_tokens = kGen;
    r.kv_spec = GetParam();
    r.stop_at_eog = false;
    reqs.push_back(r);
  }
  const auto together = serve(engine, sp, reqs);
  ASSERT_EQ(together.size(), reqs.size());
  int differ = 0;
  for (size_t i = 0; i < reqs.size(); ++i) {
    SCOPED_TRACE("prompt of " + std::to_string(reqs[i].prompt.size()) + " tokens");
    ASSERT_TRUE(together[i].status.ok()) << together[i].status.to_string();
    ASSERT_EQ(together[i].tokens.size(), static_cast<size_t>(kGen));
    const auto alone = serve(engine_alone, sp, {reqs[i]});
    ASSERT_EQ(alone.size(), 1u);
    EXPECT_EQ(together[i].tokens, alone[0].tokens);
    differ += together[i].tokens != alone[0].tokens;
  }
  std::printf("%s: %d of 8 requests differ between batch and alone\n", GetParam(), differ);
}

INSTANTIATE_TEST_SUITE_P(AllPolicies, BatchParity,
                         // One per kind of statistics and compaction: none, positions only,
                         // accumulated scores, an observation window (with pyramid budgets),
                         // score statistics (RoCo), merges (CaM, D2O by ratio and by budget).
                         ::testing::Values("full", "streaming:budget=64", "h2o:ratio=0.2",
                                           "pyramidkv:ratio=0.2", "roco:ratio=0.2", "cam:ratio=0.2",
                                           "d2o:ratio=0.2", "d2o:budget=128"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           std::string n = info.param;
                           for (char& c : n) {
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           }
                           return n;
                         });

}  // namespace
}  // namespace d2o
