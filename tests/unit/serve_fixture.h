// A serving stack on a tiny random-weight model for the server's threaded tests
// (test_serve_service.cpp, test_serve_http.cpp): the model, its tokenizer, an engine on two
// threads and a Service running its engine thread. Greedy decoding of a random model is
// deterministic, and a sequence's output does not depend on what it is batched with
// (test_scheduler.cpp), so what a client gets can be compared with what it gets alone.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/random_model.h"
#include "common/test_util.h"
#include "core/thread_pool.h"
#include "gguf/gguf.h"
#include "model/model.h"
#include "runtime/engine.h"
#include "runtime/tokenizer.h"
#include "serve/service.h"

namespace d2o::serve::test {

struct ServeStack {
  std::unique_ptr<GgufFile> file;
  std::unique_ptr<Model> model;
  std::unique_ptr<Tokenizer> tok;
  std::unique_ptr<ThreadPool> pool;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<Service> service;
  std::vector<TokenId> eog;  // end-of-generation tokens of the service (none unless set)
  std::string session_dir;   // --session-dir (none unless set)
  bool save_every_turn = true;
  // The model's configuration (none: a two-layer llama).
  std::optional<::d2o::test::RandomModelConfig> model_config;

  // Loads the model (written once per name) and starts a service; `kv_mem` is the KV cap.
  void start(const std::string& name, size_t kv_mem, int max_running, size_t max_queue,
             std::function<void()> on_drained = {}) {
    ::d2o::test::RandomModelConfig cfg;
    cfg.n_layer = 2;
    cfg.n_embd = 64;
    cfg.n_head = 4;
    cfg.n_head_kv = 2;
    cfg.n_vocab = 300;
    cfg.seed = 23;
    if (model_config) cfg = *model_config;
    const std::string path = ::d2o::test::scratch_path(name + ".gguf");
    ASSERT_TRUE(::d2o::test::make_random_model(cfg).write(path).ok());
    auto f = GgufFile::open(path);
    ASSERT_TRUE(f.ok()) << f.status().to_string();
    file = std::move(f).value();
    auto m = Model::load(*file);
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    model = std::move(m).value();
    auto t = Tokenizer::from_gguf(*file);
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    tok = std::move(t).value();
    pool = std::make_unique<ThreadPool>(2);
    engine = std::make_unique<Engine>(*model, *pool, EngineOptions{});
    ServiceParams sp;
    sp.scheduler.kv_mem_bytes = kv_mem;
    sp.scheduler.prefill_chunk = 16;
    sp.scheduler.max_running = max_running;
    sp.scheduler.max_positions = 8192;
    // No end-of-generation tokens unless a test sets `eog`: every job runs to its max_tokens (or
    // a stop, or a cancel).
    sp.scheduler.eog_tokens = eog;
    sp.max_queue = max_queue;
    sp.default_kv = "full";
    sp.on_drained = std::move(on_drained);
    sp.session_dir = session_dir;
    sp.save_every_turn = save_every_turn;
    auto s = Service::create(*engine, *tok, sp);
    ASSERT_TRUE(s.ok()) << s.status().to_string();
    service = std::move(s).value();
  }
};

// A prompt of n ids drawn from the plain pieces (3..299).
inline std::vector<TokenId> random_prompt(int n, uint32_t seed) {
  ::d2o::test::Xorshift rng(seed);
  std::vector<TokenId> p;
  for (int i = 0; i < n; ++i) p.push_back(3 + static_cast<TokenId>(rng.next() % 297));
  return p;
}

}  // namespace d2o::serve::test
