#include "eval/ruler.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <numbers>
#include <unordered_set>

#include "eval/niah.h"
#include "eval/stats.h"

namespace d2o::eval {

namespace {

constexpr const char* kFiller =
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n";
constexpr const char* kVtInstruction =
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n";
constexpr const char* kCweInstruction =
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n";
constexpr const char* kCweQuestion =
    "Question: What are the 10 most common words in the above list?";
constexpr const char* kCweAnswer =
    "Answer: The top 10 words that appear most often in the list are:";
constexpr const char* kFweInstruction =
    "Read the following coded text and track the frequency of each coded word. Find the three "
    "most frequently appeared coded words.";
constexpr const char* kFweQuestion =
    "Question: Do not provide any explanation. Please ignore the dots '....'. What are the three "
    "most frequently appeared words in the above coded text?";
constexpr const char* kFweAnswer =
    "Answer: According to the coded text above, the three most frequently appeared words are:";
constexpr const char* kFweNoise = "....";
constexpr int kCommonWords = 10;  // cwe

// k distinct indices of [0, n), in random order (partial Fisher-Yates).
std::vector<size_t> sample_indices(size_t n, size_t k, SplitMix64& rng) {
  std::vector<size_t> idx(n);
  for (size_t i = 0; i < n; ++i) idx[i] = i;
  for (size_t i = 0; i < k && i < n; ++i) std::swap(idx[i], idx[i + rng.below(n - i)]);
  idx.resize(std::min(k, n));
  return idx;
}

template <class T>
void shuffle(std::vector<T>& v, SplitMix64& rng) {
  for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[rng.below(i)]);
}

std::string join(const std::vector<std::string>& v, const std::string& sep) {
  std::string o;
  for (size_t i = 0; i < v.size(); ++i) o += (i ? sep : "") + v[i];
  return o;
}

std::string numbered(const std::vector<std::string>& v) {
  std::string o;
  for (size_t i = 0; i < v.size(); ++i) o += (i ? " " : "") + std::to_string(i + 1) + ". " + v[i];
  return o;
}

std::string random_letters(SplitMix64& rng, int n, char first) {
  std::string s;
  for (int i = 0; i < n; ++i) s += static_cast<char>(first + rng.below(26));
  return s;
}

bool is_niah(RulerTask t) {
  return t == RulerTask::kNiahSingle || t == RulerTask::kNiahMultikey ||
         t == RulerTask::kNiahMultivalue || t == RulerTask::kNiahMultiquery;
}

}  // namespace

Result<RulerBuilder> RulerBuilder::create(const Tokenizer& tok, const ChatTemplate* chat,
                                          std::string_view haystack, QuestionShape shape) {
  D2O_RETURN_IF_ERROR(check_question_shape(shape));
  RulerBuilder b(tok);
  b.shape_ = shape;
  D2O_ASSIGN_OR_RETURN(b.turns_, TurnTexts::create(tok, chat, shape.setting));
  D2O_ASSIGN_OR_RETURN(b.haystack_, b.encode(std::string(haystack), false));
  D2O_ASSIGN_OR_RETURN(b.filler_, b.encode(kFiller, false));
  // Lowercase words of 4-12 letters, as they first occur (capitalised words are left out: names).
  std::unordered_set<std::string> seen;
  size_t i = 0;
  while (i < haystack.size()) {
    if (!std::isalpha(static_cast<unsigned char>(haystack[i]))) {
      ++i;
      continue;
    }
    size_t j = i;
    bool all_lower = true;
    while (j < haystack.size() && std::isalpha(static_cast<unsigned char>(haystack[j]))) {
      all_lower = all_lower && std::islower(static_cast<unsigned char>(haystack[j]));
      ++j;
    }
    const bool joined =
        (i > 0 && (std::isdigit(static_cast<unsigned char>(haystack[i - 1])) ||
                   haystack[i - 1] == '\'' || haystack[i - 1] == '-')) ||
        (j < haystack.size() && (haystack[j] == '\'' || haystack[j] == '-' ||
                                 std::isdigit(static_cast<unsigned char>(haystack[j]))));
    if (all_lower && !joined && j - i >= 4 && j - i <= 12) {
      std::string w(haystack.substr(i, j - i));
      if (seen.insert(w).second) b.words_.push_back(std::move(w));
    }
    i = j;
  }
  // cwe's example (40 words) and a 4K list need a few hundred; keys need 8.
  constexpr size_t kMinWords = 200;
  if (b.words_.size() < kMinWords) {
    return invalid_argument(
        "the haystack has only " + std::to_string(b.words_.size()) +
        " distinct lowercase words (4-12 letters); the keys and word lists need "
        "at least " +
        std::to_string(kMinWords) + ": use a longer text");
  }
  return b;
}

