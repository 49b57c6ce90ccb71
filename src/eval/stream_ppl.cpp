#include "eval/stream_ppl.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "core/timer.h"
#include "eval/harness.h"
#include "eval/perplexity.h"
#include "eval/stats.h"
#include "eval/svg.h"
#include "kv/policy/composed.h"

namespace d2o::eval {

namespace {

// A policy that renumbers kept positions (streaming:positions=shifted), which then stay inside
// the trained context.
bool shifts_positions(const KvPolicy& p) {
  const auto* c = dynamic_cast<const ComposedPolicy*>(&p);
  return c && c->config().pos == PosMode::kShift;
}

}  // namespace

Result<StreamPplResult> run_stream_ppl(Engine& engine, std::span<const TokenId> tokens,
                                       const StreamPplParams& p, Progress* progress) {
  if (p.policies.empty()) return invalid_argument("no policies given");
  if (p.chunk < 1)
    return invalid_argument("--chunk must be at least 1 (got " + std::to_string(p.chunk) + ")");
  if (p.n_tokens < 2)
    return invalid_argument("need at least 2 tokens to score (got " + std::to_string(p.n_tokens) +
                            ")");
  if (p.n_tokens > static_cast<int64_t>(tokens.size())) {
    return invalid_argument("the text has " + std::to_string(tokens.size()) +
                            " tokens, fewer than the " + std::to_string(p.n_tokens) +
                            " asked for; use a longer text or fewer --tokens");
  }
  const ModelHParams& hp = engine.model().hparams();
  StreamPplResult res;
  res.n_tokens = p.n_tokens;
  res.chunk = p.chunk;
  std::vector<PolicyUnderTest> pols;
  std::vector<int> caps;
  bool has_full = false;
  for (const std::string& base : p.policies) {
    if (spec_preset(base) == "full") {
      if (base != "full") return invalid_argument("'full' takes no keys (got '" + base + "')");
      if (has_full) continue;
      has_full = true;
      D2O_ASSIGN_OR_RETURN(PolicyUnderTest t, make_policy("full", "full"));
      pols.insert(pols.begin(), t);
      caps.insert(caps.begin(), 0);
      continue;
    }
    if (p.capacities.empty())
      return invalid_argument("no capacities given (e.g. --capacities 256,1024)");
    for (int cap : p.capacities) {
      if (cap < 1)
        return invalid_argument("capacities must be positive (got " + std::to_string(cap) + ")");
      D2O_ASSIGN_OR_RETURN(std::string spec,
                           spec_with_compression(base, "budget=" + std::to_string(cap)));
      D2O_ASSIGN_OR_RETURN(PolicyUnderTest t, make_policy(spec, base));
      pols.push_back(t);
      caps.push_back(cap);
    }
  }
  if (p.n_ctx_train > 0 && p.n_tokens > p.n_ctx_train) {
    if (has_full) {
      return invalid_argument(
          "the full cache would reach position " + std::to_string(p.n_tokens - 1) +
          ", beyond the model's trained "
          "context of " +
          std::to_string(p.n_ctx_train) +
          " positions (its scores there would measure RoPE "
          "extrapolation, not the cache): cut the text with --tokens " +
          std::to_string(p.n_ctx_train) +
          " or fewer, or leave full out of the policies (note that only "
          "streaming:positions=shifted keeps positions "
          "inside the trained context; every other policy keeps original positions)");
    }
    for (const PolicyUnderTest& t : pols) {
      if (!shifts_positions(*t.policy)) {
        res.warnings.push_back(t.spec + ": positions beyond the trained context of " +
                               std::to_string(p.n_ctx_train) + " (original positions are kept)");
      }
    }
  }
  for (size_t i = 0; i < pols.size(); ++i) {
    if (caps[i] > 0 && caps[i] >= p.n_tokens) {
      res.warnings.push_back(pols[i].spec +
                             ": the capacity is at least the text length, so nothing is evicted");
    }
  }

  const size_t n_runs = pols.size();
  std::vector<std::unique_ptr<Sequence>> seqs;
  res.runs.resize(n_runs);
  for (size_t i = 0; i < n_runs; ++i) {
    seqs.push_back(std::make_unique<Sequence>(hp, p.kv_type, pols[i].policy));
    res.runs[i].label = pols[i].label;
    res.runs[i].spec = pols[i].spec;
    res.runs[i].capacity = caps[i];
    res.runs[i].nll.assign(static_cast<size_t>(p.n_tokens - 1), std::nanf(""));
  }
  engine.reset_timings();
  Stopwatch sw;
  std::vector<BatchEntry> batch(n_runs);
  for (int64_t i = 0; i < p.n_tokens; i += p.chunk) {
    const int64_t len = std::min<int64_t>(p.chunk, p.n_tokens - i);
    const std::span<const TokenId> chunk(tokens.data() + i, static_cast<size_t>(len));
    for (size_t r = 0; r < n_runs; ++r) batch[r] = BatchEntry{seqs[r].get(), chunk, 0};
    Status s = engine.forward(batch, [&](int e, int j, const float* logits) {
      const int64_t pos = i + j;
      if (pos + 1 >= p.n_tokens) return;
      res.runs[static_cast<size_t>(e)].nll[static_cast<size_t>(pos)] =
          static_cast<float>(-log_prob(logits, hp.n_vocab, tokens[static_cast<size_t>(pos + 1)]));
    });
    D2O_RETURN_IF_ERROR(s);
    if (progress) progress->update(static_cast<double>(i + len));
  }
  res.seconds = sw.seconds();
  res.timings = engine.timings();
  for (size_t r = 0; r < n_runs; ++r) {
    const KvCache& c = seqs[r]->cache();
    res.runs[r].slots_end = static_cast<double>(c.total_slots()) / c.n_layer();
    for (int64_t v : seqs[r]->policy_state().evicted) res.runs[r].evicted += v;
    for (int64_t v : seqs[r]->policy_state().merged) res.runs[r].merged += v;
  }
  return res;
}

StreamPplSummary summarize_run(const StreamPplRun& run, const StreamPplRun* full, int block) {
  StreamPplSummary s;
  const std::vector<double> all(run.nll.begin(), run.nll.end());
  const MeanSe m = batch_means_se(all, block);
  s.mean_nll = m.mean;
  s.se_nll = m.se;
  s.ppl = std::exp(m.mean);
  const size_t from = std::min(all.size(), static_cast<size_t>(std::max(run.capacity, 0)));
  const std::vector<double> tail(all.begin() + static_cast<ptrdiff_t>(from), all.end());
  s.n_tail = static_cast<int64_t>(tail.size());
  const MeanSe t = batch_means_se(tail, block);
  s.tail_nll = t.mean;
  s.tail_se = t.se;
  s.delta_nll = s.delta_se = std::nan("");
  s.max_abs_diff_before_capacity = std::nan("");
  if (full && full->nll.size() == run.nll.size()) {
    std::vector<double> d(tail.size());
    for (size_t i = 0; i < tail.size(); ++i)
      d[i] = tail[i] - static_cast<double>(full->nll[from + i]);
    const MeanSe dm = batch_means_se(d, block);
    s.delta_nll = dm.mean;
    s.delta_se = dm.se;
    double mx = 0;
    for (size_t i = 0; i < from; ++i)
      mx = std::max(mx, std::fabs(all[i] - static_cast<double>(full->nll[i])));
    s.max_abs_diff_before_capacity = mx;
  }
  return s;
}

namespace {

// Running mean of x (and, when `band`, its batch-means standard error) at about `points`
// positions, x axis = number of tokens scored so far.
LineSeries running_mean(const std::vector<double>& x, int points, bool band,
                        const std::string& name) {
  LineSeries s;
  s.name = name;
  const size_t n = x.size();
  if (n == 0) return s;
  const size_t step = std::max<size_t>(1, n / static_cast<size_t>(std::max(points, 1)));
  double acc = 0;
  size_t next = step;
  for (size_t i = 0; i < n; ++i) {
    acc += x[i];
    if (i + 1 == next || i + 1 == n) {
      s.x.push_back(static_cast<double>(i + 1));
      s.y.push_back(acc / static_cast<double>(i + 1));
      if (band) {
        const MeanSe m = batch_means_se(std::span<const double>(x.data(), i + 1), kNllBlock);
        const double se = m.se > 0 ? m.se : std::nan("");
        s.lo.push_back(m.mean - se);
        s.hi.push_back(m.mean + se);
      }
      next += step;
    }
  }
  return s;
}

std::string svg_name(const ReportFiles& f, int cap, const char* suffix) {
  return f.name + "_c" + std::to_string(cap) + suffix + ".svg";
}

}  // namespace

Status write_stream_ppl_report(const StreamPplResult& r, const StreamPplParams& p,
                               const RunMeta& meta, const ReportFiles& files) {
  D2O_RETURN_IF_ERROR(ensure_dir(files.dir));
  const StreamPplRun* full = nullptr;
  for (const StreamPplRun& run : r.runs) {
    if (run.capacity == 0) full = &run;
  }
  nlohmann::json j;
  j["protocol"] = "ppl";
  j["description"] =
      "Streaming with a fixed capacity (budget=B slots per KV head and layer), the text fed from "
      "an empty cache in "
      "chunks of `chunk` tokens; nll[i] = -log p(token i+1 | tokens 0..i) in nats. Standard "
      "errors: batch means "
      "over consecutive blocks of 128 positions. tail = positions >= capacity (where eviction "
      "acts); delta = "
      "policy minus full cache, paired by position.";
  j["meta"] = to_json(meta);
  j["params"] = {{"policies", p.policies},
                 {"capacities", p.capacities},
                 {"n_tokens", r.n_tokens},
                 {"chunk", r.chunk},
                 {"se_block", kNllBlock}};
  j["warnings"] = r.warnings;
  j["seconds"] = r.seconds;
  j["engine_seconds"] = timings_json(r.timings);
  std::vector<int> caps;
  for (const StreamPplRun& run : r.runs) {
    if (run.capacity > 0 && std::find(caps.begin(), caps.end(), run.capacity) == caps.end()) {
      caps.push_back(run.capacity);
    }
  }
  nlohmann::json runs = nlohmann::json::array();
  for (const StreamPplRun& run : r.runs) {
    const StreamPplSummary s = summarize_run(run, full, kNllBlock);
    bool identical = full != nullptr && full->nll.size() == run.nll.size();
    for (size_t i = 0; identical && i < run.nll.size(); ++i) identical = run.nll[i] == full->nll[i];
    nlohmann::json jr = {
        {"label", run.label},
        {"spec", run.spec},
        {"capacity", run.capacity},
        {"mean_nll", s.mean_nll},
        {"se_nll", s.se_nll},
        {"ppl", s.ppl},
        {"tail_from", std::min<int64_t>(run.capacity, static_cast<int64_t>(run.nll.size()))},
        {"tail_nll", s.tail_nll},
        {"tail_se", s.tail_se},
        {"n_tail", s.n_tail},
        {"slots_end", run.slots_end},
        {"evicted", run.evicted},
        {"merged", run.merged},
        {"identical_to_full", identical}};
    if (full) {
      jr["delta_nll"] = s.delta_nll;
      jr["delta_se"] = s.delta_se;
      jr["max_abs_diff_before_capacity"] = s.max_abs_diff_before_capacity;
    }
    // The running mean curve (about 200 points), enough to redraw the charts.
    const std::vector<double> x(run.nll.begin(), run.nll.end());
    const LineSeries rm = running_mean(x, 200, false, run.label);
    jr["running_mean"] = {{"position", rm.x}, {"mean_nll", rm.y}};
    runs.push_back(jr);
  }
  j["runs"] = runs;
  // D2O against every other policy at the same capacity, paired by position over the tail
  // (positions >= capacity): mean of nll_d2o - nll_other and its batch-means standard error.
  nlohmann::json cmp = nlohmann::json::array();
  for (const StreamPplRun& a : r.runs) {
    if (spec_preset(a.spec) != "d2o" || a.capacity == 0) continue;
    for (const StreamPplRun& b : r.runs) {
      if (&a == &b || b.capacity != a.capacity) continue;
      const size_t from = std::min(a.nll.size(), static_cast<size_t>(a.capacity));
      std::vector<double> d;
      for (size_t i = from; i < a.nll.size(); ++i)
        d.push_back(static_cast<double>(a.nll[i]) - b.nll[i]);
      const MeanSe m = batch_means_se(d, kNllBlock);
      cmp.push_back({{"capacity", a.capacity},
                     {"a", a.label},
                     {"a_spec", a.spec},
                     {"b", b.label},
                     {"b_spec", b.spec},
                     {"delta_nll", m.mean},
                     {"se", m.se},
                     {"n", m.n}});
    }
  }
  j["comparisons"] = cmp;

  // Markdown.
  std::string md = "# Perplexity with a fixed-capacity cache (`d2o eval ppl`)\n\n";
  md += "Model `" + meta.model_name + "`, text `" + meta.text_name + "` (" +
        std::to_string(r.n_tokens) + " tokens fed from an empty cache, " + std::to_string(r.chunk) +
        " token" + (r.chunk == 1 ? "" : "s") + " per pass), KV storage " + meta.kv_type +
        ". Mean NLL in nats per token ± standard error (batch means over " +
        "blocks of 128 positions). *Tail*: positions at or beyond the capacity, where eviction "
        "acts; *Δ*: policy " +
        "minus full cache over the tail, paired by position.\n\n";
  for (const std::string& w : r.warnings) md += "> warning: " + w + "\n";
  if (!r.warnings.empty()) md += "\n";
  if (full) {
    const StreamPplSummary fs = summarize_run(*full, nullptr, kNllBlock);
    md += "Full cache: mean NLL " + fmt_pm(fs.mean_nll, fs.se_nll, 4) + " (PPL " +
          fmt_num("%.3f", fs.ppl) + ").\n\n";
  }
  for (int cap : caps) {
    md += "## Capacity " + std::to_string(cap) + " slots\n\n";
    std::vector<std::vector<std::string>> rows;
    LineChart chart, delta;
    chart.title = "Running mean NLL, capacity " + std::to_string(cap);
    chart.x_label = "tokens scored";
    chart.y_label = "mean NLL so far (nats)";
    delta.title = "Running mean NLL minus full cache, capacity " + std::to_string(cap);
    delta.x_label = "tokens scored";
    delta.y_label = "Δ NLL vs full (nats), ± SE";
    if (full) {
      LineSeries fsr =
          running_mean(std::vector<double>(full->nll.begin(), full->nll.end()), 300, false, "full");
      fsr.dashed = true;
      chart.series.push_back(fsr);
    }
    for (const StreamPplRun& run : r.runs) {
      if (run.capacity != cap) continue;
      const StreamPplSummary s = summarize_run(run, full, kNllBlock);
      rows.push_back({run.label, "`" + run.spec + "`", fmt_num("%.3f", s.ppl),
                      fmt_pm(s.mean_nll, s.se_nll, 4), fmt_pm(s.tail_nll, s.tail_se, 4),
                      full ? fmt_pm(s.delta_nll, s.delta_se, 4) : "-",
                      fmt_num("%.0f", run.slots_end), std::to_string(run.evicted),
                      std::to_string(run.merged)});
      const std::vector<double> x(run.nll.begin(), run.nll.end());
      chart.series.push_back(running_mean(x, 300, false, run.label));
      if (full) {
        std::vector<double> d(x.size());
        for (size_t i = 0; i < d.size(); ++i) d[i] = x[i] - static_cast<double>(full->nll[i]);
        delta.series.push_back(running_mean(d, 120, true, run.label));
      }
    }
    md += md_table({"policy", "spec", "PPL", "mean NLL", "tail NLL", "Δ NLL (tail)", "slots",
                    "evicted", "merged"},
                   rows);
    md += "\n";
    // Keep the series colours consistent between the two charts: full is first in `chart`.
    D2O_RETURN_IF_ERROR(
        write_file(files.dir + "/" + svg_name(files, cap, ""), render_line_chart(chart)));
    md += "![running mean NLL, capacity " + std::to_string(cap) + "](" + svg_name(files, cap, "") +
          ")\n\n";
    if (full) {
      LineSeries zero;
      zero.name = "full";
      zero.x = {1.0, static_cast<double>(r.n_tokens - 1)};
      zero.y = {0.0, 0.0};
      zero.dashed = true;
      delta.series.insert(delta.series.begin(), zero);
      D2O_RETURN_IF_ERROR(
          write_file(files.dir + "/" + svg_name(files, cap, "_delta"), render_line_chart(delta)));
      md += "![NLL minus full cache, capacity " + std::to_string(cap) + "](" +
            svg_name(files, cap, "_delta") + ")\n\n";
    }
  }
  md += "Wall time " + format_duration(r.seconds) + " (engine: matmul " +
        format_duration(r.timings.matmul_s) + ", attention " +
        format_duration(r.timings.attention_s) + ", policy " + format_duration(r.timings.policy_s) +
        ").\n";
  D2O_RETURN_IF_ERROR(write_file(files.path(".json"), j.dump(1) + "\n"));
  D2O_RETURN_IF_ERROR(write_file(files.path(".md"), md));
  return {};
}

}  // namespace d2o::eval
