// Session files (serve/session_file.h, serve/session_dir.h): a conversation written and read
// back holds the same cache bytes and policy state and goes on with bit-identical logits, for
// the full cache and compressing policies (merges, position shifts) in F16 and Q8_0; every kind
// of damage is refused with an error naming it; files are written atomically under names that
// cannot leave the directory; the session store writes sessions that leave memory.
#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <ostream>

#include "common/kv_rows.h"
#include "common/random_model.h"
#include "common/test_util.h"
#include "kv/policy/composed.h"
#include "model/model.h"
#include "runtime/engine.h"
#include "runtime/sequence.h"
#include "serve/api_keys.h"
#include "serve/session_dir.h"
#include "serve/sessions.h"

namespace d2o::serve {
namespace {

class SessionFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    d2o::test::RandomModelConfig cfg;
    cfg.n_layer = 3;
    cfg.n_embd = 128;  // head_dim 32: Q8_0 rows
    cfg.n_head = 4;
    cfg.n_head_kv = 2;
    cfg.n_vocab = 300;
    cfg.seed = 9;
    const std::string path = d2o::test::scratch_path("session_file_random.gguf");
    ASSERT_TRUE(d2o::test::make_random_model(cfg).write(path).ok());
    auto m = Model::load(path);
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    model_ = std::move(m).value();
    pool_ = std::make_unique<ThreadPool>(1);
    engine_ = std::make_unique<Engine>(*model_, *pool_, EngineOptions{});
    auto id = model_identity(path);
    ASSERT_TRUE(id.ok()) << id.status().to_string();
    model_id_ = *id;
  }

  SessionFileContext context(KvType type) const {
    SessionFileContext c;
    c.model = model_id_;
    c.cache = kv_cache_config(model_->hparams(), type);
    c.n_vocab = model_->hparams().n_vocab;
    c.max_positions = 512;
    return c;
  }

  // Feeds `tokens` to seq in one pass; returns the last token's logits.
  std::vector<float> feed(Sequence& seq, const std::vector<TokenId>& tokens) {
    std::vector<float> last;
    BatchEntry be;
    be.seq = &seq;
    be.tokens = tokens;
    be.logits_from = -1;
    Status s = engine_->forward({&be, 1}, [&](int, int, const float* l) {
      last.assign(l, l + model_->hparams().n_vocab);
    });
    EXPECT_TRUE(s.ok()) << s.to_string();
    return last;
  }

  // A conversation of 90 prompt tokens and 12 one-token steps (each compacting once the budget
  // is reached); history holds every token fed.
  std::shared_ptr<Sequence> conversation(const std::shared_ptr<const KvPolicy>& policy,
                                         KvType type, std::vector<TokenId>& history) {
    auto seq = std::make_shared<Sequence>(model_->hparams(), type, policy);
    history.clear();
    for (int i = 0; i < 90; ++i) history.push_back(3 + (i * 37) % 290);
    feed(*seq, history);
    for (int i = 0; i < 12; ++i) {
      history.push_back(5 + (i * 11) % 280);
      feed(*seq, {history.back()});
    }
    return seq;
  }

  // The canonical spec of `spec` and the F16 session file of its conversation (id "s").
  std::pair<std::string, std::string> file_of(const std::string& spec) {
    auto policy = std::shared_ptr<const KvPolicy>(parse_kv_policy(spec).value());
    std::vector<TokenId> history;
    auto seq = conversation(policy, KvType::kF16, history);
    std::string b;
    EXPECT_TRUE(encode_session(context(KvType::kF16), "s", policy->spec(), history, seq->n_past(),
                               seq->cache(), seq->policy_state(), b)
                    .ok());
    return std::make_pair(policy->spec(), b);
  }

  std::unique_ptr<Model> model_;
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<Engine> engine_;
  ModelIdentity model_id_;
};

// Rewrites the trailing checksum after a deliberate change, so that the checks behind it run.
void fix_checksum(std::string& b) {
  const uint64_t sum = fnv1a64(reinterpret_cast<const uint8_t*>(b.data()), b.size() - 8);
  std::memcpy(b.data() + b.size() - 8, &sum, 8);
}

Result<SessionData> decode(const SessionFileContext& ctx, const std::string& b) {
  return decode_session(ctx, reinterpret_cast<const uint8_t*>(b.data()), b.size());
}

struct RoundTripCase {
  const char* spec;
  KvType type;
};
void PrintTo(const RoundTripCase& c, std::ostream* os) {
  *os << c.spec << " " << kv_type_name(c.type);
}

class SessionFileRoundTrip : public SessionFileTest,
                             public ::testing::WithParamInterface<RoundTripCase> {};

