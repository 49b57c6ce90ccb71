#include "eval/bench.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "core/mem.h"
#include "core/timer.h"
#include "kv/cold_tier.h"
#include "runtime/generator.h"

namespace d2o {

std::string BenchTest::name() const {
  std::string s = (kind == BenchKind::kPrompt ? "pp" : "tg") + std::to_string(n);
  if (depth > 0) s += " @ d" + std::to_string(depth);
  return s;
}

namespace {

std::string_view trim_blanks(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

// A whole non-negative decimal number, or false.
bool parse_whole(std::string_view s, int64_t* out) {
  s = trim_blanks(s);
  if (s.empty()) return false;
  const auto r = std::from_chars(s.data(), s.data() + s.size(), *out);
  return r.ec == std::errc() && r.ptr == s.data() + s.size() && *out >= 0;
}

}  // namespace

Result<std::vector<int>> parse_int_list(std::string_view s, std::string_view what, int min_value,
                                        int max_value) {
  const std::string w(what);
  std::vector<int> out;
  auto bad = [&](std::string_view item, const std::string& why) {
    return invalid_argument(w + ": '" + std::string(item) + "' " + why +
                            " (expected a comma-separated list such as 0,512,4096 or a range "
                            "first-last, first-last+step, first-last*mult)");
  };
  auto push = [&](int64_t v, std::string_view item) -> Status {
    if (v < min_value || v > max_value) {
      return invalid_argument(w + ": " + std::to_string(v) + " (from '" + std::string(item) +
                              "') is out of range [" + std::to_string(min_value) + ", " +
                              std::to_string(max_value) + "]");
    }
    // Ranges can be long; bound the list so a typo cannot ask for millions of tests.
    if (out.size() >= 1024) return invalid_argument(w + ": more than 1024 values");
    out.push_back(static_cast<int>(v));
    return {};
  };
  std::string_view rest = trim_blanks(s);
  if (rest.empty()) return invalid_argument(w + ": empty list");
  while (true) {
    const size_t comma = rest.find(',');
    const std::string_view item = trim_blanks(rest.substr(0, comma));
    if (item.empty()) return bad(item, "is empty");
    const size_t dash = item.find('-');
    if (dash == std::string_view::npos) {
      int64_t v = 0;
      if (!parse_whole(item, &v)) return bad(item, "is not a non-negative integer");
      D2O_RETURN_IF_ERROR(push(v, item));
    } else {
      // first-last[+step | *mult]
      const std::string_view tail = item.substr(dash + 1);
      const size_t op = tail.find_first_of("+*");
      int64_t first = 0, last = 0, step = 1;
      if (!parse_whole(item.substr(0, dash), &first) || !parse_whole(tail.substr(0, op), &last)) {
        return bad(item, "is not a valid range");
      }
      const bool mult = op != std::string_view::npos && tail[op] == '*';
      if (op != std::string_view::npos && !parse_whole(tail.substr(op + 1), &step)) {
        return bad(item, "has a bad step");
      }
      if (last < first) return bad(item, "is a range whose end is below its start");
      if (mult ? step < 2 || first < 1 : step < 1) {
        return bad(item, mult ? "needs a start >= 1 and a multiplier >= 2" : "needs a step >= 1");
      }
      for (int64_t v = first;;) {
        D2O_RETURN_IF_ERROR(push(v, item));
        // Stop before the next value would pass `last` (or overflow with a huge step).
        if (mult ? v > last / step : v > last - step) break;
        v = mult ? v * step : v + step;
      }
    }
    if (comma == std::string_view::npos) break;
    rest = rest.substr(comma + 1);
  }
  return out;
}

std::vector<BenchTest> make_bench_tests(std::span<const int> n_prompt, std::span<const int> n_gen,
                                        std::span<const int> depths) {
  std::vector<BenchTest> tests;
  for (const int d : depths) {
    for (const int n : n_prompt) {
      if (n > 0) tests.push_back({BenchKind::kPrompt, n, d});
    }
    for (const int n : n_gen) {
      if (n > 0) tests.push_back({BenchKind::kGen, n, d});
    }
  }
  return tests;
}

Status validate_bench_tests(std::span<const BenchTest> tests, int64_t n_text_tokens,
                            const BenchConfig& cfg) {
  if (cfg.repetitions < 1) {
    return invalid_argument("the number of repetitions must be at least 1 (got " +
                            std::to_string(cfg.repetitions) + ")");
  }
  if (tests.empty()) return invalid_argument("no tests to run (every -p and -n size is 0)");
  for (const BenchTest& t : tests) {
    if (t.n < 1 || t.depth < 0)
      return invalid_argument("test " + t.name() + ": sizes must be positive");
    const int64_t need = int64_t{t.depth} + t.n;
    if (cfg.n_ctx > 0 && need > cfg.n_ctx) {
      return invalid_argument(
          "test " + t.name() + " needs " + std::to_string(need) + " tokens of context (depth " +
          std::to_string(t.depth) + " + " + std::to_string(t.n) + ") but the context is " +
          std::to_string(cfg.n_ctx) + " tokens; use a larger -c or smaller -d / -p / -n");
    }
    if (need > n_text_tokens) {
      return invalid_argument("test " + t.name() + " needs " + std::to_string(need) +
                              " tokens of text but the text has only " +
                              std::to_string(n_text_tokens) + "; give a longer file with -f");
    }
  }
  return {};
}

namespace {

// Runs the timed part of one repetition on `seq` (already holding the depth prefill).
Status run_timed(Engine& engine, Sequence& seq, std::span<const TokenId> text, const BenchTest& t,
                 double* seconds) {
  BatchEntry be;
  be.seq = &seq;
  const LogitsSink sink;  // logits are computed (as llama-bench does) but not kept
  const size_t d = static_cast<size_t>(t.depth);
  Stopwatch sw;
  if (t.kind == BenchKind::kPrompt) {
    be.tokens = text.subspan(d, static_cast<size_t>(t.n));
    D2O_RETURN_IF_ERROR(engine.forward({&be, 1}, sink));
  } else {
    for (int i = 0; i < t.n; ++i) {
      be.tokens = text.subspan(d + static_cast<size_t>(i), 1);
      D2O_RETURN_IF_ERROR(engine.forward({&be, 1}, sink));
    }
  }
  *seconds = sw.seconds();
  return {};
}

void add_timings(EngineTimings& a, const EngineTimings& b) {
  a.matmul_s += b.matmul_s;
  a.attention_s += b.attention_s;
  a.policy_s += b.policy_s;
  a.other_s += b.other_s;
  a.rows += b.rows;
}

}  // namespace

Result<double> measure_read_bandwidth(ThreadPool& pool, size_t bytes, int reps) {
  constexpr size_t kChunk = size_t{1} << 20;  // bytes per task
  const size_t n_chunks = std::max<size_t>(1, bytes / kChunk);
  const size_t words = n_chunks * kChunk / sizeof(uint64_t);
  const size_t per_chunk = kChunk / sizeof(uint64_t);
  AlignedBuffer<uint64_t> buf;
  try {
    buf.resize(words);
  } catch (const std::bad_alloc&) {
    return resource_exhausted("cannot allocate " + format_bytes(static_cast<double>(bytes)) +
                              " for the bandwidth probe");
  }
  std::vector<uint64_t> sums(n_chunks);
  // First touch from the pool, so pages are spread as the sweeps will read them.
  pool.parallel_for(static_cast<int64_t>(n_chunks), 1, [&](int64_t b, int64_t e, int) {
    for (size_t i = static_cast<size_t>(b) * per_chunk; i < static_cast<size_t>(e) * per_chunk; ++i)
      buf[i] = i;
  });
  double best = 0;
  for (int r = 0; r < std::max(1, reps); ++r) {
    Stopwatch sw;
    pool.parallel_for(static_cast<int64_t>(n_chunks), 1, [&](int64_t b, int64_t, int) {
      // Four independent sums keep several loads in flight.
      const uint64_t* p = buf.data() + static_cast<size_t>(b) * per_chunk;
      uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
      for (size_t i = 0; i < per_chunk; i += 4) {
        s0 += p[i];
        s1 += p[i + 1];
        s2 += p[i + 2];
        s3 += p[i + 3];
      }
      sums[static_cast<size_t>(b)] = s0 + s1 + s2 + s3;
    });
    const double secs = sw.seconds();
    best = std::max(best, static_cast<double>(n_chunks * kChunk) / std::max(secs, 1e-9));
  }
  uint64_t total = 0;
  for (const uint64_t s : sums) total += s;
  if (total == 1) return internal_error("bandwidth probe: impossible checksum");  // keeps the reads
  return best;
}

namespace {

// The most tokens a test at `depth` times (tests of one depth are adjacent, but any order works).
int max_n_at(std::span<const BenchTest> tests, int depth) {
  int n = 0;
  for (const BenchTest& t : tests)
    if (t.depth == depth) n = std::max(n, t.n);
  return n;
}

// Prefills `saved` with the first `depth` tokens of `text` (one forward pass, compressed by the
// policy); the seconds it took and the slots left go to the result fields of every test at it.
// The cache's growth is capped at depth + max_n slots (the most any test at this depth needs), so
// that a full cache does not carry the geometric over-allocation of the prefill into the timed
// repetitions (nor report it as KV bytes), and still needs no reallocation while they run.
Status prefill_depth(Engine& engine, Sequence& saved, std::span<const TokenId> text, int depth,
                     int max_n, int chunk, double* seconds, int64_t* slots) {
  saved.reset();
  // (A policy that reconstructs the prompt holds one reconstruction pass more for a moment.)
  D2O_RETURN_IF_ERROR(saved.cache().set_slot_limit(
      depth + max_n + saved.policy().reconstruction_chunk(saved.policy_state())));
  *seconds = 0;
  if (depth > 0) {
    Stopwatch sw;
    const LogitsSink no_sink;
    const int window = saved.policy().is_full() ? 0 : saved.policy().needs().window;
    size_t at = 0;
    for (const int n : prefill_chunks(depth, chunk, window)) {
      BatchEntry be;
      be.seq = &saved;
      be.tokens = text.subspan(at, static_cast<size_t>(n));
      at += static_cast<size_t>(n);
      be.prompt_rest = depth - static_cast<int64_t>(at);
      be.logits_from = be.prompt_rest > 0 ? BatchEntry::kNoLogits : -1;
      D2O_RETURN_IF_ERROR(engine.forward({&be, 1}, no_sink));
    }
    *seconds = sw.seconds();
  }
  *slots = saved.cache().total_slots();
  return {};
}

// One repetition of `t` on `seq`: the depth state restored from `saved`, then the timed part;
// its seconds and engine split are added to `r`.
Status run_repetition(Engine& engine, Sequence& seq, const Sequence& saved,
                      std::span<const TokenId> text, const BenchTest& t, BenchResult& r) {
  if (t.depth > 0) {
    D2O_RETURN_IF_ERROR(seq.copy_from(saved));
  } else {
    seq.reset();
  }
  // The cache never needs more than depth + n slots: growth stops there (a full cache would
  // otherwise over-allocate by up to a quarter and report it as KV bytes).
  int limit = static_cast<int>(int64_t{t.depth} + t.n) +
              seq.policy().reconstruction_chunk(seq.policy_state());
  for (int il = 0; il < seq.cache().n_layer(); ++il)
    limit = std::max(limit, seq.cache().layer(il).capacity());
  D2O_RETURN_IF_ERROR(seq.cache().set_slot_limit(limit));
  engine.reset_timings();
  double secs = 0;
  D2O_RETURN_IF_ERROR(run_timed(engine, seq, text, t, &secs));
  add_timings(r.timings, engine.timings());
  r.seconds.push_back(secs);
  return {};
}

// Rates from the repetitions' seconds, and the cache after the last one.
void finish_result(BenchResult& r, const Sequence& seq) {
  const BenchTest& t = r.test;
  double sum = 0, sq = 0;
  for (const double s : r.seconds) sum += t.n / std::max(s, 1e-12);
  r.tps_mean = sum / static_cast<double>(r.seconds.size());
  for (const double s : r.seconds) {
    const double x = t.n / std::max(s, 1e-12) - r.tps_mean;
    sq += x * x;
  }
  r.tps_stddev =
      r.seconds.size() > 1 ? std::sqrt(sq / static_cast<double>(r.seconds.size() - 1)) : 0.0;
  const KvCache& c = seq.cache();
  r.slots = c.total_slots();
  // A cold tier's rows are KV bytes held in memory too (cold=memory).
  const size_t cold = c.cold() ? c.cold()->rows_bytes() : 0;
  r.kv_bytes = c.kv_bytes_allocated() + cold;
  r.kv_bytes_used = c.kv_bytes_used() + cold;
  r.kv_bytes_full = c.full_kv_bytes(seq.n_past());
}

}  // namespace

Status run_bench(Engine& engine, std::span<const TokenId> text, std::span<const BenchTest> tests,
                 const std::shared_ptr<const KvPolicy>& policy, const BenchConfig& cfg,
                 const std::function<void(const BenchResult&)>& on_result) {
  D2O_RETURN_IF_ERROR(validate_bench_tests(tests, static_cast<int64_t>(text.size()), cfg));
  if (!policy) return invalid_argument("run_bench: no KV policy");
  const ModelHParams& hp = engine.model().hparams();
  Sequence seq(hp, cfg.kv_type, policy);
  Sequence saved(hp, cfg.kv_type, policy);
  int saved_depth = -1;
  double depth_seconds = 0;
  int64_t slots_after_depth = 0;

  for (const BenchTest& t : tests) {
    BenchResult r;
    r.test = t;
    r.kv_spec = policy->spec();
    // The depth state: prefilled once per depth (one forward pass, compressed by the policy),
    // then restored before every repetition.
    if (saved_depth != t.depth) {
      D2O_RETURN_IF_ERROR(prefill_depth(engine, saved, text, t.depth, max_n_at(tests, t.depth),
                                        cfg.depth_chunk, &depth_seconds, &slots_after_depth));
      saved_depth = t.depth;
    }
    r.depth_seconds = depth_seconds;
    r.slots_after_depth = slots_after_depth;
    // The saved state is the bench's own overhead: left out of the reported peak.
    const size_t saved_bytes =
        saved.cache().bytes_held();
    seq.reset();  // hand back the previous test's cache before the peak is reset
#if defined(__GLIBC__)
    malloc_trim(0);  // freed caches would otherwise stay resident and count in the next peak
#endif
    const bool rss_ok = reset_peak_rss();
    const size_t rss_before = current_rss_bytes();
    for (int rep = 0; rep < cfg.repetitions; ++rep)
      D2O_RETURN_IF_ERROR(run_repetition(engine, seq, saved, text, t, r));
    if (rss_ok) {
      const size_t peak = std::max(peak_rss_bytes(), rss_before);
      r.peak_rss = peak > saved_bytes ? peak - saved_bytes : peak;
    }
    finish_result(r, seq);
    if (on_result) on_result(r);
  }
  return {};
}

Status run_bench_interleaved(Engine& engine, std::span<const TokenId> text,
                             std::span<const BenchTest> tests,
                             std::span<const std::shared_ptr<const KvPolicy>> policies,
                             const BenchConfig& cfg,
                             const std::function<void(size_t, const BenchResult&)>& on_result) {
  D2O_RETURN_IF_ERROR(validate_bench_tests(tests, static_cast<int64_t>(text.size()), cfg));
  if (policies.empty()) return invalid_argument("run_bench_interleaved: no KV policy");
  for (const auto& p : policies)
    if (!p) return invalid_argument("run_bench_interleaved: a null KV policy");
  const ModelHParams& hp = engine.model().hparams();
  const size_t n_pol = policies.size();
  std::vector<std::unique_ptr<Sequence>> seq, saved;
  for (const auto& p : policies) {
    seq.push_back(std::make_unique<Sequence>(hp, cfg.kv_type, p));
    saved.push_back(std::make_unique<Sequence>(hp, cfg.kv_type, p));
  }
  int saved_depth = -1;
  std::vector<double> depth_seconds(n_pol, 0.0);
  std::vector<int64_t> slots_after_depth(n_pol, 0);

  for (const BenchTest& t : tests) {
    if (saved_depth != t.depth) {
      for (size_t ip = 0; ip < n_pol; ++ip) {
        D2O_RETURN_IF_ERROR(prefill_depth(engine, *saved[ip], text, t.depth,
                                          max_n_at(tests, t.depth), cfg.depth_chunk,
                                          &depth_seconds[ip], &slots_after_depth[ip]));
      }
      saved_depth = t.depth;
    }
    std::vector<BenchResult> r(n_pol);
    for (size_t ip = 0; ip < n_pol; ++ip) {
      r[ip].test = t;
      r[ip].kv_spec = policies[ip]->spec();
      r[ip].depth_seconds = depth_seconds[ip];
      r[ip].slots_after_depth = slots_after_depth[ip];
      seq[ip]->reset();
    }
    // Rounds of one repetition per policy, in order on even rounds and in reverse on odd ones,
    // so that no policy always runs right after the same other one.
    for (int rep = 0; rep < cfg.repetitions; ++rep) {
      for (size_t k = 0; k < n_pol; ++k) {
        const size_t ip = rep % 2 == 0 ? k : n_pol - 1 - k;
        D2O_RETURN_IF_ERROR(run_repetition(engine, *seq[ip], *saved[ip], text, t, r[ip]));
      }
    }
    for (size_t ip = 0; ip < n_pol; ++ip) {
      finish_result(r[ip], *seq[ip]);  // peak_rss stays 0: the policies share the process
      if (on_result) on_result(ip, r[ip]);
    }
  }
  return {};
}

std::vector<double> paired_ratios(const BenchResult& a, const BenchResult& base) {
  std::vector<double> out;
  const size_t n = std::min(a.seconds.size(), base.seconds.size());
  for (size_t i = 0; i < n; ++i)
    out.push_back(std::max(base.seconds[i], 1e-12) / std::max(a.seconds[i], 1e-12));
  return out;
}

}  // namespace d2o