Result<std::vector<TokenId>> RulerBuilder::encode(const std::string& text, bool add_special) const {
  EncodeOptions o;
  o.add_special = add_special;
  o.parse_special = true;
  return tok_->encode(text, o);
}

// Binary search for list sizes: raises lo to the largest n in [lo, hi] whose context(n) encodes
// to at most `budget` tokens, leaving those ids in *best (lo and *best unchanged when no n > lo
// fits). context(n) grows with n.
template <class Int, class Context>
Status RulerBuilder::largest_within(Int& lo, Int hi, int64_t budget, const Context& context,
                                    std::vector<TokenId>* best) const {
  while (lo < hi) {
    const Int mid = lo + (hi - lo + 1) / 2;
    D2O_ASSIGN_OR_RETURN(std::vector<TokenId> ids, encode(context(mid), false));
    if (static_cast<int64_t>(ids.size()) <= budget) {
      lo = mid;
      *best = std::move(ids);
    } else {
      hi = mid - 1;
    }
  }
  return {};
}

int64_t RulerBuilder::sentence_start(std::span<const TokenId> ctx, int64_t at) const {
  constexpr int64_t kMaxBack = 400;
  for (int64_t i = at; i > 0 && at - i <= kMaxBack; --i) {
    auto piece = tok_->token_to_piece(ctx[static_cast<size_t>(i - 1)], false);
    if (!piece.ok() || piece->empty()) continue;
    const char last = piece->back();
    if (last == '.' || last == '!' || last == '?' || piece->find('\n') != std::string::npos)
      return i;
  }
  return at;
}

// The two parts of a tail are encoded apart: the compaction point of the after setting lies
// between them (a chat marker there, so the cut does not change the tokens). In the before
// setting the first part is empty and the tail is encoded whole.
Result<int64_t> RulerBuilder::fixed_tokens(const std::string& head, const Tail& tail) const {
  D2O_ASSIGN_OR_RETURN(std::vector<TokenId> h, encode(turns_.prefix() + head, true));
  D2O_ASSIGN_OR_RETURN(std::vector<TokenId> t1, encode(tail.first, false));
  D2O_ASSIGN_OR_RETURN(std::vector<TokenId> t2, encode(tail.second, false));
  return static_cast<int64_t>(h.size() + t1.size() + t2.size());
}

Status RulerBuilder::assemble(Trial& t, const std::string& head, std::span<const TokenId> ctx,
                              const Tail& tail) const {
  D2O_ASSIGN_OR_RETURN(std::vector<TokenId> h, encode(turns_.prefix() + head, true));
  D2O_ASSIGN_OR_RETURN(std::vector<TokenId> t1, encode(tail.first, false));
  D2O_ASSIGN_OR_RETURN(std::vector<TokenId> t2, encode(tail.second, false));
  t.prompt = std::move(h);
  t.prompt.insert(t.prompt.end(), ctx.begin(), ctx.end());
  t.prompt.insert(t.prompt.end(), t1.begin(), t1.end());
  t.context_end = turns_.setting() == QuestionSetting::kAfter
                      ? static_cast<int64_t>(t.prompt.size())
                      : static_cast<int64_t>(t.prompt.size() + t2.size());
  t.prompt.insert(t.prompt.end(), t2.begin(), t2.end());
  if (static_cast<int>(t.prompt.size()) > t.length - t.max_new)
    return internal_error("ruler prompt longer than its budget");
  return {};
}