TEST_P(SessionFileRoundTrip, SameBytesSameStateSameLogitsAfterward) {
  const RoundTripCase& c = GetParam();
  auto parsed = parse_kv_policy(c.spec);
  ASSERT_TRUE(parsed.ok());
  std::shared_ptr<const KvPolicy> policy(std::move(parsed).value());
  const std::string spec = policy->spec();
  std::vector<TokenId> history;
  auto a = conversation(policy, c.type, history);
  const SessionFileContext ctx = context(c.type);
  std::string bytes;
  Status enc = encode_session(ctx, "chat-1", spec, history, a->n_past(), a->cache(),
                              a->policy_state(), bytes);
  ASSERT_TRUE(enc.ok()) << enc.to_string();

  auto d = decode(ctx, bytes);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(d->id, "chat-1");
  EXPECT_EQ(d->kv_spec, spec);
  EXPECT_EQ(d->tokens, history);
  EXPECT_EQ(d->n_past, a->n_past());
  auto b = std::make_shared<Sequence>(model_->hparams(), c.type, policy);
  b->cache() = std::move(*d->cache);
  b->policy_state() = std::move(d->state);
  b->advance(d->n_past);

  // The same cache, slot by slot, and the same policy state.
  for (int il = 0; il < a->cache().n_layer(); ++il) {
    const KvLayer& la = a->cache().layer(il);
    const KvLayer& lb = b->cache().layer(il);
    ASSERT_EQ(la.n_slot(), lb.n_slot());
    const size_t n = static_cast<size_t>(la.n_slot());
    for (int h = 0; h < la.n_head_kv() && n > 0; ++h) {
      EXPECT_EQ(d2o::test::compare_keys(la, lb, h, n), 0);
      EXPECT_EQ(d2o::test::compare_values(la, lb, h, n), 0);
      EXPECT_EQ(std::memcmp(la.pos(h), lb.pos(h), n * 4), 0);
      EXPECT_EQ(std::memcmp(la.score(h), lb.score(h), n * 4), 0);
      EXPECT_EQ(std::memcmp(la.window(h), lb.window(h), n * 4), 0);
      EXPECT_EQ(std::memcmp(la.merged(h), lb.merged(h), n * 4), 0);
    }
  }
  const PolicyState &sa = a->policy_state(), &sb = b->policy_state();
  EXPECT_EQ(sa.budgets_set, sb.budgets_set);
  EXPECT_EQ(sa.budgets, sb.budgets);
  EXPECT_EQ(sa.evicted, sb.evicted);
  EXPECT_EQ(sa.merged, sb.merged);
  EXPECT_EQ(sa.n_compactions, sb.n_compactions);
  EXPECT_EQ(sa.pos_shift, sb.pos_shift);
  const ComposedPolicyState *oa = composed_state(sa), *ob = composed_state(sb);
  ASSERT_EQ(oa == nullptr, ob == nullptr);
  if (oa) {
    const D2oMergeState *da = d2o_merge_state(sa), *db = d2o_merge_state(sb);
    ASSERT_EQ(da == nullptr, db == nullptr);
    if (da) {
      EXPECT_EQ(da->tau, db->tau);
      EXPECT_EQ(da->tau_ready, db->tau_ready);
    }
    EXPECT_EQ(oa->layer_variance, ob->layer_variance);
    EXPECT_EQ(oa->pressure_floor, ob->pressure_floor);
    EXPECT_EQ(oa->prompt_end, ob->prompt_end);
  }
  std::string again = "stale bytes the encoder replaces";
  ASSERT_TRUE(encode_session(ctx, "chat-1", spec, history, b->n_past(), b->cache(),
                             b->policy_state(), again)
                  .ok());
  EXPECT_EQ(again, bytes);

  // What the case is about actually happened.
  if (!policy->is_full()) {
    EXPECT_TRUE(sa.budgets_set);
    EXPECT_LT(a->cache().layer(1).n_slot(), a->n_past());
  }
  if (std::string(c.spec).find("merge=sized") != std::string::npos) {
    int64_t merged = 0;
    for (int64_t m : sa.merged) merged += m;
    EXPECT_GT(merged, 0) << "no merges: the merging d2o case does not test merged slots";
  }
  if (std::string(c.spec).find("pos=shift") != std::string::npos) {
    EXPECT_GT(sa.pos_shift, 0);
  }

  if (a->cache().cold()) {
    ASSERT_NE(b->cache().cold(), nullptr);
    EXPECT_GT(a->cache().cold()->total_slots(), 0) << "nothing cold: the case tests no tier";
    EXPECT_EQ(a->cache().cold()->total_slots(), b->cache().cold()->total_slots());
  }

  // Both go on identically: the restored sequence is the same conversation, token by token and
  // through a new turn (which recalls from a cold tier).
  for (TokenId t : {17, 42, 99, 7, 250}) {
    const std::vector<float> la = feed(*a, {t});
    const std::vector<float> lb = feed(*b, {t});
    ASSERT_EQ(la.size(), lb.size());
    EXPECT_EQ(std::memcmp(la.data(), lb.data(), la.size() * sizeof(float)), 0) << "token " << t;
  }
  {
    const std::vector<TokenId> turn = {12, 44, 81, 9, 130, 66};
    const std::vector<float> la = feed(*a, turn);
    const std::vector<float> lb = feed(*b, turn);
    EXPECT_EQ(std::memcmp(la.data(), lb.data(), la.size() * sizeof(float)), 0) << "the turn";
    if (a->cache().cold()) {
      EXPECT_EQ(b->cache().cold()->recall_turns(), 1);
    }
  }
  std::string ea, eb;
  ASSERT_TRUE(encode_session(ctx, "chat-1", spec, std::vector<TokenId>(a->n_past(), 1),
                             a->n_past(), a->cache(), a->policy_state(), ea)
                  .ok());
  ASSERT_TRUE(encode_session(ctx, "chat-1", spec, std::vector<TokenId>(b->n_past(), 1),
                             b->n_past(), b->cache(), b->policy_state(), eb)
                  .ok());
  EXPECT_EQ(ea, eb);
}

