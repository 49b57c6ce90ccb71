#include "eval/niah.h"

#include <algorithm>
#include <cmath>

#include "core/timer.h"
#include "eval/answer.h"
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
                                        std::string_view haystack, QuestionShape shape) {
  D2O_RETURN_IF_ERROR(check_question_shape(shape));
  NiahBuilder b(tok);
  b.shape_ = shape;
  D2O_ASSIGN_OR_RETURN(b.turns_, TurnTexts::create(tok, chat, shape.setting));
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
  const auto tail = turns_.tail("\n\n", t.question, t.answer_prefix);
  const int needles = task == NiahTask::kNeedle ? shape_.questions : 1;
  const int fixed = n(turns_.prefix() + t.instruction + "\n\n", true) +
                    needles * n(t.needle, false) + n(tail.first, false) + n(tail.second, false);
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
  // QuestionShape: the needle task's questions 2..K, each with a word and a key of its own.
  const size_t n_needles = task == NiahTask::kNeedle ? static_cast<size_t>(shape_.questions) : 1;
  std::vector<std::string> keys = {t.key}, words = {t.word};
  while (keys.size() < n_needles) {
    const std::string k = std::to_string(1000000 + rng.below(9000000));
    const std::string w = kWords[rng.below(sizeof kWords / sizeof kWords[0])];
    if (std::find(words.begin(), words.end(), w) != words.end() ||
        std::find(keys.begin(), keys.end(), k) != keys.end())
      continue;
    keys.push_back(k);
    words.push_back(w);
  }
  std::vector<TaskText> texts;
  for (size_t i = 0; i < n_needles; ++i) texts.push_back(task_text(task, keys[i], words[i]));
  const TaskText& tt = texts[0];
  D2O_ASSIGN_OR_RETURN(std::vector<TokenId> head,
                       encode(turns_.prefix() + tt.instruction + "\n\n", true));
  std::vector<std::vector<TokenId>> needles;
  size_t n_needle = 0;
  for (const TaskText& x : texts) {
    D2O_ASSIGN_OR_RETURN(std::vector<TokenId> ids, encode(x.needle, false));
    n_needle += ids.size();
    needles.push_back(std::move(ids));
  }
  // Each question's tail: {the end of the context turn, the question turn}.
  std::vector<std::vector<TokenId>> turn_end, question;
  size_t n_tail = 0;  // the longest, so that every question's prompt fits the length
  for (const TaskText& x : texts) {
    const auto tail = turns_.tail("\n\n", x.question, x.answer_prefix);
    D2O_ASSIGN_OR_RETURN(std::vector<TokenId> a, encode(tail.first, false));
    D2O_ASSIGN_OR_RETURN(std::vector<TokenId> b, encode(tail.second, false));
    n_tail = std::max(n_tail, a.size() + b.size());
    turn_end.push_back(std::move(a));
    question.push_back(std::move(b));
  }
  const int64_t n_ctx =
      static_cast<int64_t>(length) - static_cast<int64_t>(head.size() + n_needle + n_tail);
  if (n_ctx < 16) {
    return invalid_argument(
        "a " + std::string(niah_task_name(task)) + " prompt of " + std::to_string(length) +
        " tokens leaves no room for the haystack (instruction, needle and question take " +
        std::to_string(head.size() + n_needle + n_tail) + " tokens); use lengths of at least " +
        std::to_string(min_length(task)));
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
  // Where each needle goes: the cell's depth for the first, seeded random depths for the others.
  std::vector<int64_t> at(n_needles);
  for (size_t i = 0; i < n_needles; ++i) {
    const double d = i == 0 ? depth : static_cast<double>(rng.below(1001)) / 1000.0;
    const int64_t asked = std::llround(d * static_cast<double>(n_ctx));
    at[i] = d >= 1.0 ? n_ctx : sentence_start(ctx, asked);
  }
  t.depth_used = static_cast<double>(at[0]) / static_cast<double>(n_ctx);
  std::vector<size_t> order(n_needles);
  for (size_t i = 0; i < n_needles; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return at[a] < at[b]; });
  t.prompt.reserve(static_cast<size_t>(length));
  t.prompt.insert(t.prompt.end(), head.begin(), head.end());
  int64_t prev = 0;
  for (size_t i : order) {
    t.prompt.insert(t.prompt.end(), ctx.begin() + prev, ctx.begin() + at[i]);
    t.prompt.insert(t.prompt.end(), needles[i].begin(), needles[i].end());
    prev = at[i];
  }
  t.prompt.insert(t.prompt.end(), ctx.begin() + prev, ctx.end());
  t.prompt.insert(t.prompt.end(), turn_end[0].begin(), turn_end[0].end());
  t.context_end = static_cast<int64_t>(t.prompt.size());
  t.prompt.insert(t.prompt.end(), question[0].begin(), question[0].end());
  if (turns_.setting() == QuestionSetting::kBefore)
    t.context_end = static_cast<int64_t>(t.prompt.size());
  if (n_needles == 1 && static_cast<int>(t.prompt.size()) != length)
    return internal_error("needle prompt length mismatch");
  for (size_t i = 1; i < n_needles; ++i) {
    t.more.push_back(
        {question[i], keys[i], words[i], static_cast<double>(at[i]) / static_cast<double>(n_ctx)});
  }
  return t;
}

bool answer_matches(std::string_view answer, std::string_view key) {
  size_t i = 0;
  while (i < answer.size() && !(answer[i] >= '0' && answer[i] <= '9')) ++i;
  size_t j = i;
  while (j < answer.size() && answer[j] >= '0' && answer[j] <= '9') ++j;
  return j > i && answer.substr(i, j - i) == key;
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
          AnswerRequest req;
          req.policies = p.policies;
          req.max_new = max_new;
          req.kv_type = p.kv_type;
          req.chunk = p.chunk;
          const std::span<const TokenId> prompt(t.prompt);
          req.context = prompt.first(static_cast<size_t>(t.context_end));
          if (t.context_end < static_cast<int64_t>(t.prompt.size())) {
            req.questions.push_back(prompt.subspan(static_cast<size_t>(t.context_end)));
            for (const NiahBuilder::Trial::FollowUp& f : t.more) req.questions.push_back(f.tokens);
          }
          D2O_ASSIGN_OR_RETURN(GreedyAnswers answers, answer_questions(engine, tok, req));
          NiahOutcome o{task,   len, p.depths[di], t.depth_used, trial, t.key,
                        t.word, {},  {},           {},           {},    {}};
          o.answers = answers.text[0];
          for (const std::string& a : o.answers) o.correct.push_back(answer_matches(a, t.key));
          for (size_t m = 0; m < t.more.size(); ++m) {
            o.more_keys.push_back(t.more[m].key);
            o.more_answers.push_back(answers.text[m + 1]);
            o.more_correct.emplace_back();
            for (const std::string& a : answers.text[m + 1])
              o.more_correct.back().push_back(answer_matches(a, t.more[m].key));
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
