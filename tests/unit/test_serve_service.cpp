// The serving core under concurrent clients (serve/service.h): handler threads submit jobs and
// wait on them while the engine thread batches them. Every client gets what it gets alone, the
// queue bound answers 503 exactly, a cancelled job ends as cancelled and frees its place,
// sessions used from several threads continue their own conversations, metrics read
// meanwhile stay consistent, and the service says when it has drained. Part of the ThreadSanitizer
// build (scripts/test.sh --tsan).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "serve/metrics.h"
#include "serve_fixture.h"

namespace d2o::serve {
namespace {

using test::random_prompt;
using test::ServeStack;

struct Outcome {
  std::string text;
  std::string finish_reason;
  int completion_tokens = 0;
  int cached_tokens = 0;
  std::optional<ApiError> error;
  std::optional<SessionInfo> session;
};

std::shared_ptr<Job> make_job(std::vector<TokenId> prompt, int max_tokens,
                              const std::string& session = "") {
  auto job = std::make_shared<Job>();
  job->prompt = std::move(prompt);
  job->max_tokens = max_tokens;
  job->sampling.temperature = 0;  // greedy
  job->sampling.top_k = 0;
  job->sampling.top_p = 1;
  job->sampling.min_p = 0;
  job->sampling.seed = 1;
  job->kv_spec = "full";
  job->session = session;
  job->completion.endpoint = Endpoint::kCompletion;
  return job;
}

// What a handler does: waits for the job, taking its text as it comes.
Outcome wait_for(Job& job) {
  Outcome o;
  std::string piece;
  while (!Service::wait_events(job, piece, 1000)) o.text += piece;
  o.text += piece;
  std::lock_guard<std::mutex> lock(job.mu);
  o.error = job.error;
  o.finish_reason = job.completion.finish_reason;
  o.completion_tokens = job.completion.usage.completion_tokens;
  o.cached_tokens = job.completion.usage.cached_tokens;
  o.session = job.completion.session;
  return o;
}

Outcome run_one(Service& s, std::vector<TokenId> prompt, int max_tokens,
                const std::string& session = "", bool ignore_eos = false) {
  auto job = make_job(std::move(prompt), max_tokens, session);
  job->ignore_eos = ignore_eos;
  if (auto e = s.submit(job)) {
    Outcome o;
    o.error = e;
    return o;
  }
  return wait_for(*job);
}

// run_one for a request that came with the API key named `key`.
Outcome run_as(Service& s, const std::string& key, std::vector<TokenId> prompt, int max_tokens,
               const std::string& session) {
  auto job = make_job(std::move(prompt), max_tokens, session);
  job->key_name = key;
  if (auto e = s.submit(job)) {
    Outcome o;
    o.error = e;
    return o;
  }
  return wait_for(*job);
}

// Published metrics lag the jobs' ends by the rest of an engine step: waits for a count.
// (At most 60 s: a count that never comes fails the test's checks, not hangs it.)
void wait_for_count(const Service& s, const char* outcome, int64_t n) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < until) {
    Metrics m = s.metrics();
    if (m.requests[outcome] >= n) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

// The random vocabulary's plain pieces are "t<id>" (control tokens render as ""): the ids back
// from a text.
std::vector<TokenId> ids_of(const std::string& text) {
  std::vector<TokenId> ids;
  for (size_t p = 0; (p = text.find('t', p)) != std::string::npos;) {
    size_t end = p + 1;
    while (end < text.size() && std::isdigit(static_cast<unsigned char>(text[end]))) ++end;
    ids.push_back(std::stoi(text.substr(p + 1, end - p - 1)));
    p = end;
  }
  return ids;
}

TEST(ServeService, ConcurrentClientsGetWhatTheyGetAlone) {
  ServeStack st;
  ASSERT_NO_FATAL_FAILURE(st.start("serve_service", size_t{4} << 20, 3, 64));
  Service& s = *st.service;
  constexpr int kClients = 8;
  constexpr int kNew = 10;
  std::vector<std::vector<TokenId>> prompts;
  for (int i = 0; i < kClients; ++i) prompts.push_back(random_prompt(5 + 7 * i, 100 + i));

  std::vector<Outcome> alone;
  for (const auto& p : prompts) alone.push_back(run_one(s, p, kNew));

  std::vector<Outcome> together(kClients);
  std::atomic<int> finished{0};
  std::vector<std::thread> clients;
  for (int i = 0; i < kClients; ++i) {
    clients.emplace_back([&, i] {
      together[i] = run_one(s, prompts[i], kNew);
      ++finished;
    });
  }
  // Metrics and their Prometheus text read while the engine thread publishes them.
  int64_t reads = 0;
  while (finished.load() < kClients) {
    const Metrics m = s.metrics();
    EXPECT_LE(m.kv_reserved, m.kv_cap);
    EXPECT_LE(m.running, 3);
    EXPECT_FALSE(prometheus_text(m).empty());
    ++reads;
  }
  for (std::thread& t : clients) t.join();
  EXPECT_GT(reads, 0);

  for (int i = 0; i < kClients; ++i) {
    SCOPED_TRACE("client " + std::to_string(i));
    ASSERT_FALSE(alone[i].error) << alone[i].error->message;
    ASSERT_FALSE(together[i].error) << together[i].error->message;
    EXPECT_EQ(alone[i].completion_tokens, kNew);  // no end-of-generation token: all of them
    EXPECT_EQ(alone[i].finish_reason, "length");
    EXPECT_FALSE(alone[i].text.empty());
    EXPECT_EQ(together[i].text, alone[i].text);
    EXPECT_EQ(together[i].completion_tokens, alone[i].completion_tokens);
    EXPECT_EQ(together[i].finish_reason, alone[i].finish_reason);
  }
  wait_for_count(s, "ok", 2 * kClients);
  const Metrics m = s.metrics();
  EXPECT_EQ(m.generated_tokens, 2 * kClients * kNew);
  EXPECT_EQ(m.kv_reserved, 0u);
  EXPECT_EQ(m.running, 0);
}

TEST(ServeService, QueueBoundIsExactAndACancelledJobEndsAndFreesItsPlace) {
  ServeStack st;
  // One sequence at a time; two jobs may wait.
  ASSERT_NO_FATAL_FAILURE(st.start("serve_service", size_t{8} << 20, 1, 2));
  Service& s = *st.service;
  // A long job: it is still running when the others arrive (it is cancelled below, or when the
  // test ends early: the service finishes running jobs before it stops).
  auto a = make_job(random_prompt(4, 7), 4000);
  struct CancelAtExit {
    Job& job;
    ~CancelAtExit() { job.cancel = true; }
  } cancel_a{*a};
  ASSERT_FALSE(s.submit(a));
  // Two of its tokens: the second comes from a step that began after the engine thread recounted
  // the queue once a was running.
  std::string piece, a_text;
  while (std::count(a_text.begin(), a_text.end(), 't') < 2) {
    ASSERT_FALSE(Service::wait_events(*a, piece, 1000)) << "the long job ended early";
    a_text += piece;
  }
  // a is running, so nothing waits: two jobs fit in the queue, a third does not, whether or not
  // the engine thread has taken the two from its inbox yet.
  auto b = make_job(random_prompt(6, 8), 5);
  auto c = make_job(random_prompt(6, 9), 5);
  ASSERT_FALSE(s.submit(b));
  ASSERT_FALSE(s.submit(c));
  for (int i = 0; i < 3; ++i) {
    auto d = make_job(random_prompt(6, 10), 5);
    auto e = s.submit(d);
    ASSERT_TRUE(e) << "a job beyond the queue bound was accepted";
    EXPECT_EQ(e->http_status, 503);
    EXPECT_EQ(e->code, "queue_full");
  }

  a->cancel = true;  // the client went away
  const Outcome oa = wait_for(*a);
  ASSERT_TRUE(oa.error);
  EXPECT_EQ(oa.error->http_status, 499);
  EXPECT_EQ(oa.error->code, "cancelled");
  const Outcome ob = wait_for(*b), oc = wait_for(*c);
  EXPECT_FALSE(ob.error);
  EXPECT_FALSE(oc.error);
  EXPECT_EQ(ob.completion_tokens, 5);
  EXPECT_EQ(oc.completion_tokens, 5);
  wait_for_count(s, "ok", 2);
  const Metrics m = s.metrics();
  EXPECT_EQ(m.requests.at("cancelled"), 1);
  EXPECT_EQ(m.kv_reserved, 0u);
}

// on_drained (where `d2o serve` gives freed memory back) runs once each time the last request
// that ran ends, before the metrics show the service idle; not while idle, and not for a
// request that never ran.
TEST(ServeService, OnDrainedRunsWhenTheLastRequestEnds) {
  ServeStack st;
  std::atomic<int> drains{0};
  ASSERT_NO_FATAL_FAILURE(
      st.start("serve_service", size_t{8} << 20, 2, 8, [&drains] { ++drains; }));
  Service& s = *st.service;
  const auto idle = [&s] {
    while (true) {
      const Metrics m = s.metrics();
      if (m.running == 0 && m.queued == 0) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  };
  for (int round = 1; round <= 2; ++round) {
    const Outcome o = run_one(s, random_prompt(6, 20 + round), 6);
    ASSERT_FALSE(o.error);
    wait_for_count(s, "ok", round);
    idle();
    EXPECT_EQ(drains.load(), round) << "once per drain, before the metrics show it";
  }
  // Beyond the context: refused before it runs a step.
  const Outcome refused = run_one(s, random_prompt(6, 30), 100000);
  ASSERT_TRUE(refused.error);
  wait_for_count(s, "invalid", 1);
  EXPECT_EQ(drains.load(), 2);
}

TEST(ServeService, IgnoreEosRunsToMaxTokens) {
  // The greedy answer without end-of-generation tokens, then the same prompt with the answer's
  // third token made one: the answer ends there, unless the request asks to ignore it.
  std::vector<TokenId> answer;
  {
    ServeStack st;
    ASSERT_NO_FATAL_FAILURE(st.start("serve_eos_free", size_t{8} << 20, 2, 8));
    const Outcome o = run_one(*st.service, random_prompt(7, 41), 8);
    ASSERT_FALSE(o.error);
    ASSERT_EQ(o.completion_tokens, 8);
    answer = ids_of(o.text);
    ASSERT_EQ(answer.size(), 8u);
  }
  ServeStack st;
  st.eog = {answer[2]};
  ASSERT_NO_FATAL_FAILURE(st.start("serve_eos", size_t{8} << 20, 2, 8));
  // The answer stops before the token's first place in it (the token itself is not part of the
  // answer); with ignore_eos it runs to max_tokens.
  const int first =
      static_cast<int>(std::find(answer.begin(), answer.end(), answer[2]) - answer.begin());
  const Outcome stopped = run_one(*st.service, random_prompt(7, 41), 8);
  ASSERT_FALSE(stopped.error);
  EXPECT_EQ(stopped.finish_reason, "stop");
  EXPECT_EQ(stopped.completion_tokens, first);
  const Outcome full = run_one(*st.service, random_prompt(7, 41), 8, "", true);
  ASSERT_FALSE(full.error);
  EXPECT_EQ(full.finish_reason, "length");
  EXPECT_EQ(full.completion_tokens, 8);
}

TEST(ServeService, SessionsFromSeveralThreadsContinueTheirOwnConversations) {
  ServeStack st;
  ASSERT_NO_FATAL_FAILURE(st.start("serve_service", size_t{4} << 20, 4, 64));
  Service& s = *st.service;
  constexpr int kSessions = 4;
  std::vector<Outcome> first(kSessions), second(kSessions);
  std::vector<std::vector<TokenId>> continued(kSessions);
  std::vector<std::thread> clients;
  for (int i = 0; i < kSessions; ++i) {
    clients.emplace_back([&, i] {
      const std::string id = "conv-" + std::to_string(i);
      std::vector<TokenId> prompt = random_prompt(8 + 3 * i, 200 + i);
      first[i] = run_one(s, prompt, 6, id);
      // The next turn: the conversation so far (prompt and answer) and a new message.
      for (TokenId t : ids_of(first[i].text)) prompt.push_back(t);
      for (TokenId t : random_prompt(5, 300 + i)) prompt.push_back(t);
      continued[i] = prompt;
      second[i] = run_one(s, prompt, 6, id);
    });
  }
  for (std::thread& t : clients) t.join();
  for (int i = 0; i < kSessions; ++i) {
    SCOPED_TRACE("session " + std::to_string(i));
    ASSERT_FALSE(first[i].error) << first[i].error->message;
    ASSERT_FALSE(second[i].error) << second[i].error->message;
    ASSERT_TRUE(first[i].session && second[i].session);
    EXPECT_EQ(first[i].session->id, "conv-" + std::to_string(i));
    EXPECT_EQ(second[i].session->id, first[i].session->id);
    EXPECT_EQ(first[i].cached_tokens, 0);
    // The first turn's prompt and answer but its last token (not fed yet) were in the cache.
    EXPECT_FALSE(second[i].session->rebuilt);
    EXPECT_EQ(second[i].cached_tokens, first[i].session->n_past);
    EXPECT_EQ(first[i].session->n_past, 8 + 3 * i + 6 - 1);
    EXPECT_EQ(second[i].session->n_past, std::ssize(continued[i]) + 6 - 1);
  }
  wait_for_count(s, "ok", 2 * kSessions);
  EXPECT_EQ(s.metrics().sessions, kSessions);
}

// A session whose next request leaves its tokens after a common prefix (an edited last message,
// a regenerated answer) is cut back to that prefix, not rebuilt: the response says how many
// tokens it kept (cached) and let go, the answer is the one of a fresh request with the same
// prompt, and /metrics counts the cut; another policy still rebuilds it, counted by reason.
TEST(ServeService, AnEditedTurnKeepsTheCommonPrefixAndAnswersAsAFreshRequest) {
  ServeStack st;
  ASSERT_NO_FATAL_FAILURE(st.start("serve_service", size_t{4} << 20, 2, 8));
  Service& s = *st.service;
  std::vector<TokenId> conv = random_prompt(12, 500);
  const Outcome one = run_one(s, conv, 6, "edit");
  ASSERT_FALSE(one.error);
  for (TokenId t : ids_of(one.text)) conv.push_back(t);
  const size_t common = conv.size();
  std::vector<TokenId> asked = conv, edited = conv;
  for (TokenId t : random_prompt(5, 501)) asked.push_back(t);
  for (TokenId t : random_prompt(7, 502)) edited.push_back(t);
  ASSERT_NE(asked[common], edited[common]);
  const Outcome two = run_one(s, asked, 6, "edit");
  ASSERT_FALSE(two.error);
  ASSERT_TRUE(two.session);
  EXPECT_FALSE(two.session->truncated);

  const Outcome cut = run_one(s, edited, 6, "edit");
  ASSERT_FALSE(cut.error) << cut.error->message;
  ASSERT_TRUE(cut.session);
  EXPECT_FALSE(cut.session->rebuilt);
  EXPECT_TRUE(cut.session->truncated);
  EXPECT_EQ(cut.cached_tokens, static_cast<int>(common));
  EXPECT_EQ(cut.session->dropped_tokens, two.session->n_past - static_cast<int64_t>(common));
  EXPECT_EQ(cut.session->n_past, std::ssize(edited) + 6 - 1);
  const Outcome fresh = run_one(s, edited, 6);
  ASSERT_FALSE(fresh.error);
  EXPECT_EQ(cut.text, fresh.text);

  // The same prompt again (a regenerated answer): all but its last token kept.
  const Outcome again = run_one(s, edited, 6, "edit");
  ASSERT_FALSE(again.error);
  EXPECT_TRUE(again.session->truncated);
  EXPECT_EQ(again.cached_tokens, std::ssize(edited) - 1);
  EXPECT_EQ(again.text, fresh.text);

  // Another policy: rebuilt, nothing kept.
  auto job = make_job(edited, 6, "edit");
  job->kv_spec = "h2o:budget=64";
  ASSERT_FALSE(s.submit(job));
  const Outcome other = wait_for(*job);
  ASSERT_FALSE(other.error);
  EXPECT_TRUE(other.session->rebuilt);
  EXPECT_FALSE(other.session->truncated);
  EXPECT_EQ(other.cached_tokens, 0);
  EXPECT_EQ(other.session->dropped_tokens, again.session->n_past);

  wait_for_count(s, "ok", 6);
  const Metrics m = s.metrics();
  EXPECT_EQ(m.session_truncations, 2);
  EXPECT_EQ(m.session_truncation_kept_tokens,
            static_cast<int64_t>(common) + std::ssize(edited) - 1);
  EXPECT_EQ(m.session_truncation_dropped_tokens,
            cut.session->dropped_tokens + again.session->dropped_tokens);
  EXPECT_EQ(m.session_rebuilds.at("policy"), 1);
  EXPECT_EQ(m.prompt_tokens - m.prefilled_tokens,
            two.cached_tokens + cut.cached_tokens + again.cached_tokens);
  const std::string text = prometheus_text(m);
  EXPECT_NE(text.find("d2o_session_rebuilds_total{reason=\"policy\"} 1"), std::string::npos);
  EXPECT_NE(text.find("d2o_session_truncations_total 2"), std::string::npos);
}

// A model with recurrent layers (qwen35): a turn that extends the conversation goes on from it;
// an edited turn cannot cut the recurrent state back to the common prefix, so the session is
// rebuilt (reason recurrent_state) and answers as a fresh request.
TEST(ServeService, ARecurrentModelsEditedTurnRebuildsTheSession) {
  ServeStack st;
  st.model_config = ::d2o::test::random_qwen35_config();
  ASSERT_NO_FATAL_FAILURE(st.start("serve_service_qwen35", size_t{4} << 20, 2, 8));
  Service& s = *st.service;
  std::vector<TokenId> conv = random_prompt(12, 510);
  const Outcome one = run_one(s, conv, 6, "rec");
  ASSERT_FALSE(one.error);
  for (TokenId t : ids_of(one.text)) conv.push_back(t);
  std::vector<TokenId> asked = conv, edited = conv;
  for (TokenId t : random_prompt(5, 511)) asked.push_back(t);
  for (TokenId t : random_prompt(7, 512)) edited.push_back(t);
  const Outcome two = run_one(s, asked, 6, "rec");
  ASSERT_FALSE(two.error);
  ASSERT_TRUE(two.session);
  EXPECT_FALSE(two.session->rebuilt);
  EXPECT_EQ(two.cached_tokens, std::ssize(conv) - 1);
  EXPECT_EQ(two.text, run_one(s, asked, 6).text);

  const Outcome cut = run_one(s, edited, 6, "rec");
  ASSERT_FALSE(cut.error) << cut.error->message;
  ASSERT_TRUE(cut.session);
  EXPECT_TRUE(cut.session->rebuilt);
  EXPECT_FALSE(cut.session->truncated);
  EXPECT_EQ(cut.cached_tokens, 0);
  EXPECT_EQ(cut.text, run_one(s, edited, 6).text);
  wait_for_count(s, "ok", 5);
  const Metrics m = s.metrics();
  EXPECT_EQ(m.session_rebuilds.at("recurrent_state"), 1);
  EXPECT_EQ(m.session_truncations, 0);
}

// Sessions live in the namespace of the key a request came with. Bob naming the session id
// Alice uses, with Alice's very conversation, gets what an id never used gets (nothing taken
// from her cache, not "rebuilt", the same sizes and answer), and leaves her session as it was;
// within one name the session goes on; a session another name is answering is no 409 for Bob.
// The default namespace is shared by an open server and the key named "default".
TEST(ServeService, SessionsAreNamespacedByKeyName) {
  ServeStack st;
  ASSERT_NO_FATAL_FAILURE(st.start("serve_service", size_t{4} << 20, 4, 64));
  Service& s = *st.service;
  // Alice's two turns.
  std::vector<TokenId> prompt = random_prompt(12, 500);
  const Outcome a1 = run_as(s, "alice", prompt, 6, "shared");
  ASSERT_FALSE(a1.error) << a1.error->message;
  for (TokenId t : ids_of(a1.text)) prompt.push_back(t);
  for (TokenId t : random_prompt(5, 511)) prompt.push_back(t);
  const Outcome a2 = run_as(s, "alice", prompt, 6, "shared");
  ASSERT_FALSE(a2.error) << a2.error->message;
  EXPECT_EQ(a2.cached_tokens, a1.session->n_past);  // continued
  ASSERT_GT(a2.cached_tokens, 0);

  // Alice's next turn (her conversation and a new message), sent by Bob under her id, and under
  // an id nobody used. (The turns carry the answers as ids read back from their text.)
  ASSERT_EQ(std::ssize(ids_of(a2.text)), a2.completion_tokens) << a2.text;
  std::vector<TokenId> next = prompt;
  for (TokenId t : ids_of(a2.text)) next.push_back(t);
  for (TokenId t : random_prompt(4, 505)) next.push_back(t);
  const Outcome b = run_as(s, "bob", next, 6, "shared");
  const Outcome fresh = run_as(s, "bob", next, 6, "never-used");
  ASSERT_FALSE(b.error) << b.error->message;
  ASSERT_FALSE(fresh.error) << fresh.error->message;
  ASSERT_TRUE(b.session && fresh.session);
  EXPECT_EQ(b.cached_tokens, 0);  // (one namespace for all: Alice's n_past, her cache)
  EXPECT_EQ(b.cached_tokens, fresh.cached_tokens);
  EXPECT_EQ(b.text, fresh.text);
  EXPECT_EQ(b.completion_tokens, fresh.completion_tokens);
  EXPECT_EQ(b.finish_reason, fresh.finish_reason);
  EXPECT_EQ(b.session->id, "shared");
  EXPECT_FALSE(b.session->rebuilt);
  EXPECT_EQ(b.session->rebuilt, fresh.session->rebuilt);
  EXPECT_EQ(b.session->n_past, fresh.session->n_past);
  EXPECT_EQ(b.session->kv_bytes, fresh.session->kv_bytes);
  EXPECT_EQ(b.session->full_kv_bytes, fresh.session->full_kv_bytes);
  // Another prompt on Alice's id is no rebuild for Bob either (that would say the id is used).
  (void)run_as(s, "alice", random_prompt(9, 503), 2, "shared-2");
  const Outcome b_other = run_as(s, "bob", random_prompt(4, 502), 2, "shared-2");
  const Outcome c_other = run_as(s, "carol", random_prompt(4, 502), 2, "never-used-2");
  ASSERT_FALSE(b_other.error || c_other.error);
  EXPECT_FALSE(b_other.session->rebuilt);
  EXPECT_EQ(b_other.cached_tokens, 0);
  EXPECT_EQ(b_other.text, c_other.text);
  EXPECT_EQ(b_other.session->n_past, c_other.session->n_past);

  // Bob's own next turn continues Bob's session; Alice's turn continues hers, untouched.
  ASSERT_EQ(std::ssize(ids_of(b.text)), b.completion_tokens) << b.text;
  std::vector<TokenId> bob_next = next;
  for (TokenId t : ids_of(b.text)) bob_next.push_back(t);
  for (TokenId t : random_prompt(3, 504)) bob_next.push_back(t);
  const Outcome b2 = run_as(s, "bob", bob_next, 4, "shared");
  ASSERT_FALSE(b2.error) << b2.error->message;
  EXPECT_EQ(b2.cached_tokens, b.session->n_past);
  const Outcome a3 = run_as(s, "alice", next, 6, "shared");
  ASSERT_FALSE(a3.error) << a3.error->message;
  EXPECT_FALSE(a3.session->rebuilt);
  EXPECT_EQ(a3.cached_tokens, a2.session->n_past);
  EXPECT_EQ(a3.text, b.text);

  // Alice's session is answering: Alice gets 409 on it, Bob an answer.
  auto long_job = make_job(random_prompt(6, 506), 8000, "busy");  // within the context
  long_job->key_name = "alice";
  ASSERT_FALSE(s.submit(long_job));
  const Outcome a_busy = run_as(s, "alice", random_prompt(6, 507), 2, "busy");
  const Outcome b_busy = run_as(s, "bob", random_prompt(6, 507), 2, "busy");
  long_job->cancel = true;
  (void)wait_for(*long_job);
  ASSERT_TRUE(a_busy.error);
  EXPECT_EQ(a_busy.error->http_status, 409);
  EXPECT_FALSE(b_busy.error) << b_busy.error->message;

  // No key and the key named "default" share the namespace of older servers.
  std::vector<TokenId> legacy = random_prompt(10, 508);
  const Outcome o1 = run_as(s, "", legacy, 3, "legacy");
  for (TokenId t : ids_of(o1.text)) legacy.push_back(t);
  legacy.push_back(42);
  const Outcome o2 = run_as(s, "default", legacy, 3, "legacy");
  ASSERT_FALSE(o1.error || o2.error);
  EXPECT_EQ(o2.cached_tokens, o1.session->n_past);

  // /metrics: requests and tokens per key name; a job without a name counts in the totals only.
  wait_for_count(s, "ok", 12);
  const Metrics m = s.metrics();
  ASSERT_EQ(m.by_key.count("alice"), 1u);
  ASSERT_EQ(m.by_key.count(""), 0u);
  EXPECT_EQ(m.by_key.at("alice").requests.at("ok"), 4);
  EXPECT_EQ(m.by_key.at("alice").requests.at("invalid"), 1);  // the 409
  EXPECT_EQ(m.by_key.at("alice").requests.at("cancelled"), 1);
  EXPECT_EQ(m.by_key.at("bob").requests.at("ok"), 5);
  EXPECT_EQ(m.by_key.at("carol").requests.at("ok"), 1);
  EXPECT_EQ(m.by_key.at("default").requests.at("ok"), 1);
  int64_t generated = 0, prompt_tokens = 0, prefilled = 0;
  for (const auto& [name, k] : m.by_key) {
    generated += k.generated_tokens;
    prompt_tokens += k.prompt_tokens;
    prefilled += k.prefilled_tokens;
  }
  EXPECT_EQ(generated + o1.completion_tokens, m.generated_tokens);
  EXPECT_EQ(prompt_tokens + 10, m.prompt_tokens);
  EXPECT_EQ(prefilled + 10, m.prefilled_tokens);
  EXPECT_EQ(m.by_key.at("bob").prompt_tokens - m.by_key.at("bob").prefilled_tokens,
            b2.cached_tokens);
}

}  // namespace
}  // namespace d2o::serve