INSTANTIATE_TEST_SUITE_P(
    Policies, SessionFileRoundTrip,
    ::testing::Values(RoundTripCase{"full", KvType::kF16}, RoundTripCase{"full", KvType::kQ8_0},
                      RoundTripCase{"h2o:budget=32", KvType::kF16},
                      RoundTripCase{"d2o:budget=32", KvType::kF16},
                      RoundTripCase{"d2o:budget=32,cold=none", KvType::kF16},
                      RoundTripCase{"d2o:budget=32,merge=sized", KvType::kF16},
                      RoundTripCase{"d2o:budget=32,merge=sized", KvType::kQ8_0},
                      RoundTripCase{"streaming:budget=32,pos=shift", KvType::kQ8_0},
                      RoundTripCase{"d2o:budget=32,cold=memory,cold_type=f16", KvType::kF16},
                      RoundTripCase{"snapkv:budget=40,cold=memory,cold_type=f32", KvType::kQ8_0},
                      RoundTripCase{"d2o:budget=32,cold=disk,cold_type=q8_0", KvType::kF16}),
    [](const ::testing::TestParamInfo<RoundTripCase>& info) {
      std::string name = std::string(info.param.spec) + "_" + kv_type_name(info.param.type);
      for (char& ch : name)
        if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
      return name;
    });

TEST_F(SessionFileTest, EveryKindOfDamageIsRefused) {
  // The hot cache's records (the cold tier's are checked in test_cold_tier.cpp).
  auto policy =
      std::shared_ptr<const KvPolicy>(parse_kv_policy("d2o:budget=32,cold=none").value());
  std::vector<TokenId> history;
  auto seq = conversation(policy, KvType::kF16, history);
  const SessionFileContext ctx = context(KvType::kF16);
  std::string good;
  ASSERT_TRUE(encode_session(ctx, "s", policy->spec(), history, seq->n_past(), seq->cache(),
                             seq->policy_state(), good)
                  .ok());
  ASSERT_TRUE(decode(ctx, good).ok());
  auto refused = [&](const std::string& b, const std::string& needle,
                     const SessionFileContext& c) {
    auto d = decode(c, b);
    ASSERT_FALSE(d.ok()) << "accepted: " << needle;
    EXPECT_NE(d.status().message().find(needle), std::string::npos) << d.status().message();
  };
  // Truncated anywhere.
  for (size_t n : {size_t{0}, size_t{5}, size_t{8}, size_t{15}, size_t{23}, good.size() / 2,
                   good.size() - 9, good.size() - 1}) {
    EXPECT_FALSE(decode(ctx, good.substr(0, n)).ok()) << n << " bytes";
  }
  std::string b = good;
  b[0] = 'X';
  refused(b, "not a d2o session file", ctx);
  b = good;
  b[8] = 3;  // version
  refused(b, "version 3", ctx);
  b[8] = 0;
  refused(b, "version 0", ctx);
  b = good;
  b[good.size() / 2] ^= 0x10;  // a flipped bit anywhere
  refused(b, "checksum", ctx);
  // Another model, another storage type, a shorter context.
  SessionFileContext other = ctx;
  other.model.header_hash ^= 1;
  refused(good, "another model", other);
  refused(good, "KV storage", context(KvType::kQ8_0));
  other = ctx;
  other.max_positions = 64;
  refused(good, "context allows", other);

  // Checks behind the checksum (the file re-summed after each change). Offsets of the layout in
  // serve/session_file.h: the fixed header is 48 bytes, then the id "s" and the spec.
  const size_t spec_at = 48 + 4 + 1;
  const size_t n_past_at = spec_at + 4 + policy->spec().size();
  const size_t tokens_at = n_past_at + 8 + 4;
  b = good;
  const int32_t big_token = 300;  // the vocabulary has 300
  std::memcpy(b.data() + tokens_at, &big_token, 4);
  fix_checksum(b);
  refused(b, "token id 300 out of range", ctx);
  b = good;
  const int64_t n_past = 1000;
  std::memcpy(b.data() + n_past_at, &n_past, 8);
  fix_checksum(b);
  refused(b, "context allows", ctx);
  b = good;
  b[spec_at + 4] = 'x';  // "x2o:..."
  fix_checksum(b);
  refused(b, "bad policy spec", ctx);
  // The last layer's metadata ends the file: pos, score, window, merged [n_head_kv][n_slot].
  const KvLayer& last = seq->cache().layer(seq->cache().n_layer() - 1);
  const size_t rows = static_cast<size_t>(last.n_head_kv()) * last.n_slot();
  const size_t merged_at = good.size() - 8 - rows * 4, window_at = merged_at - rows * 4,
               score_at = window_at - rows * 4, pos_at = score_at - rows * 4;
  b = good;
  std::memcpy(b.data() + pos_at + 4, b.data() + pos_at, 4);  // two slots at one position
  fix_checksum(b);
  refused(b, "not ascending", ctx);
  b = good;
  const float nan = std::nanf("");
  std::memcpy(b.data() + score_at, &nan, 4);
  fix_checksum(b);
  refused(b, "not a finite number", ctx);
  b = good;
  const int32_t minus = -1;
  std::memcpy(b.data() + merged_at, &minus, 4);
  fix_checksum(b);
  refused(b, "merge count", ctx);
  // Bytes after the last layer; a file larger than any session.
  b = good;
  b.insert(b.size() - 8, "abcd");
  fix_checksum(b);
  refused(b, "after the last layer", ctx);
  other = ctx;
  other.max_positions = 1;
  refused(good, "larger", other);
}

