#include "eval/niah.h"

#include <algorithm>
#include <cmath>

#include "core/timer.h"
#include "eval/fork.h"
#include "eval/stats.h"

namespace d2o::eval {

namespace {

// Names for the needle task's keys (RULER draws random words; a fixed list keeps runs
// reproducible and the keys single, common words).
const char* const kWords[] = {
    "apple",   "river",   "falcon", "garden",  "silver", "candle", "harbor",  "meadow",
    "copper",  "lantern", "orchid", "thunder", "violet", "willow", "ember",   "glacier",
    "marble",  "pepper",  "quartz", "saffron", "tundra", "velvet", "walnut",  "cobalt",
    "dolphin", "jasmine", "maple",  "nectar",  "pebble", "raven",  "sparrow", "timber"};

constexpr const char* kNeedleInstruction =
    "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
    "I will quiz you "
    "about the numbers afterwards.";
constexpr const char* kPasskeyInstruction =
    "There is an important piece of information hidden inside a lot of irrelevant text. Find it "
    "and memorize it. "
    "I will quiz you about it.";
constexpr const char* kFillerUnit =
    " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.";
constexpr const char* kMarker = "@@D2O_NIAH_USER_MESSAGE@@";

struct TaskText {
  std::string instruction, needle, question, answer_prefix;
};

TaskText task_text(NiahTask task, const std::string& key, const std::string& word) {
  if (task == NiahTask::kNeedle) {
    return {kNeedleInstruction,
            " One of the special magic numbers for " + word + " is: " + key + ".",
            "What is the special magic number for " + word + " mentioned in the provided text?",
            "The special magic number for " + word + " mentioned in the provided text is"};
  }
  return {kPasskeyInstruction,
          " The pass key is " + key + ". Remember it. " + key + " is the pass key.",
          "What is the pass key?", "The pass key is"};
}

// Placeholder texts of the longest key and word, to size the fixed parts of a prompt.
TaskText longest_text(NiahTask task) {
  return task_text(task, task == NiahTask::kNeedle ? "9999999" : "99999", "saffron");
}

}  // namespace

Status chat_turn_parts(const Tokenizer& tok, const ChatTemplate& chat, std::string* prefix,
                       std::string* suffix) {
  ChatApplyOptions opts;
  opts.add_generation_prompt = true;
  opts.skip_bos = tok.add_bos();  // the tokenizer adds the BOS token itself
  const std::string rendered = chat.apply({{"user", kMarker}}, opts);
  const size_t at = rendered.find(kMarker);
  if (at == std::string::npos) return internal_error("the chat template dropped the user message");
  *prefix = rendered.substr(0, at);
  *suffix = rendered.substr(at + std::string(kMarker).size());
  return {};
}

const char* niah_task_name(NiahTask t) {
  return t == NiahTask::kNeedle ? "needle" : "passkey";
}

Result<NiahBuilder> NiahBuilder::create(const Tokenizer& tok, const ChatTemplate* chat,
                                        std::string_view haystack) {
  NiahBuilder b(tok);
  if (chat) D2O_RETURN_IF_ERROR(chat_turn_parts(tok, *chat, &b.chat_prefix_, &b.chat_suffix_));
  D2O_ASSIGN_OR_RETURN(b.haystack_, b.encode(std::string(haystack), false));
  D2O_ASSIGN_OR_RETURN(b.filler_unit_, b.encode(kFillerUnit, false));
  if (b.filler_unit_.empty()) return internal_error("the passkey filler produced no tokens");
  return b;
}

Result<std::vector<TokenId>> NiahBuilder::encode(const std::string& text, bool add_special) const {
  EncodeOptions o;
  o.add_special = add_special;
  o.parse_special = true;  // chat markers become their special tokens
  return tok_->encode(text, o);
}

int64_t NiahBuilder::sentence_start(std::span<const TokenId> ctx, int64_t at) const {
  constexpr int64_t kMaxBack = 400;  // tokens; past that, the asked position is used as is
  for (int64_t i = at; i > 0 && at - i <= kMaxBack; --i) {
    auto piece = tok_->token_to_piece(ctx[static_cast<size_t>(i - 1)], false);
    if (!piece.ok() || piece->empty()) continue;
    const char last = piece->back();
    if (last == '.' || last == '!' || last == '?' || piece->find('\n') != std::string::npos)
      return i;
  }
  return at;
}

int NiahBuilder::min_length(NiahTask task) const {
  const TaskText t = longest_text(task);
  auto n = [&](const std::string& s, bool special) {
    auto r = encode(s, special);
    return r.ok() ? static_cast<int>(r->size()) : 0;
  };
  const int fixed =
      n(chat_prefix_ + t.instruction + "\n\n", true) + n(t.needle, false) +
      n("\n\n" + t.question + (uses_chat_template() ? chat_suffix_ : " ") + t.answer_prefix, false);
  return fixed + 16;  // at least a little context around the needle
}

Result<NiahBuilder::Trial> NiahBuilder::build(NiahTask task, int length, double depth,
                                              uint64_t seed) const {
  if (!(depth >= 0.0 && depth <= 1.0)) return invalid_argument("needle depth must be in [0, 1]");
  SplitMix64 rng(seed);
  Trial t;
  t.task = task;
  t.length = length;
  t.depth = depth;
  if (task == NiahTask::kNeedle) {
    t.key = std::to_string(1000000 + rng.below(9000000));
    t.word = kWords[rng.below(sizeof kWords / sizeof kWords[0])];
  } else {
    t.key = std::to_string(10000 + rng.below(90000));
  }
  const TaskText tt = task_text(task, t.key, t.word);
  D2O_ASSIGN_OR_RETURN(std::vector<TokenId> head,
                       encode(chat_prefix_ + tt.instruction + "\n\n", true));
  D2O_ASSIGN_OR_RETURN(std::vector<TokenId> needle, encode(tt.needle, false));
  D2O_ASSIGN_OR_RETURN(
      std::vector<TokenId> tail,
      encode("\n\n" + tt.question + (uses_chat_template() ? chat_suffix_ : " ") + tt.answer_prefix,
             false));
  const int64_t n_ctx = static_cast<int64_t>(length) -
                        static_cast<int64_t>(head.size() + needle.size() + tail.size());
  if (n_ctx < 16) {
    return invalid_argument(
        "a " + std::string(niah_task_name(task)) + " prompt of " + std::to_string(length) +
        " tokens leaves no room for the haystack (instruction, needle and question take " +
        std::to_string(head.size() + needle.size() + tail.size()) +
        " tokens); use lengths of at least " + std::to_string(min_length(task)));
  }
  std::vector<TokenId> ctx;
  ctx.reserve(static_cast<size_t>(n_ctx));
  if (task == NiahTask::kNeedle) {
    const int64_t n_hay = static_cast<int64_t>(haystack_.size());
    if (n_hay < n_ctx) {
      return invalid_argument("the haystack has " + std::to_string(n_hay) +
                              " tokens, fewer than the " + std::to_string(n_ctx) + " a " +
                              std::to_string(length) +
                              "-token prompt needs; use a longer haystack or shorter --lengths");
    }
    // A random start (seeded), moved to a sentence start so the context begins cleanly.
    int64_t off = n_hay > n_ctx
                      ? static_cast<int64_t>(rng.below(static_cast<uint64_t>(n_hay - n_ctx + 1)))
                      : 0;
    const int64_t s = sentence_start(haystack_, off);
    if (s <= off && s + n_ctx <= n_hay) off = s;
    t.haystack_offset = off;
    ctx.assign(haystack_.begin() + off, haystack_.begin() + off + n_ctx);
  } else {
    while (static_cast<int64_t>(ctx.size()) < n_ctx) {
      for (TokenId id : filler_unit_) {
        if (static_cast<int64_t>(ctx.size()) == n_ctx) break;
        ctx.push_back(id);
      }
    }
  }
  const int64_t asked = std::llround(depth * static_cast<double>(n_ctx));
  const int64_t at = depth >= 1.0 ? n_ctx : sentence_start(ctx, asked);
  t.depth_used = static_cast<double>(at) / static_cast<double>(n_ctx);
  t.prompt.reserve(static_cast<size_t>(length));
  t.prompt.insert(t.prompt.end(), head.begin(), head.end());
  t.prompt.insert(t.prompt.end(), ctx.begin(), ctx.begin() + at);
  t.prompt.insert(t.prompt.end(), needle.begin(), needle.end());
  t.prompt.insert(t.prompt.end(), ctx.begin() + at, ctx.end());
  t.prompt.insert(t.prompt.end(), tail.begin(), tail.end());
  if (static_cast<int>(t.prompt.size()) != length)
    return internal_error("needle prompt length mismatch");
  return t;
}

bool answer_matches(std::string_view answer, std::string_view key) {
  size_t i = 0;
  while (i < answer.size() && !(answer[i] >= '0' && answer[i] <= '9')) ++i;
  size_t j = i;
  while (j < answer.size() && answer[j] >= '0' && answer[j] <= '9') ++j;
  return j > i && answer.substr(i, j - i) == key;
}

Result<std::vector<NiahAnswer>> answer_greedy(Engine& engine, const Tokenizer& tok,
                                              std::span<const TokenId> prompt,
                                              std::span<const PolicyUnderTest> policies,
                                              int max_new, KvType kv_type) {
  if (max_new < 1) return invalid_argument("max_new must be at least 1");
  std::vector<std::shared_ptr<const KvPolicy>> ps;
  for (const PolicyUnderTest& p : policies) ps.push_back(p.policy);
  D2O_ASSIGN_OR_RETURN(ForkedPrefill fork, prefill_forked(engine, prompt, ps, kv_type));
  const int nv = engine.model().hparams().n_vocab;
  const size_t n = policies.size();
  std::vector<NiahAnswer> out(n);
  // The same steps as generate() with greedy sampling: choose from the latest logits; stop at an
  // end-of-generation token (not kept) or after max_new tokens; otherwise feed the token.
  std::vector<TokenId> next(n, argmax(fork.last_logits.data(), nv));
  std::vector<uint8_t> active(n, 1);
  std::vector<BatchEntry> batch;
  std::vector<size_t> who;
  std::vector<TokenId> feed(n);
  for (int step = 0; step < max_new; ++step) {
    batch.clear();
    who.clear();
    for (size_t i = 0; i < n; ++i) {
      if (!active[i]) continue;
      if (tok.is_eog(next[i])) {
        active[i] = 0;
        continue;
      }
      out[i].tokens.push_back(next[i]);
      if (static_cast<int>(out[i].tokens.size()) == max_new) {
        active[i] = 0;
        continue;
      }
      feed[i] = next[i];
      batch.push_back(BatchEntry{fork.seqs[i].get(), {&feed[i], 1}, -1});
      who.push_back(i);
    }
    if (batch.empty()) break;
    D2O_RETURN_IF_ERROR(engine.forward(batch, [&](int e, int, const float* l) {
      next[who[static_cast<size_t>(e)]] = argmax(l, nv);
    }));
  }
  for (NiahAnswer& a : out) {
    auto text = tok.decode(a.tokens, /*render_special=*/false);
    a.text = text.ok() ? *text : std::string();
  }
  return out;
}

Result<NiahResult> run_niah(Engine& engine, const Tokenizer& tok, const NiahBuilder& builder,
                            const NiahParams& p, Progress* progress) {
  if (p.policies.empty()) return invalid_argument("no policies to evaluate");
  if (p.lengths.empty() || p.depths.empty() || p.tasks.empty())
    return invalid_argument("empty niah grid");
  if (p.trials < 1) return invalid_argument("--trials must be at least 1");
  for (double d : p.depths) {
    if (!(d >= 0.0 && d <= 1.0))
      return invalid_argument("needle depths must be in [0, 100] percent");
  }
  for (NiahTask task : p.tasks) {
    const int key_digits = task == NiahTask::kNeedle ? 7 : 5;
    for (int len : p.lengths) {
      // The answer's tokens take positions too: the whole exchange must fit the trained context.
      if (p.n_ctx_train > 0 && len + key_digits + 4 > p.n_ctx_train) {
        return invalid_argument("context length " + std::to_string(len) + " plus the answer (" +
                                std::to_string(key_digits + 4) +
                                " tokens) exceeds the model's trained context of " +
                                std::to_string(p.n_ctx_train) + " tokens; use --lengths up to " +
                                std::to_string(p.n_ctx_train - key_digits - 4));
      }
      if (len < builder.min_length(task)) {
        return invalid_argument("context length " + std::to_string(len) + " is too short for the " +
                                niah_task_name(task) + " task (at least " +
                                std::to_string(builder.min_length(task)) + " tokens)");
      }
    }
  }
  NiahResult res;
  Stopwatch sw;
  for (size_t ti = 0; ti < p.tasks.size(); ++ti) {
    const NiahTask task = p.tasks[ti];
    const int max_new = (task == NiahTask::kNeedle ? 7 : 5) + 4;
    for (int len : p.lengths) {
      for (size_t di = 0; di < p.depths.size(); ++di) {
        for (int trial = 0; trial < p.trials; ++trial) {
          // One seed per cell and trial, derived from the run's seed (cells are independent).
          const uint64_t seed = cell_seed(
              p.seed, (static_cast<uint64_t>(task == NiahTask::kNeedle ? 1 : 2) << 56) ^
                          (static_cast<uint64_t>(len) << 24) ^ (static_cast<uint64_t>(di) << 12) ^
                          static_cast<uint64_t>(trial));
          D2O_ASSIGN_OR_RETURN(NiahBuilder::Trial t, builder.build(task, len, p.depths[di], seed));
          D2O_ASSIGN_OR_RETURN(
              std::vector<NiahAnswer> answers,
              answer_greedy(engine, tok, t.prompt, p.policies, max_new, p.kv_type));
          NiahOutcome o{task, len, p.depths[di], t.depth_used, trial, t.key, t.word, {}, {}};
          for (const NiahAnswer& a : answers) {
            o.answers.push_back(a.text);
            o.correct.push_back(answer_matches(a.text, t.key) ? 1 : 0);
          }
          res.outcomes.push_back(std::move(o));
          if (progress) {
            progress->add(static_cast<double>(len),
                          std::string(niah_task_name(task)) + " " + std::to_string(len));
          }
        }
      }
    }
  }
  {
    std::vector<std::shared_ptr<const KvPolicy>> ps;
    for (const PolicyUnderTest& q : p.policies) ps.push_back(q.policy);
    res.n_prefills = static_cast<int>(group_by_stats(ps).needs.size());
  }
  res.seconds = sw.seconds();
  return res;
}

}  // namespace d2o::eval