Result<RulerBuilder::Trial::FollowUp> RulerBuilder::follow_up(const Tail& tail) const {
  Trial::FollowUp f;
  D2O_ASSIGN_OR_RETURN(f.tokens, encode(tail.second, false));
  return f;
}

Result<RulerBuilder::Trial> RulerBuilder::build(RulerTask task, int length, uint64_t seed) const {
  Trial t;
  t.task = task;
  t.length = length;
  t.max_new = ruler_max_new(task);
  SplitMix64 rng(seed);
  if (is_niah(task)) return build_niah(std::move(t), rng);
  if (task == RulerTask::kVt) return build_vt(std::move(t), rng);
  if (task == RulerTask::kCwe) return build_cwe(std::move(t), rng);
  return build_fwe(std::move(t), rng);
}

namespace {

Status too_short(const RulerBuilder::Trial& t, int64_t fixed) {
  return invalid_argument(
      "length " + std::to_string(t.length) + " is too short for the " + ruler_task_name(t.task) +
      " task (instruction, question and " + std::to_string(t.max_new) + " answer tokens take " +
      std::to_string(fixed + t.max_new) + " tokens, and the context needs more)");
}

}  // namespace

Result<RulerBuilder::Trial> RulerBuilder::build_niah(Trial t, SplitMix64& rng) const {
  // K questions (QuestionShape): K times the keys one question asks (niah_multiquery asks four at
  // once), plus niah_multikey's three distractors. K = 1 gives RULER's counts.
  const size_t n_questions = static_cast<size_t>(shape_.questions);
  const size_t nq_each = t.task == RulerTask::kNiahMultiquery ? 4 : 1;
  const size_t nq = nq_each * n_questions;
  const size_t nk = nq + (t.task == RulerTask::kNiahMultikey ? 3 : 0);
  const size_t nv = t.task == RulerTask::kNiahMultivalue ? 4 : 1;
  // Keys: two haystack words joined by a hyphen; values: distinct 7-digit numbers.
  const std::vector<size_t> wi = sample_indices(words_.size(), 2 * nk, rng);
  std::vector<std::string> keys;
  for (size_t k = 0; k < nk; ++k) keys.push_back(words_[wi[2 * k]] + "-" + words_[wi[2 * k + 1]]);
  std::vector<std::vector<std::string>> values(nk);
  std::unordered_set<uint64_t> used;
  struct Needle {
    std::string text;
    size_t k, v;
  };
  std::vector<Needle> needles;
  for (size_t k = 0; k < nk; ++k) {
    for (size_t v = 0; v < nv; ++v) {
      uint64_t x;
      do x = 1000000 + rng.below(9000000);
      while (!used.insert(x).second);
      values[k].push_back(std::to_string(x));
      needles.push_back(
          {" One of the special magic numbers for " + keys[k] + " is: " + values[k].back() + ".", k,
           v});
    }
  }
  shuffle(needles, rng);
  const std::vector<size_t> asked = sample_indices(nk, nq, rng);
  // Question i asks keys asked[i * nq_each, (i + 1) * nq_each).
  struct Asked {
    std::string query;
    std::vector<std::string> expected;
    Tail tail;
  };
  std::vector<Asked> questions(n_questions);
  // RULER's template, in the singular when one value is asked for.
  const bool one = nq_each * nv == 1;
  const std::string thing = one ? "number" : "numbers";
  for (size_t i = 0; i < n_questions; ++i) {
    std::vector<std::string> queries;
    for (size_t j = i * nq_each; j < (i + 1) * nq_each; ++j) {
      queries.push_back(keys[asked[j]]);
      for (const std::string& v : values[asked[j]]) questions[i].expected.push_back(v);
    }
    const std::string query =
        queries.size() == 1
            ? queries[0]
            : join({queries.begin(), queries.end() - 1}, ", ") + ", and " + queries.back();
    questions[i].query = query;
    questions[i].tail =
        turns_.tail("\n",
                    std::string(one ? "What is" : "What are all") + " the special magic " + thing +
                        " for " + query + " mentioned in the provided text?",
                    "The special magic " + thing + " for " + query +
                        " mentioned in the provided text " + (one ? "is" : "are"));
  }
  t.query = questions[0].query;
  t.expected = questions[0].expected;
  const bool head_one = one && n_questions == 1;
  const std::string head =
      std::string(head_one ? "A special magic number is" : "Some special magic numbers are") +
      " hidden within the following text. Make sure to memorize it. I will "
      "quiz you about the " +
      (head_one ? "number" : "numbers") + " afterwards.\n";
  std::vector<std::vector<TokenId>> ntok;
  int64_t n_needle = 0;
  for (const Needle& n : needles) {
    D2O_ASSIGN_OR_RETURN(std::vector<TokenId> ids, encode(n.text, false));
    n_needle += static_cast<int64_t>(ids.size());
    ntok.push_back(std::move(ids));
    t.inserted.push_back(n.text.substr(1));
  }
  // The context is sized for the longest question, so that every question's prompt fits.
  int64_t fixed = 0;
  for (const Asked& q : questions) {
    D2O_ASSIGN_OR_RETURN(const int64_t f, fixed_tokens(head, q.tail));
    fixed = std::max(fixed, f);
  }
  const int64_t n_ctx = t.length - t.max_new - fixed - n_needle;
  if (n_ctx < 16) return too_short(t, fixed + n_needle);
  const int64_t n_hay = static_cast<int64_t>(haystack_.size());
  if (n_hay < n_ctx) {
    return invalid_argument("the haystack has " + std::to_string(n_hay) +
                            " tokens, fewer than the " + std::to_string(n_ctx) + " a " +
                            std::to_string(t.length) +
                            "-token niah prompt needs; use a longer haystack or shorter --lengths");
  }
  int64_t off = static_cast<int64_t>(rng.below(static_cast<uint64_t>(n_hay - n_ctx + 1)));
  const int64_t s = sentence_start(haystack_, off);
  if (s <= off && s + n_ctx <= n_hay) off = s;
  t.haystack_offset = off;
  const std::span<const TokenId> ctx(haystack_.data() + off, static_cast<size_t>(n_ctx));
  // Depths drawn (without replacement) from RULER's 40 evenly spaced ones, in increasing order.
  std::vector<size_t> di = sample_indices(40, needles.size(), rng);
  std::sort(di.begin(), di.end());
  std::vector<int64_t> at;
  for (size_t d : di) {
    const double depth = std::round(100.0 * static_cast<double>(d) / 39.0) / 100.0;
    const int64_t asked_at = std::llround(depth * static_cast<double>(n_ctx));
    at.push_back(depth >= 1.0 ? n_ctx : sentence_start(ctx, asked_at));
  }
  std::sort(at.begin(), at.end());
  std::vector<TokenId> full;
  full.reserve(static_cast<size_t>(n_ctx + n_needle));
  std::vector<double> needle_depth(needles.size());
  int64_t prev = 0;
  for (size_t n = 0; n < needles.size(); ++n) {
    full.insert(full.end(), ctx.begin() + prev, ctx.begin() + at[n]);
    needle_depth[n] = static_cast<double>(full.size()) / static_cast<double>(n_ctx + n_needle);
    full.insert(full.end(), ntok[n].begin(), ntok[n].end());
    prev = at[n];
  }
  full.insert(full.end(), ctx.begin() + prev, ctx.end());
  // The depths of the needles each question asks for, in the order of its expected values.
  auto depths_of = [&](size_t i) {
    std::vector<double> d;
    for (size_t j = i * nq_each; j < (i + 1) * nq_each; ++j) {
      for (size_t v = 0; v < nv; ++v) {
        for (size_t n = 0; n < needles.size(); ++n) {
          if (needles[n].k == asked[j] && needles[n].v == v) d.push_back(needle_depth[n]);
        }
      }
    }
    return d;
  };
  t.depths = depths_of(0);
  D2O_RETURN_IF_ERROR(assemble(t, head, full, questions[0].tail));
  if (n_questions == 1 && static_cast<int>(t.prompt.size()) != t.length - t.max_new)
    return internal_error("niah prompt length mismatch");
  for (size_t i = 1; i < n_questions; ++i) {
    D2O_ASSIGN_OR_RETURN(Trial::FollowUp f, follow_up(questions[i].tail));
    f.query = questions[i].query;
    f.expected = questions[i].expected;
    f.depths = depths_of(i);
    t.more.push_back(std::move(f));
  }
  return t;
}