// Compression under memory pressure (Scheduler::compress_step) halves a deferred sequence's
// layers step by step down to the budgets its policy decided at the first step (the pressure
// floor). A session written after some steps and read back has that floor, takes the same
// further steps to the same slots and state, and goes on with the same logits as the one that
// stayed in memory; a version 1 file (written before the floor was kept) still reads, and its
// sequence stops at the budgets it holds.
TEST_F(SessionFileTest, ASessionCompressedUnderPressureKeepsItsFloorThroughItsFile) {
  SchedulerParams sp;
  sp.kv_mem_bytes = size_t{8} << 20;
  auto sched = Scheduler::create(*engine_, sp);
  ASSERT_TRUE(sched.ok());
  const SessionFileContext ctx = context(KvType::kF16);
  for (const std::string spec : {"h2o:budget=8", "d2o:budget=12,merge=sized,cold=none",
                                 "d2o:budget=12,cold=memory,cold_type=f16"}) {
    SCOPED_TRACE(spec);
    auto policy = (*sched)->policy(spec).value();
    // A session run with its compactions deferred (`--compress when-needed`): full, 102 slots.
    auto a = std::make_shared<Sequence>(model_->hparams(), KvType::kF16, policy);
    a->set_compaction_deferred(true);
    std::vector<TokenId> history;
    for (int i = 0; i < 90; ++i) history.push_back(3 + (i * 37) % 290);
    feed(*a, history);
    for (int i = 0; i < 12; ++i) {
      history.push_back(5 + (i * 11) % 280);
      feed(*a, {history.back()});
    }
    ASSERT_EQ(a->cache().layer(1).n_slot(), 102);
    // One step under pressure (102 -> 51 slots a layer), then written out.
    ASSERT_TRUE((*sched)->compress_step(*a).value());
    ASSERT_EQ(a->cache().layer(1).n_slot(), 51);
    const std::vector<int> floor = composed_state(a->policy_state())->pressure_floor;
    ASSERT_EQ(floor.size(), 3u);
    EXPECT_EQ(a->policy_state().budgets[1], 51);
    EXPECT_LT(floor[1], 51);
    std::string bytes;
    ASSERT_TRUE(encode_session(ctx, "s", policy->spec(), history, a->n_past(), a->cache(),
                               a->policy_state(), bytes)
                    .ok());
    auto restore = [&](const std::string& file) {
      auto d = decode(ctx, file);
      EXPECT_TRUE(d.ok()) << d.status().to_string();
      auto b = std::make_shared<Sequence>(model_->hparams(), KvType::kF16, policy);
      if (!d.ok()) return b;
      b->cache() = std::move(*d->cache);
      b->policy_state() = std::move(d->state);
      b->advance(d->n_past);
      b->set_compaction_deferred(true);
      return b;
    };
    auto b = restore(bytes);
    ASSERT_NE(composed_state(b->policy_state()), nullptr);
    EXPECT_EQ(composed_state(b->policy_state())->pressure_floor, floor);

    // The same further steps, down to the floor, then none.
    int steps = 0;
    for (;;) {
      auto ra = (*sched)->compress_step(*a);
      auto rb = (*sched)->compress_step(*b);
      ASSERT_TRUE(ra.ok() && rb.ok());
      ASSERT_EQ(*ra, *rb) << "step " << steps + 1;
      for (int il = 0; il < a->cache().n_layer(); ++il)
        ASSERT_EQ(a->cache().layer(il).n_slot(), b->cache().layer(il).n_slot()) << il;
      EXPECT_EQ(a->policy_state().budgets, b->policy_state().budgets);
      EXPECT_EQ(a->policy_state().evicted, b->policy_state().evicted);
      EXPECT_EQ(a->policy_state().merged, b->policy_state().merged);
      if (!*ra) break;
      ++steps;
      ASSERT_LT(steps, 10);
    }
    EXPECT_GE(steps, 2) << "the case takes too few steps to tell a floor from the budgets";
    EXPECT_EQ(a->cache().layer(1).n_slot(), floor[1]);
    if (a->cache().cold()) {
      EXPECT_GT(a->cache().cold()->total_slots(), 0);
      EXPECT_EQ(a->cache().cold()->total_slots(), b->cache().cold()->total_slots());
    }
    // And the same conversation afterwards: a new turn, then token by token.
    {
      const std::vector<TokenId> turn = {12, 44, 81, 9, 130, 66};
      const std::vector<float> la = feed(*a, turn), lb = feed(*b, turn);
      EXPECT_EQ(std::memcmp(la.data(), lb.data(), la.size() * sizeof(float)), 0) << "the turn";
    }
    for (TokenId t : {17, 42, 99}) {
      const std::vector<float> la = feed(*a, {t}), lb = feed(*b, {t});
      EXPECT_EQ(std::memcmp(la.data(), lb.data(), la.size() * sizeof(float)), 0) << t;
    }
    std::string ea, eb;
    const std::vector<TokenId> ones(static_cast<size_t>(a->n_past()), 1);
    ASSERT_TRUE(encode_session(ctx, "s", policy->spec(), ones, a->n_past(), a->cache(),
                               a->policy_state(), ea)
                    .ok());
    ASSERT_TRUE(encode_session(ctx, "s", policy->spec(), ones, b->n_past(), b->cache(),
                               b->policy_state(), eb)
                    .ok());
    EXPECT_EQ(ea, eb);

    if (a->cache().cold()) continue;  // (the layer offsets below assume no cold tier)
    // The file as version 1 wrote it: without the floor and the prompt's end, the last fields
    // of the policy state, just before the layers.
    size_t layers = 0;  // the file's layers, as they were when it was written
    {
      auto d = decode(ctx, bytes);
      ASSERT_TRUE(d.ok());
      for (int il = 0; il < d->cache->n_layer(); ++il) {
        const KvLayer& L = d->cache->layer(il);
        layers += 4 + static_cast<size_t>(L.n_head_kv()) * static_cast<size_t>(L.n_slot()) *
                          (L.key_row_bytes() + L.value_row_bytes() + 16);
      }
    }
    const size_t ext_end = bytes.size() - 8 - layers, added = 4 + 4 * floor.size() + 8;
    std::string v1 = bytes.substr(0, ext_end - added) + bytes.substr(ext_end);
    v1[8] = 1;
    fix_checksum(v1);
    auto old = restore(v1);
    ASSERT_NE(composed_state(old->policy_state()), nullptr);
    EXPECT_TRUE(composed_state(old->policy_state())->pressure_floor.empty());
    EXPECT_EQ(composed_state(old->policy_state())->prompt_end, 0);
    EXPECT_EQ(old->policy_state().budgets, decode(ctx, bytes)->state.budgets);
    EXPECT_FALSE((*sched)->compress_step(*old).value());  // its budgets are its floor
    EXPECT_EQ(old->cache().layer(1).n_slot(), 51);

    // A floor above its layer's budget, or where the layer has none, is refused.
    std::string bad_floor = bytes;
    const int32_t above = 52;
    std::memcpy(bad_floor.data() + ext_end - 8 - 4 * floor.size() + 4, &above, 4);
    fix_checksum(bad_floor);
    auto refused = decode(ctx, bad_floor);
    ASSERT_FALSE(refused.ok());
    EXPECT_NE(refused.status().message().find("pressure floor"), std::string::npos)
        << refused.status().message();
  }
}

