// Session files when their writes fail (a full disk, a read-only directory), made to fail
// through SessionDir::set_write_fault, behind the service on a tiny random-weight model: a
// failed write leaves no file that could be taken for a good one (no temporary file, the old
// file as it was), the session stays in memory and goes on; one that had to leave memory
// unwritten is rebuilt when it comes back and says so (`rebuilt`); every failure is counted
// (d2o_session_save_failures_total) as well as logged.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "serve/session_dir.h"
#include "serve_fixture.h"

namespace d2o::serve {
namespace {

// The names in `dir`, sorted.
std::vector<std::string> fault_dir_names(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

struct FaultOutcome {
  std::vector<TokenId> generated;  // the answer's ids (the random vocabulary's "t<id>" pieces)
  std::optional<ApiError> error;
  std::optional<SessionInfo> session;
  int cached_tokens = 0;
};

// Runs one greedy job with `session` and waits for it.
FaultOutcome fault_run(Service& s, const std::vector<TokenId>& prompt, int max_tokens,
                       const std::string& session) {
  auto job = std::make_shared<Job>();
  job->prompt = prompt;
  job->max_tokens = max_tokens;
  job->sampling.temperature = 0;
  job->sampling.top_k = 0;
  job->kv_spec = "full";
  job->session = session;
  job->completion.endpoint = Endpoint::kCompletion;
  FaultOutcome o;
  if (auto e = s.submit(job)) {
    o.error = e;
    return o;
  }
  std::string text, piece;
  while (!Service::wait_events(*job, piece, 1000)) text += piece;
  text += piece;
  for (size_t p = 0; (p = text.find('t', p)) != std::string::npos;) {
    size_t end = p + 1;
    while (end < text.size() && std::isdigit(static_cast<unsigned char>(text[end]))) ++end;
    if (end > p + 1) o.generated.push_back(std::stoi(text.substr(p + 1, end - p - 1)));
    p = end;
  }
  std::lock_guard<std::mutex> lock(job->mu);
  o.error = job->error;
  o.session = job->completion.session;
  o.cached_tokens = job->completion.usage.cached_tokens;
  return o;
}

// The conversation so far and `more` new tokens: the next turn's prompt.
std::vector<TokenId> fault_next_turn(std::vector<TokenId> prompt, const FaultOutcome& o,
                                     int more, uint32_t seed) {
  prompt.insert(prompt.end(), o.generated.begin(), o.generated.end());
  const auto extra = test::random_prompt(more, seed);
  prompt.insert(prompt.end(), extra.begin(), extra.end());
  return prompt;
}

// Waits (at most 30 s) until the published metrics satisfy `done`.
bool fault_wait(const Service& s, const std::function<bool(const Metrics&)>& done) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!done(s.metrics())) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

// The n_past of the session `id`'s file, read by another SessionDir on the same directory
// (-1: no file).
int64_t fault_file_n_past(const Service& s, const std::string& id) {
  const SessionDir* live = s.session_dir();
  auto d = SessionDir::open(live->dir(), live->context());
  EXPECT_TRUE(d.ok());
  auto loaded = d->load(id);
  EXPECT_TRUE(loaded.ok()) << loaded.status().to_string();
  return loaded.ok() && *loaded ? (*loaded)->n_past : -1;
}

TEST(SessionFaults, AFailedWriteKeepsTheOldFileAndTheSessionGoesOnFromMemory) {
  const std::string dir = d2o::test::scratch_path("serve_faults_turn");
  std::filesystem::remove_all(dir);
  test::ServeStack st;
  st.session_dir = dir;
  ASSERT_NO_FATAL_FAILURE(st.start("serve_faults", size_t{8} << 20, 2, 8));
  Service& svc = *st.service;
  const std::vector<TokenId> p1 = test::random_prompt(40, 1);
  const FaultOutcome a = fault_run(svc, p1, 4, "s");
  ASSERT_FALSE(a.error);
  ASSERT_TRUE(fault_wait(svc, [](const Metrics& m) { return m.sessions_saved == 1; }));
  EXPECT_EQ(fault_file_n_past(svc, "s"), a.session->n_past);

  // The disk is full for the next write: half of the file reaches the temporary file, then the
  // write fails. The answer is not affected; the file keeps the first turn.
  svc.session_dir()->set_write_fault(1, 1, ENOSPC);
  const std::vector<TokenId> p2 = fault_next_turn(p1, a, 10, 2);
  const FaultOutcome b = fault_run(svc, p2, 4, "s");
  ASSERT_FALSE(b.error);
  EXPECT_EQ(b.cached_tokens, a.session->n_past);
  EXPECT_FALSE(b.session->rebuilt);
  ASSERT_TRUE(fault_wait(svc, [](const Metrics& m) { return m.session_save_failures == 1; }));
  EXPECT_EQ(svc.metrics().session_file_errors, 1);
  EXPECT_EQ(fault_dir_names(dir), std::vector<std::string>{"s.d2os"});
  EXPECT_EQ(fault_file_n_past(svc, "s"), a.session->n_past);

  // The session stayed in memory: the next turn continues it, and its write succeeds.
  const FaultOutcome c = fault_run(svc, fault_next_turn(p2, b, 10, 3), 4, "s");
  ASSERT_FALSE(c.error);
  EXPECT_EQ(c.cached_tokens, b.session->n_past);
  EXPECT_FALSE(c.session->rebuilt);
  ASSERT_TRUE(fault_wait(svc, [](const Metrics& m) { return m.sessions_saved == 2; }));
  EXPECT_EQ(fault_file_n_past(svc, "s"), c.session->n_past);

  // A read-only directory: a new session's file is not even started.
  svc.session_dir()->set_write_fault(1, 1, EROFS);
  ASSERT_FALSE(fault_run(svc, test::random_prompt(20, 4), 4, "n").error);
  ASSERT_TRUE(fault_wait(svc, [](const Metrics& m) { return m.session_save_failures == 2; }));
  EXPECT_EQ(fault_dir_names(dir), std::vector<std::string>{"s.d2os"});
  EXPECT_EQ(fault_file_n_past(svc, "n"), -1);
  st.service.reset();
  std::filesystem::remove_all(dir);
}

TEST(SessionFaults, ASessionThatLeftMemoryUnwrittenIsRebuiltAndSaysSo) {
  // The cap: one 200-token full cache, so that a 124-token request pushes out a 103-token
  // session.
  size_t cap = 0;
  {
    test::ServeStack probe;
    ASSERT_NO_FATAL_FAILURE(probe.start("serve_faults", size_t{8} << 20, 2, 8));
    const KvCacheConfig cfg =
        kv_cache_config(probe.model->hparams(), probe.service->scheduler_params().kv_type);
    cap = KvCache::bytes_for_slots(cfg, 200);
  }
  const std::string dir = d2o::test::scratch_path("serve_faults_evict");
  std::filesystem::remove_all(dir);
  test::ServeStack st;
  st.session_dir = dir;
  st.save_every_turn = false;  // written only when it leaves memory
  ASSERT_NO_FATAL_FAILURE(st.start("serve_faults", cap, 2, 8));
  Service& svc = *st.service;
  const std::vector<TokenId> p1 = test::random_prompt(100, 5);
  const FaultOutcome a = fault_run(svc, p1, 4, "a");
  ASSERT_FALSE(a.error);
  svc.session_dir()->set_write_fault(1, 1, ENOSPC);
  ASSERT_FALSE(fault_run(svc, test::random_prompt(120, 6), 4, "").error);
  ASSERT_TRUE(fault_wait(svc, [](const Metrics& m) {
    return m.sessions_evicted == 1 && m.session_save_failures == 1;
  }));
  EXPECT_EQ(svc.metrics().sessions_saved, 0);
  EXPECT_TRUE(fault_dir_names(dir).empty());

  // Its next turn: nothing kept, no file; rebuilt from the messages, and the response says so.
  const std::vector<TokenId> p2 = fault_next_turn(p1, a, 6, 7);
  const FaultOutcome again = fault_run(svc, p2, 4, "a");
  ASSERT_FALSE(again.error);
  ASSERT_TRUE(again.session);
  EXPECT_TRUE(again.session->rebuilt);
  EXPECT_EQ(again.cached_tokens, 0);
  // Once only: the turn after continues it.
  const FaultOutcome after = fault_run(svc, fault_next_turn(p2, again, 6, 8), 4, "a");
  ASSERT_FALSE(after.error);
  EXPECT_FALSE(after.session->rebuilt);
  EXPECT_EQ(after.cached_tokens, again.session->n_past);
  st.service.reset();
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace d2o::serve