Result<RulerBuilder::Trial> RulerBuilder::build_vt(Trial t, SplitMix64& rng) const {
  constexpr int kHops = 4;
  constexpr size_t kChainLen = kHops + 1;  // statements of a chain
  // A chain: its names (distinct, `letters` capitals) and statements, the value first.
  auto chain = [&](int letters, std::vector<std::string>& names, std::string& value) {
    std::unordered_set<std::string> seen;
    names.clear();
    while (static_cast<int>(names.size()) < kHops + 1) {
      std::string n = random_letters(rng, letters, 'A');
      if (seen.insert(n).second) names.push_back(n);
    }
    value = std::to_string(10000 + rng.below(90000));
    std::vector<std::string> st = {"VAR " + names[0] + " = " + value + "\n"};
    for (int h = 1; h <= kHops; ++h)
      st.push_back("VAR " + names[h] + " = VAR " + names[h - 1] + "\n");
    return st;
  };
  auto question = [&](const std::string& value) {
    return "Question: Find all variables that are assigned the value " + value +
           " in the text above.";
  };
  auto prefix = [&](const std::string& value) {
    return "Answer: According to the chain(s) of variable assignment in the text above, " +
           std::to_string(kHops + 1) + " variables are assigned the value " + value +
           ", they are: ";
  };
  // A solved example first (RULER's in-context example: three-letter names, little filler).
  std::vector<std::string> ex_names;
  std::string ex_value;
  const std::vector<std::string> ex_st = chain(3, ex_names, ex_value);
  std::string example = kVtInstruction;
  for (size_t i = 0; i < ex_st.size(); ++i) example += ex_st[i] + (i % 2 ? kFiller : "");
  example += question(ex_value) + " " + prefix(ex_value) + join(ex_names, " ") + "\n\n";

  // K questions (QuestionShape): K chains with distinct names and values, question i asking chain
  // i's value (RULER's num_chains). Chains after the first are drawn again on any clash.
  const size_t n_chains = static_cast<size_t>(shape_.questions);
  std::vector<std::vector<std::string>> names(n_chains);
  std::vector<std::string> values(n_chains);
  std::vector<std::string> st = chain(5, names[0], values[0]);
  std::unordered_set<std::string> taken(names[0].begin(), names[0].end());
  taken.insert(values[0]);
  for (size_t c = 1; c < n_chains; ++c) {
    std::vector<std::string> more;
    bool clash = true;
    while (clash) {
      more = chain(5, names[c], values[c]);
      clash = taken.count(values[c]) > 0;
      for (const std::string& n : names[c]) clash = clash || taken.count(n) > 0;
    }
    taken.insert(names[c].begin(), names[c].end());
    taken.insert(values[c]);
    st.insert(st.end(), more.begin(), more.end());
  }
  t.expected = names[0];
  t.query = values[0];
  t.inserted = st;
  const std::string head = example + kVtInstruction;
  std::vector<Tail> tails;
  for (size_t c = 0; c < n_chains; ++c)
    tails.push_back(turns_.tail("\n", question(values[c]), prefix(values[c])));
  std::vector<std::vector<TokenId>> stok;
  int64_t n_st = 0;
  for (const std::string& s : st) {
    D2O_ASSIGN_OR_RETURN(std::vector<TokenId> ids, encode(s, false));
    n_st += static_cast<int64_t>(ids.size());
    stok.push_back(std::move(ids));
  }
  int64_t fixed = 0;  // the longest question's
  for (const Tail& tail : tails) {
    D2O_ASSIGN_OR_RETURN(const int64_t f, fixed_tokens(head, tail));
    fixed = std::max(fixed, f);
  }
  const int64_t n_fill = t.length - t.max_new - fixed - n_st;
  const int64_t unit = static_cast<int64_t>(filler_.size());
  const int64_t n_units = unit > 0 ? n_fill / unit : 0;
  if (n_units < static_cast<int64_t>(st.size())) return too_short(t, fixed + n_st + 5 * unit);
  t.n_items = static_cast<int>(n_units);
  // Each statement goes just before a distinct filler sentence, in chain order; the filler's
  // last, partial unit ends the context.
  std::vector<size_t> pos = sample_indices(static_cast<size_t>(n_units), st.size(), rng);
  std::sort(pos.begin(), pos.end());
  // Which statement takes each position: one chain in order; several interleaved at random,
  // each in its own order.
  std::vector<size_t> order(st.size());
  for (size_t i = 0; i < st.size(); ++i) order[i] = i;
  if (n_chains > 1) {
    std::vector<size_t> chain_of(st.size());
    for (size_t i = 0; i < st.size(); ++i) chain_of[i] = i / kChainLen;
    shuffle(chain_of, rng);
    std::vector<size_t> taken_in(n_chains, 0);
    for (size_t i = 0; i < st.size(); ++i)
      order[i] = chain_of[i] * kChainLen + taken_in[chain_of[i]]++;
  }
  std::vector<std::vector<double>> depths(n_chains);
  std::vector<TokenId> ctx;
  ctx.reserve(static_cast<size_t>(n_fill + n_st));
  size_t next = 0;
  for (size_t u = 0; u < static_cast<size_t>(n_units); ++u) {
    if (next < pos.size() && pos[next] == u) {
      const size_t which = order[next];
      depths[which / kChainLen].push_back(static_cast<double>(ctx.size()) /
                                          static_cast<double>(n_fill + n_st));
      ctx.insert(ctx.end(), stok[which].begin(), stok[which].end());
      ++next;
    }
    ctx.insert(ctx.end(), filler_.begin(), filler_.end());
  }
  ctx.insert(ctx.end(), filler_.begin(), filler_.begin() + (n_fill - n_units * unit));
  t.depths = depths[0];
  D2O_RETURN_IF_ERROR(assemble(t, head, ctx, tails[0]));
  if (n_chains == 1 && static_cast<int>(t.prompt.size()) != t.length - t.max_new)
    return internal_error("vt prompt length mismatch");
  for (size_t c = 1; c < n_chains; ++c) {
    D2O_ASSIGN_OR_RETURN(Trial::FollowUp f, follow_up(tails[c]));
    f.query = values[c];
    f.expected = names[c];
    f.depths = depths[c];
    t.more.push_back(std::move(f));
  }
  return t;
}