// `file` (a conversation's session file, id "s") with its policy spec `from` replaced by `to`,
// the checksum made good again.
std::string with_spec(const std::string& file, const std::string& from, const std::string& to) {
  const size_t spec_at = 48 + 4 + 1;  // the fixed header, then the id "s"
  std::string b = file.substr(0, spec_at);
  const uint32_t n = static_cast<uint32_t>(to.size());
  b.append(reinterpret_cast<const char*>(&n), 4);
  b += to + file.substr(spec_at + 4 + from.size());
  fix_checksum(b);
  return b;
}

// A file written while d2o's defaults were the paper's holds its spec in that era's canonical
// form: it is read as the same policy (reading=paper) in today's form; any other spelling that
// is not canonical is still refused.
TEST_F(SessionFileTest, SpecsWrittenUnderThePapersDefaultsReadAsThePapersD2o) {
  const SessionFileContext ctx = context(KvType::kF16);
  for (const char* spec : {"d2o:reading=paper,budget=32",
                           "d2o:reading=paper,budget=32,proportional_attention=on,heavy_recent=1:3",
                           "d2o:reading=paper,budget=32,prompt_ranking=window,kernel=21,"
                           "prompt_merge=off"}) {
    SCOPED_TRACE(spec);
    const auto [today, good] = file_of(spec);
    // The same spec as canonical then: without the keys that now differ from E's defaults (and
    // from G's, which have a cold tier).
    std::string then = today;
    for (const char* drop : {",prompt_ranking=accumulated", ",prompt_merge=on",
                             ",prompt_scores=accumulated", ",cold=none"}) {
      const size_t at = then.find(drop);
      if (at != std::string::npos) then.erase(at, std::strlen(drop));
    }
    ASSERT_NE(then, today);
    auto d = decode(ctx, with_spec(good, today, then));
    ASSERT_TRUE(d.ok()) << d.status().message();
    EXPECT_EQ(d->kv_spec, today);
    auto now = decode(ctx, good);
    ASSERT_TRUE(now.ok());
    EXPECT_EQ(now->n_past, d->n_past);
  }
  // Any other spelling that is not canonical is still refused.
  const auto [today, good] = file_of("d2o:budget=32");
  auto d = decode(ctx, with_spec(good, today, " " + today));  // parses, but is not canonical
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("not canonical"), std::string::npos);
}

