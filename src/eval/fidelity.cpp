#include "eval/fidelity.h"

#include <algorithm>
#include <cmath>

#include "core/timer.h"
#include "eval/fork.h"
#include "eval/harness.h"
#include "eval/kv_bytes.h"
#include "eval/perplexity.h"
#include "eval/stats.h"
#include "eval/svg.h"
#include "model/layer_desc.h"

namespace d2o::eval {

KvType case_kv_type(const FidelityParams& p, size_t i) {
  return p.cases[i].kv_type.value_or(p.kv_type);
}

void log_softmax(const float* logits, int n, std::vector<double>& out) {
  out.resize(static_cast<size_t>(n));
  float m = logits[0];
  for (int i = 1; i < n; ++i) m = std::max(m, logits[i]);
  double s = 0;
  for (int i = 0; i < n; ++i) s += std::exp(static_cast<double>(logits[i]) - m);
  const double lse = static_cast<double>(m) + std::log(s);
  for (int i = 0; i < n; ++i) out[static_cast<size_t>(i)] = static_cast<double>(logits[i]) - lse;
}

double kl_from_logits(std::span<const double> ref_logp, const float* x) {
  const int n = static_cast<int>(ref_logp.size());
  float m = x[0];
  for (int i = 1; i < n; ++i) m = std::max(m, x[i]);
  double s = 0;
  for (int i = 0; i < n; ++i) s += std::exp(static_cast<double>(x[i]) - m);
  const double lse = static_cast<double>(m) + std::log(s);
  double kl = 0;
  for (int i = 0; i < n; ++i) {
    const double lp = ref_logp[static_cast<size_t>(i)];
    const double lq = static_cast<double>(x[i]) - lse;
    // Terms with lp == lq contribute exactly 0, so identical rows give exactly 0.
    if (lp != lq) kl += std::exp(lp) * (lp - lq);
  }
  return std::max(kl, 0.0);
}

Result<FidelityResult> run_fidelity(Engine& engine, std::span<const TokenId> tokens,
                                    const FidelityParams& p, Progress* progress) {
  if (p.cases.empty()) return invalid_argument("no policies to evaluate");
  if (p.prompt_len < 1 || p.n_samples < 1 || p.n_continue < 1) {
    return invalid_argument("prompt length, samples and continuation length must be at least 1");
  }
  const int64_t window = static_cast<int64_t>(p.prompt_len) + p.n_continue + 1;
  if (p.n_ctx_train > 0 && window - 1 > p.n_ctx_train) {
    return invalid_argument(
        "a prompt of " + std::to_string(p.prompt_len) + " tokens plus " +
        std::to_string(p.n_continue) + " continuation tokens (" + std::to_string(window - 1) +
        " positions) exceeds the model's trained context of " + std::to_string(p.n_ctx_train) +
        " tokens; use a smaller --prompt or --continue");
  }
  const int64_t n_text = static_cast<int64_t>(tokens.size());
  if (n_text < window) {
    return invalid_argument(
        "the text has " + std::to_string(n_text) + " tokens, fewer than one sample needs (" +
        std::to_string(window) + " = prompt " + std::to_string(p.prompt_len) + " + continuation " +
        std::to_string(p.n_continue) + " + 1); use a longer text or a smaller --prompt");
  }
  if (p.n_samples > 1 && (n_text - window) / (p.n_samples - 1) < 1) {
    return invalid_argument("the text is too short for " + std::to_string(p.n_samples) +
                            " distinct samples");
  }
  const ModelHParams& hp = engine.model().hparams();
  const int nv = hp.n_vocab;
  const size_t n_cases = p.cases.size();
  FidelityResult res;
  res.cases.resize(n_cases);
  for (auto& c : res.cases) c.kl_by_step.assign(static_cast<size_t>(p.n_continue), 0.0);
  // Samples evenly spaced over the text (overlapping only when the text is short).
  for (int s = 0; s < p.n_samples; ++s) {
    res.offsets.push_back(p.n_samples == 1 ? 0 : (n_text - window) * s / (p.n_samples - 1));
  }
  // Sequence 0 is the full-cache reference, then the cases.
  std::vector<std::shared_ptr<const KvPolicy>> policies = {std::make_shared<FullPolicy>()};
  std::vector<KvType> types = {p.kv_type};
  for (size_t i = 0; i < n_cases; ++i) {
    policies.push_back(p.cases[i].policy.policy);
    types.push_back(case_kv_type(p, i));
  }
  for (const KvType& t : types)
    D2O_RETURN_IF_ERROR(check_kv_type(t, hp.head_dim).with_context("KV storage type"));
  const bool in_turns = !p.turn_open.empty();
  res.context_end = static_cast<int64_t>(p.prompt_len) + p.n_continue;
  if (in_turns) {
    res.context_end += static_cast<int64_t>(p.turn_prefix.size() + p.turn_open.size());
    if (p.turn_reply.size() >= static_cast<size_t>(p.n_continue)) {
      return invalid_argument("the new user turn's " + std::to_string(p.turn_reply.size()) +
                              " tokens leave no continuation text in " +
                              std::to_string(p.n_continue) + " steps; use a larger --continue");
    }
    if (p.n_ctx_train > 0 &&
        res.context_end + static_cast<int64_t>(p.turn_reply.size()) > p.n_ctx_train) {
      return invalid_argument(
          "the prompt, its chat turns and the continuation exceed the "
          "model's trained context of " +
          std::to_string(p.n_ctx_train) + " tokens; use a smaller --prompt");
    }
  }
  res.f16_full_bytes_end = static_cast<double>(
      full_kv_bytes(f16_config(kv_cache_config(hp, p.kv_type)), res.context_end));
  const size_t n_seq = policies.size();
  std::vector<float> logits(n_seq * static_cast<size_t>(nv));
  std::vector<float> all_logits(p.continue_in_one_pass ? static_cast<size_t>(p.n_continue) * n_seq *
                                                             static_cast<size_t>(nv)
                                                       : 0);
  std::vector<double> ref_logp;
  std::vector<double> kl(n_cases), nll(n_cases);
  std::vector<int> agree(n_cases);
  engine.reset_timings();
  Stopwatch sw;
  for (int s = 0; s < p.n_samples; ++s) {
    const int64_t off = res.offsets[static_cast<size_t>(s)];
    std::vector<TokenId> prompt(tokens.begin() + off, tokens.begin() + off + p.prompt_len);
    // The teacher-forced stream: input cont[t], target cont[t + 1].
    std::vector<TokenId> cont(tokens.begin() + off + p.prompt_len,
                              tokens.begin() + off + p.prompt_len + p.n_continue + 1);
    if (in_turns) {
      prompt.insert(prompt.begin(), p.turn_prefix.begin(), p.turn_prefix.end());
      prompt.insert(prompt.end(), p.turn_open.begin(), p.turn_open.end());
      cont.insert(cont.begin(), p.turn_reply.begin(), p.turn_reply.end());
    } else if (p.bos >= 0) {
      prompt[0] = p.bos;
    }
    D2O_ASSIGN_OR_RETURN(ForkedPrefill fork,
                         prefill_in_chunks(engine, prompt, policies, types, p.chunk));
    res.n_prefills = fork.n_prefills;
    std::vector<double> sum_kl(n_cases, 0), sum_top1(n_cases, 0), sum_nll(n_cases, 0);
    double sum_nll_full = 0;
    std::vector<BatchEntry> batch(n_seq);
    if (p.continue_in_one_pass) {
      // Every step's logits of every sequence at once: [n_continue][n_seq][n_vocab].
      for (size_t q = 0; q < n_seq; ++q)
        batch[q] =
            BatchEntry{fork.seqs[q].get(), {cont.data(), static_cast<size_t>(p.n_continue)}, 0};
      D2O_RETURN_IF_ERROR(engine.forward(batch, [&](int e, int i, const float* l) {
        std::copy(l, l + nv,
                  all_logits.begin() +
                      (static_cast<ptrdiff_t>(i) * static_cast<ptrdiff_t>(n_seq) + e) * nv);
      }));
    }
    for (int t = 0; t < p.n_continue; ++t) {
      const size_t at = static_cast<size_t>(t);
      if (p.continue_in_one_pass) {
        std::copy_n(all_logits.begin() + static_cast<ptrdiff_t>(at * n_seq) * nv,
                    static_cast<ptrdiff_t>(n_seq) * nv, logits.begin());
      } else {
        for (size_t q = 0; q < n_seq; ++q)
          batch[q] = BatchEntry{fork.seqs[q].get(), {&cont[at], 1}, -1};
        D2O_RETURN_IF_ERROR(engine.forward(batch, [&](int e, int, const float* l) {
          std::copy(l, l + nv, logits.begin() + static_cast<ptrdiff_t>(e) * nv);
        }));
      }
      const TokenId target = cont[at + 1];
      log_softmax(logits.data(), nv, ref_logp);
      const TokenId ref_top = argmax(logits.data(), nv);
      // The same function as the cases' NLL, so identical logits give identical NLLs.
      const double nll_full = -log_prob(logits.data(), nv, target);
      // Cases are independent: spread them over the engine's threads (results do not depend on
      // the thread count; each case writes only its own slot).
      engine.pool().parallel_for(static_cast<int64_t>(n_cases), 1, [&](int64_t b, int64_t e, int) {
        for (int64_t c = b; c < e; ++c) {
          const float* x = logits.data() + static_cast<size_t>(c + 1) * nv;
          kl[static_cast<size_t>(c)] = kl_from_logits(ref_logp, x);
          agree[static_cast<size_t>(c)] = argmax(x, nv) == ref_top;
          nll[static_cast<size_t>(c)] = -log_prob(x, nv, target);
        }
      });
      sum_nll_full += nll_full;
      for (size_t c = 0; c < n_cases; ++c) {
        sum_kl[c] += kl[c];
        sum_top1[c] += agree[c];
        sum_nll[c] += nll[c];
        res.cases[c].kl_by_step[static_cast<size_t>(t)] += kl[c] / p.n_samples;
      }
      if (progress) progress->add(1.0);
    }
    const double T = p.n_continue;
    for (size_t c = 0; c < n_cases; ++c) {
      FidelityCaseResult& cr = res.cases[c];
      cr.kl.push_back(sum_kl[c] / T);
      cr.top1.push_back(sum_top1[c] / T);
      cr.nll.push_back(sum_nll[c] / T);
      cr.nll_full.push_back(sum_nll_full / T);
      const Sequence& seq = *fork.seqs[c + 1];
      cr.slots_end +=
          static_cast<double>(seq.cache().total_slots()) / seq.cache().n_layer() / p.n_samples;
      cr.kv_bytes_end += static_cast<double>(seq.cache().kv_bytes_used()) / p.n_samples;
      for (int64_t v : seq.policy_state().evicted) cr.evicted += v;
      for (int64_t v : seq.policy_state().merged) cr.merged += v;
    }
  }
  res.seconds = sw.seconds();
  res.timings = engine.timings();
  return res;
}

namespace {

struct CellStats {
  MeanSe kl, top1, dnll;
};

CellStats cell_stats(const FidelityCaseResult& c) {
  CellStats s;
  s.kl = mean_se(c.kl);
  s.top1 = mean_se(c.top1);
  std::vector<double> d(c.nll.size());
  for (size_t i = 0; i < d.size(); ++i) d[i] = c.nll[i] - c.nll_full[i];
  s.dnll = mean_se(d);
  return s;
}

template <class T>
void push_unique(std::vector<T>& v, const T& x) {
  if (std::find(v.begin(), v.end(), x) == v.end()) v.push_back(x);
}

std::string safe_name(const std::string& s) {
  std::string o;
  for (char c : s)
    o += (std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-') ? c : '_';
  return o;
}

}  // namespace

Status write_fidelity_report(const FidelityResult& r, const FidelityParams& p, const RunMeta& meta,
                             const FidelityReportText& text, const ReportFiles& files) {
  D2O_RETURN_IF_ERROR(ensure_dir(files.dir));
  nlohmann::json j;
  j["protocol"] = text.protocol;
  j["description"] =
      std::string(
          "Prompt-then-compress: each sample's prompt runs in one pass and is compacted "
          "after it; the true continuation is then teacher-forced ") +
      (p.continue_in_one_pass ? "in one pass, logits at every position" : "one token per pass") +
      ". Per step: KL(full || policy) in nats, top-1 "
      "agreement with the "
      "full cache, NLL of the true token. Per-sample means over the steps; mean ± standard error "
      "over samples.";
  j["meta"] = to_json(meta);
  j["params"] = {
      {"prompt_len", p.prompt_len}, {"n_samples", p.n_samples}, {"n_continue", p.n_continue}};
  if (p.bos >= 0) j["params"]["bos"] = p.bos;
  if (p.continue_in_one_pass) j["params"]["continue_in_one_pass"] = true;
  if (!p.turn_open.empty()) {
    j["params"]["continue_turn"] = {{"prefix_tokens", p.turn_prefix.size()},
                                    {"open_tokens", p.turn_open.size()},
                                    {"reply_tokens", p.turn_reply.size()}};
  }
  j["offsets"] = r.offsets;
  j["prefills_per_sample"] = r.n_prefills;
  j["f16_full_bytes_end"] = r.f16_full_bytes_end;
  j["context_end"] = r.context_end;
  j["seconds"] = r.seconds;
  j["engine_seconds"] = timings_json(r.timings);
  std::vector<std::string> rows, cols;
  nlohmann::json jc = nlohmann::json::array();
  for (size_t i = 0; i < p.cases.size(); ++i) {
    const FidelityCase& c = p.cases[i];
    const FidelityCaseResult& cr = r.cases[i];
    push_unique(rows, c.row);
    push_unique(cols, c.column);
    const CellStats s = cell_stats(cr);
    jc.push_back({{"row", c.row},
                  {"kv_type", kv_type_name(case_kv_type(p, i))},
                  {"share", c.share},
                  {"budget", c.budget},
                  {"kv_bytes_end", cr.kv_bytes_end},
                  {"column", c.column},
                  {"spec", c.policy.spec},
                  {"kl", s.kl.mean},
                  {"kl_se", s.kl.se},
                  {"top1", s.top1.mean},
                  {"top1_se", s.top1.se},
                  {"delta_nll", s.dnll.mean},
                  {"delta_nll_se", s.dnll.se},
                  {"slots_end", cr.slots_end},
                  {"evicted", cr.evicted},
                  {"merged", cr.merged},
                  {"per_sample",
                   {{"kl", cr.kl}, {"top1", cr.top1}, {"nll", cr.nll}, {"nll_full", cr.nll_full}}},
                  {"kl_by_step", cr.kl_by_step}});
  }
  j["cases"] = jc;

  auto find = [&](const std::string& row, const std::string& col) -> int {
    for (size_t i = 0; i < p.cases.size(); ++i) {
      if (p.cases[i].row == row && p.cases[i].column == col) return static_cast<int>(i);
    }
    return -1;
  };
  std::string md = "# " + text.title + "\n\n" + text.intro + "\n\n";
  md += "Model `" + meta.model_name + "`, text `" + meta.text_name + "`, " +
        std::to_string(p.n_samples) + " samples × (prompt " + std::to_string(p.prompt_len) + " + " +
        std::to_string(p.n_continue) + " teacher-forced tokens), KV storage " + meta.kv_type +
        ". Each cell: mean over samples ± standard error over samples." +
        (p.bos >= 0 ? " Each window's first token is replaced by BOS, as the tokenizer adds it."
                    : "") +
        "\n\n";
  struct Metric {
    const char* title;
    int which;  // 0 kl, 1 top1, 2 dnll
    int decimals;
    double scale;
  };
  const Metric metrics[] = {
      {"KL(full ‖ policy), nats per token (lower is better)", 0, 4, 1.0},
      {"Top-1 agreement with the full cache, % (higher is better)", 1, 1, 100.0},
      {"NLL of the true token minus the full cache's, nats (lower is better)", 2, 4, 1.0}};
  for (const Metric& m : metrics) {
    md += "## " + std::string(m.title) + "\n\n";
    std::vector<std::string> header = {text.protocol == "ablate" ? "variant" : "policy"};
    for (const std::string& c : cols)
      header.push_back(c == "-" ? "-" : (text.protocol == "ablate" ? c : text.column_prefix + c));
    std::vector<std::vector<std::string>> body;
    for (const std::string& row : rows) {
      std::vector<std::string> line = {row};
      for (const std::string& col : cols) {
        const int i = find(row, col);
        if (i < 0) {
          line.push_back("");
          continue;
        }
        const CellStats s = cell_stats(r.cases[static_cast<size_t>(i)]);
        const MeanSe& v = m.which == 0 ? s.kl : m.which == 1 ? s.top1 : s.dnll;
        line.push_back(fmt_pm(v.mean * m.scale, v.se * m.scale, m.decimals));
      }
      body.push_back(line);
    }
    md += md_table(header, body) + "\n";
  }
  md += "## Specs\n\n";
  std::vector<std::vector<std::string>> spec_rows;
  for (size_t i = 0; i < p.cases.size(); ++i) {
    const FidelityCaseResult& cr = r.cases[i];
    spec_rows.push_back({p.cases[i].row, p.cases[i].column, "`" + p.cases[i].policy.spec + "`",
                         fmt_num("%.0f", cr.slots_end), std::to_string(cr.evicted),
                         std::to_string(cr.merged)});
  }
  md += md_table({"row", "column", "spec", "slots at end", "evicted", "merged"}, spec_rows) + "\n";
  // KL against the step, one chart per column (compression level).
  for (const std::string& col : cols) {
    if (col == "-") continue;
    LineChart chart;
    chart.title = "KL(full ‖ policy) per continuation step" + (col == "-" ? "" : ", " + col);
    chart.x_label = "continuation step after compression";
    chart.y_label = "KL, nats (mean over samples)";
    for (const std::string& row : rows) {
      const int i = find(row, col);
      if (i < 0) continue;
      LineSeries s;
      s.name = row;
      const auto& ks = r.cases[static_cast<size_t>(i)].kl_by_step;
      for (size_t t = 0; t < ks.size(); ++t) {
        s.x.push_back(static_cast<double>(t + 1));
        s.y.push_back(ks[t]);
      }
      chart.series.push_back(s);
    }
    const std::string svg = files.name + "_kl_" + safe_name(col) + ".svg";
    D2O_RETURN_IF_ERROR(write_file(files.dir + "/" + svg, render_line_chart(chart)));
    md += "![KL per step, " + col + "](" + svg + ")\n\n";
  }
  D2O_ASSIGN_OR_RETURN(const std::string bytes_md, fidelity_bytes_section(r, p, files, j));
  md += bytes_md;
  md += "Wall time " + format_duration(r.seconds) + " (" + std::to_string(r.n_prefills) +
        (p.chunk > 0 ? " prompt prefills per sample, each policy its own"
                     : " shared prompt pass(es) per sample") +
        "; engine: matmul " +
        format_duration(r.timings.matmul_s) + ", attention " +
        format_duration(r.timings.attention_s) + ", policy " + format_duration(r.timings.policy_s) +
        ").\n";
  D2O_RETURN_IF_ERROR(write_file(files.path(".json"), j.dump(1) + "\n"));
  D2O_RETURN_IF_ERROR(write_file(files.path(".md"), md));
  return {};
}

}  // namespace d2o::eval