Result<RulerBuilder::Trial> RulerBuilder::build_cwe(Trial t, SplitMix64& rng) const {
  // RULER's sizes: below 4K tokens the common words occur 6 times and the others once (example:
  // 20 words, 3 and 1); from 4K on 30 and 3 times (example: 40 words, 10 and 3).
  const bool small = t.length < 4096;
  const size_t ex_words = small ? 20 : 40;
  const int ex_cw = small ? 3 : 10, ex_ucw = small ? 1 : 3;
  const int cw = small ? 6 : 30, ucw = small ? 1 : 3;
  const std::vector<size_t> order = sample_indices(words_.size(), words_.size(), rng);
  const uint64_t shuffle_seed = rng.next();
  // The list of n distinct words (the first kCommonWords common), shuffled, numbered.
  auto list = [&](size_t first, size_t n, int rep_c, int rep_u, uint64_t seed) {
    std::vector<std::string> l;
    for (size_t i = 0; i < n; ++i) {
      const int rep = i < kCommonWords ? rep_c : rep_u;
      for (int r = 0; r < rep; ++r) l.push_back(words_[order[first + i]]);
    }
    SplitMix64 r(seed);
    shuffle(l, r);
    return l;
  };
  std::vector<std::string> ex_common;
  for (size_t i = 0; i < kCommonWords; ++i) ex_common.push_back(words_[order[i]]);
  const std::string example = kCweInstruction +
                              numbered(list(0, ex_words, ex_cw, ex_ucw, shuffle_seed)) + "\n" +
                              kCweQuestion + " " + kCweAnswer + " " + numbered(ex_common) + "\n";
  const std::string head = example + kCweInstruction;
  const Tail tail = turns_.tail("\n", kCweQuestion, kCweAnswer);
  D2O_ASSIGN_OR_RETURN(const int64_t fixed, fixed_tokens(head, tail));
  const int64_t budget = t.length - t.max_new - fixed;
  auto context = [&](size_t n) { return numbered(list(ex_words, n, cw, ucw, shuffle_seed + 1)); };
  // The most words that fit (binary search; the token count grows with the word count).
  size_t lo = kCommonWords, hi = words_.size() - ex_words;
  std::vector<TokenId> best;
  {
    D2O_ASSIGN_OR_RETURN(best, encode(context(lo), false));
    if (static_cast<int64_t>(best.size()) > budget)
      return too_short(t, fixed + static_cast<int64_t>(best.size()));
  }
  D2O_RETURN_IF_ERROR(largest_within(lo, hi, budget, context, &best));
  for (size_t i = 0; i < kCommonWords; ++i) t.expected.push_back(words_[order[ex_words + i]]);
  t.n_items = static_cast<int>(kCommonWords * cw + (lo - kCommonWords) * ucw);
  D2O_RETURN_IF_ERROR(assemble(t, head, best, tail));
  return t;
}