// A file written before the keys had readable names holds its spec in the old names: it is read
// as the same policy in today's names (a paper-era one as the paper's D2O, as above).
TEST_F(SessionFileTest, SpecsWrittenUnderTheOldKeyNamesReadAsTheSamePolicy) {
  const SessionFileContext ctx = context(KvType::kF16);
  struct Case {
    const char* spec;
    const char* written;  // its canonical form then
  };
  for (const Case& c :
       {Case{"d2o:budget=32,cold=none",  // written before d2o had a cold tier by default
             "d2o:budget=32,sinks=4,nm=1:1,beta=0.7,layers=uniform,merge=off,sim=key,ema=paper,"
             "agg=sum,norm=queries,mscore=sum,mrope=post,decide=head,protect=none,mass=on,"
             "prompt=window,window=32,kernel=21,pool=avg,pmerge=off,pscore=window"},
        Case{"streaming:budget=32,positions=shifted", "streaming:budget=32,sinks=4,pos=shift"},
        Case{"cam:budget=32,merge_targets=8", "cam:budget=32,sinks=4,mb=8,seed=0,agg=sum"},
        Case{"d2o:reading=paper,budget=32",
             "d2o:budget=32,sinks=4,nm=3:1,beta=0.7,layers=variance,merge=weighted,sim=key,"
             "ema=paper,agg=sum,norm=none,mscore=sum,mrope=post,decide=head,protect=none,"
             "mass=off"}}) {
    SCOPED_TRACE(c.written);
    const auto [today, good] = file_of(c.spec);
    ASSERT_NE(today, c.written);
    auto d = decode(ctx, with_spec(good, today, c.written));
    ASSERT_TRUE(d.ok()) << d.status().message();
    EXPECT_EQ(d->kv_spec, today);
    auto now = decode(ctx, good);
    ASSERT_TRUE(now.ok());
    EXPECT_EQ(d->n_past, now->n_past);
    EXPECT_EQ(d->tokens, now->tokens);
    // The cache is that of the policy it ran (no cold tier where it had none), so the session
    // is written back under today's spec and read again as itself.
    EXPECT_EQ(d->cache->cold() != nullptr, parse_kv_policy(today).value()->cold_tier().enabled());
    std::string again;
    ASSERT_TRUE(
        encode_session(ctx, d->id, d->kv_spec, d->tokens, d->n_past, *d->cache, d->state, again)
            .ok());
    auto d2 = decode(ctx, again);
    ASSERT_TRUE(d2.ok()) << d2.status().message();
    EXPECT_EQ(d2->kv_spec, today);
  }
  // Old names in a spec that was not canonical then either are still refused.
  const auto [today, good] = file_of("h2o:budget=32");
  auto d = decode(ctx, with_spec(good, today, "h2o:budget=32,nm=1:1"));
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("not canonical"), std::string::npos);
}

TEST_F(SessionFileTest, DirectoryWritesAtomicallyUnderSafeNamesAndReadsBack) {
  const std::string dir = d2o::test::scratch_path("session_dir_test");
  std::filesystem::remove_all(dir);
  const SessionFileContext ctx = context(KvType::kF16);
  auto sd = SessionDir::open(dir, ctx);
  ASSERT_TRUE(sd.ok()) << sd.status().to_string();
  EXPECT_FALSE(sd->path_for("../evil").ok());
  EXPECT_FALSE(sd->path_for("a/b").ok());
  EXPECT_FALSE(sd->path_for("").ok());
  EXPECT_EQ(sd->path_for("..").value(), dir + "/...d2os");  // a plain name inside dir

  auto none = sd->load("nobody");
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());

  auto policy = std::shared_ptr<const KvPolicy>(parse_kv_policy("h2o:budget=32").value());
  std::vector<TokenId> history;
  auto seq = conversation(policy, KvType::kF16, history);
  auto n = sd->save("a:1", policy->spec(), history, seq->n_past(), seq->cache(),
                    seq->policy_state());
  ASSERT_TRUE(n.ok()) << n.status().to_string();
  EXPECT_EQ(std::filesystem::file_size(dir + "/a:1.d2os"), *n);
  EXPECT_FALSE(std::filesystem::exists(dir + "/a:1.d2os.tmp"));
  auto back = sd->load("a:1");
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  ASSERT_TRUE(back->has_value());
  EXPECT_EQ((*back)->tokens, history);

  // A file under another session's name, a truncated file, a directory: refused, no crash.
  std::filesystem::copy_file(dir + "/a:1.d2os", dir + "/b.d2os");
  auto wrong = sd->load("b");
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.status().message().find("holds session 'a:1'"), std::string::npos);
  std::filesystem::resize_file(dir + "/b.d2os", 100);
  EXPECT_FALSE(sd->load("b").ok());
  std::filesystem::create_directory(dir + "/c.d2os");
  EXPECT_FALSE(sd->load("c").ok());
  sd->remove("a:1");
  EXPECT_FALSE(std::filesystem::exists(dir + "/a:1.d2os"));
  // Not a directory.
  EXPECT_FALSE(SessionDir::open(dir + "/b.d2os", ctx).ok());
  std::filesystem::remove_all(dir);
}

// Opening a directory removes the temporary files a killed process left; with a bound, a write
// past it removes the least recently used other files (written or read), never the one written.
TEST_F(SessionFileTest, DirectoryRemovesStraysAndKeepsItsBoundLeastRecentlyUsedFirst) {
  const std::string dir = d2o::test::scratch_path("session_dir_bound_test");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  { std::ofstream(dir + "/gone.d2os.tmp") << "half a file"; }
  auto policy = std::shared_ptr<const KvPolicy>(parse_kv_policy("full").value());
  std::vector<TokenId> history;
  auto seq = conversation(policy, KvType::kF16, history);
  auto save = [&](SessionDir& sd, const std::string& id) {
    auto n = sd.save(id, policy->spec(), history, seq->n_past(), seq->cache(), seq->policy_state());
    EXPECT_TRUE(n.ok()) << n.status().to_string();
    return n.ok() ? *n : size_t{0};
  };
  uint64_t one = 0;
  {
    auto sd = SessionDir::open(dir, context(KvType::kF16));
    ASSERT_TRUE(sd.ok());
    EXPECT_EQ(sd->strays_removed(), 1);
    EXPECT_FALSE(std::filesystem::exists(dir + "/gone.d2os.tmp"));
    one = save(*sd, "a");
    save(*sd, "b");
    EXPECT_EQ(sd->bytes_held(), 2 * one);
  }
  // Reopened with room for three files: the index is rebuilt from the directory.
  auto sd = SessionDir::open(dir, context(KvType::kF16), 3 * one);
  ASSERT_TRUE(sd.ok());
  EXPECT_EQ(sd->bytes_held(), 2 * one);
  save(*sd, "c");
  ASSERT_TRUE(sd->load("a").value().has_value());  // a is now more recent than b
  save(*sd, "d");                                    // four files: b, the least recent, goes
  EXPECT_EQ(sd->files_removed(), 1);
  EXPECT_FALSE(std::filesystem::exists(dir + "/b.d2os"));
  for (const char* id : {"a", "c", "d"})
    EXPECT_TRUE(std::filesystem::exists(dir + "/" + id + ".d2os")) << id;
  EXPECT_EQ(sd->bytes_held(), 3 * one);
  sd->remove("c");
  EXPECT_EQ(sd->bytes_held(), 2 * one);
  // A bound smaller than one file keeps only the file just written.
  auto tiny = SessionDir::open(dir, context(KvType::kF16), 1);
  ASSERT_TRUE(tiny.ok());
  save(*tiny, "e");
  EXPECT_TRUE(std::filesystem::exists(dir + "/e.d2os"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/a.d2os"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/d.d2os"));
  std::filesystem::remove_all(dir);
}