Result<RulerBuilder::Trial> RulerBuilder::build_fwe(Trial t, SplitMix64& rng) const {
  // RULER's: length / 50 coded words of 6 letters; rank k occurs floor(n k^-2 / zeta(2)) times;
  // the first is the noise "....", the answer the next three.
  const size_t vsize = std::max<size_t>(6, static_cast<size_t>(t.length / 50));
  std::vector<std::string> vocab = {kFweNoise};
  std::unordered_set<std::string> seen;
  while (vocab.size() < vsize) {
    std::string w = random_letters(rng, 6, 'a');
    if (seen.insert(w).second) vocab.push_back(w);
  }
  const uint64_t shuffle_seed = rng.next();
  constexpr double kZeta2 = std::numbers::pi * std::numbers::pi / 6.0;
  auto counts = [&](int64_t n) {
    std::vector<int64_t> c(vsize);
    for (size_t k = 0; k < vsize; ++k)
      c[k] = static_cast<int64_t>(static_cast<double>(n) / (double((k + 1) * (k + 1)) * kZeta2));
    return c;
  };
  auto context = [&](int64_t n) {
    const std::vector<int64_t> c = counts(n);
    std::vector<std::string> w;
    for (size_t k = 0; k < vsize; ++k) {
      for (int64_t r = 0; r < c[k]; ++r) w.push_back(vocab[k]);
    }
    SplitMix64 r(shuffle_seed);
    shuffle(w, r);
    return " " + join(w, " ");
  };
  const std::string head = kFweInstruction;
  const Tail tail = turns_.tail("\n", kFweQuestion, kFweAnswer);
  D2O_ASSIGN_OR_RETURN(const int64_t fixed, fixed_tokens(head, tail));
  const int64_t budget = t.length - t.max_new - fixed;
  int64_t lo = 0, hi = std::max<int64_t>(budget, 0);
  std::vector<TokenId> best;
  D2O_RETURN_IF_ERROR(largest_within(lo, hi, budget, context, &best));
  // The three answers must be strictly the 2nd-4th most frequent.
  const std::vector<int64_t> c = counts(lo);
  if (lo < 1 || !(c[1] > c[2] && c[2] > c[3] && c[3] > c[4] && c[3] > 0))
    return too_short(t, fixed + 64);
  t.expected = {vocab[1], vocab[2], vocab[3]};
  t.n_items = 0;
  for (int64_t x : c) t.n_items += static_cast<int>(x);
  D2O_RETURN_IF_ERROR(assemble(t, head, best, tail));
  return t;
}

}  // namespace d2o::eval