// Sessions of a key are files of their own: `<name>@<id>.d2os` beside the default namespace's
// `<id>.d2os` (the files of a server from before key names, read by the key named "default").
// A file holds the id it was kept under, so one moved into another name's place is refused.
TEST_F(SessionFileTest, KeyNamespacesKeepFilesApart) {
  const std::string dir = d2o::test::scratch_path("session_dir_keys_test");
  std::filesystem::remove_all(dir);
  auto sd = SessionDir::open(dir, context(KvType::kF16));
  ASSERT_TRUE(sd.ok()) << sd.status().to_string();
  EXPECT_FALSE(sd->path_for("default@x").ok());  // the default namespace has no prefix
  EXPECT_FALSE(sd->path_for("a/b@x").ok());
  EXPECT_FALSE(sd->path_for("a@b@x").ok());
  EXPECT_EQ(sd->path_for(scoped_session_id("..", "x")).value(), dir + "/..@x.d2os");
  EXPECT_EQ(sd->path_for(scoped_session_id("default", "x")).value(), dir + "/x.d2os");

  auto policy = std::shared_ptr<const KvPolicy>(parse_kv_policy("full").value());
  std::vector<TokenId> history;
  auto seq = conversation(policy, KvType::kF16, history);
  const std::string alice_x = scoped_session_id("alice", "x");
  ASSERT_TRUE(
      sd->save(alice_x, policy->spec(), history, seq->n_past(), seq->cache(), seq->policy_state())
          .ok());
  EXPECT_TRUE(std::filesystem::exists(dir + "/alice@x.d2os"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/x.d2os"));
  auto none = sd->load(scoped_session_id("bob", "x"));
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());
  none = sd->load(scoped_session_id("default", "x"));
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());
  auto back = sd->load(alice_x);
  ASSERT_TRUE(back.ok() && back->has_value());
  EXPECT_EQ((*back)->id, "alice@x");

  std::filesystem::copy_file(dir + "/alice@x.d2os", dir + "/bob@x.d2os");
  std::filesystem::copy_file(dir + "/alice@x.d2os", dir + "/x.d2os");
  for (const char* other : {"bob@x", "x"}) {
    auto moved = sd->load(other);
    ASSERT_FALSE(moved.ok()) << other;
    EXPECT_NE(moved.status().message().find("holds session 'alice@x'"), std::string::npos);
  }
  std::filesystem::remove_all(dir);
}

TEST_F(SessionFileTest, StoreWritesSessionsThatLeaveMemoryAndAdoptsThemBack) {
  const std::string dir = d2o::test::scratch_path("session_store_dir_test");
  std::filesystem::remove_all(dir);
  auto sd = SessionDir::open(dir, context(KvType::kF16));
  ASSERT_TRUE(sd.ok());
  SchedulerParams sp;
  sp.kv_mem_bytes = size_t{8} << 20;
  sp.prefill_chunk = 16;
  sp.max_running = 4;
  auto sched = Scheduler::create(*engine_, sp);
  ASSERT_TRUE(sched.ok());
  auto policy = (*sched)->policy("full").value();
  std::vector<TokenId> history;
  {
    SessionStore store(**sched);
    store.set_dir(&*sd, /*save_every_turn=*/false);
    auto first = conversation(policy, KvType::kF16, history);
    store.begin("x");
    store.end("x", first, history, "full");
    EXPECT_FALSE(std::filesystem::exists(dir + "/x.d2os"));  // written only when it leaves
    EXPECT_EQ(store.make_room((**sched).pool().cap()), 1);
    EXPECT_TRUE(std::filesystem::exists(dir + "/x.d2os"));
    EXPECT_EQ(store.file_stats().saved, 1);

    auto d = sd->load("x").value();
    ASSERT_TRUE(d.has_value());
    auto seq = std::make_shared<Sequence>(model_->hparams(), KvType::kF16, policy);
    seq->cache() = std::move(*d->cache);
    seq->advance(d->n_past);
    ASSERT_TRUE(store.adopt("x", seq, d->tokens, d->kv_spec));
    EXPECT_EQ((**sched).pool().reserved(), store.held_bytes());
    EXPECT_EQ(store.save_all(), 0);  // its file is current
    // Every turn: written as the request ends.
    store.set_dir(&*sd, /*save_every_turn=*/true);
    std::filesystem::remove(dir + "/x.d2os");
    Session& s = store.begin("x");
    size_t held = 0;
    auto taken = store.take(s, held);
    (**sched).release_held(held);
    store.end("x", taken, history, "full");
    EXPECT_FALSE(std::filesystem::exists(dir + "/x.d2os"));  // queued
    store.save_pending();
    EXPECT_TRUE(std::filesystem::exists(dir + "/x.d2os"));

    // A session that cannot fit even without the idle ones is not read back, and evicts none.
    std::vector<TokenId> longer;
    auto y = conversation(policy, KvType::kF16, longer);
    feed(*y, std::vector<TokenId>(40, 7));  // larger than "x"
    longer.resize(static_cast<size_t>(y->n_past()), 7);
    const size_t rest = (**sched).pool().available();
    ASSERT_TRUE((**sched).hold(rest - 100));
    EXPECT_FALSE(store.adopt("y", y, longer, "full"));
    EXPECT_NE(store.find("x"), nullptr);
    (**sched).release_held(rest - 100);
  }
  EXPECT_EQ((**sched).pool().reserved(), 0u);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace d2o::serve
