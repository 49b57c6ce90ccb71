// The report of `d2o eval ruler`: JSON with every trial, Markdown tables (scores, shares of the
// full cache's score, paired differences against d2o, the compression reached) and a heatmap.
#include <cmath>

#include "eval/ruler.h"
#include "eval/stats.h"
#include "eval/svg.h"

namespace d2o::eval {

namespace {

std::string score_pct(double v) {
  return std::isfinite(v) ? fmt_num("%.1f", 100.0 * v) : "-";
}

std::string len_label(int len) {
  return len >= 1024 && len % 1024 == 0 ? std::to_string(len / 1024) + "K" : std::to_string(len);
}

// The trials of a cell: task, and length (0 = all lengths); task index -1 = all tasks.
struct Cell {
  int task = -1;
  int length = 0;
};

bool in_cell(const RulerOutcome& o, const Cell& c, const RulerParams& p) {
  return (c.task < 0 || o.task == p.tasks[static_cast<size_t>(c.task)]) &&
         (c.length == 0 || o.length == c.length);
}

std::vector<double> scores(const RulerResult& r, const RulerParams& p, const Cell& c, size_t pi) {
  std::vector<double> v;
  for (const RulerOutcome& o : r.outcomes) {
    if (in_cell(o, c, p)) v.push_back(o.scores[pi]);
  }
  return v;
}

std::vector<double> paired(const RulerResult& r, const RulerParams& p, const Cell& c, size_t a,
                           size_t b) {
  std::vector<double> v;
  for (const RulerOutcome& o : r.outcomes) {
    if (in_cell(o, c, p)) v.push_back(o.scores[a] - o.scores[b]);
  }
  return v;
}

std::string cell_name(const RulerParams& p, const Cell& c) {
  std::string s = c.task < 0 ? "all tasks" : ruler_task_name(p.tasks[static_cast<size_t>(c.task)]);
  if (c.length > 0) s += " " + len_label(c.length);
  return s;
}

}  // namespace

Status write_ruler_report(const RulerResult& r, const RulerParams& p, const RunMeta& meta,
                          const RulerReportText& text, const ReportFiles& files) {
  D2O_RETURN_IF_ERROR(ensure_dir(files.dir));
  const size_t n_pol = p.policies.size();
  int full = -1, d2o = -1;
  for (size_t i = 0; i < n_pol; ++i) {
    if (p.policies[i].label == "full" && full < 0) full = static_cast<int>(i);
    if (p.policies[i].label == "d2o" && d2o < 0) d2o = static_cast<int>(i);
  }
  // Without a plain "d2o", the first D2O variant is the one compared.
  for (size_t i = 0; i < n_pol && d2o < 0; ++i) {
    if (spec_preset(p.policies[i].spec) == "d2o") d2o = static_cast<int>(i);
  }
  std::vector<std::string> task_names;
  for (RulerTask t : p.tasks) task_names.push_back(ruler_task_name(t));
  // Cells: each task pooled over lengths, then (with several lengths) each task and length,
  // then all tasks.
  std::vector<Cell> pooled, by_length;
  for (size_t ti = 0; ti < p.tasks.size(); ++ti) {
    pooled.push_back({static_cast<int>(ti), 0});
    for (int len : p.lengths) by_length.push_back({static_cast<int>(ti), len});
  }
  pooled.push_back({-1, 0});

  nlohmann::json j;
  j["protocol"] = "ruler";
  j["description"] =
      "RULER-style synthetic tasks (niah single/multikey/multivalue/multiquery, variable "
      "tracking, common and frequent words extraction); prompt-then-compress, greedy answer; "
      "score = share of the expected strings found in the answer (RULER's string_match_all). "
      "Mean ± standard error over trials; paired differences by trial; share = the policy's mean "
      "score over the full cache's.";
  j["meta"] = to_json(meta);
  j["params"] = {{"tasks", task_names},
                 {"lengths", p.lengths},
                 {"trials", p.trials},
                 {"compression", p.compression},
                 {"chunk", p.chunk},
                 {"seed", p.seed},
                 {"question", question_setting_name(p.shape.setting)},
                 {"questions", p.shape.questions}};
  j["haystack"] = {
      {"name", text.haystack}, {"note", text.haystack_note}, {"chat_template", text.chat_template}};
  j["prefills_per_trial"] = r.n_prefills;
  j["seconds"] = r.seconds;
  nlohmann::json pols = nlohmann::json::array();
  for (const PolicyUnderTest& q : p.policies)
    pols.push_back({{"label", q.label}, {"spec", q.spec}});
  j["policies"] = pols;

  // Scores per policy and cell.
  std::vector<Cell> all_cells = pooled;
  all_cells.insert(all_cells.end(), by_length.begin(), by_length.end());
  nlohmann::json summary = nlohmann::json::array();
  for (const Cell& c : all_cells) {
    const double full_mean =
        full >= 0 ? mean_se(scores(r, p, c, static_cast<size_t>(full))).mean : std::nan("");
    for (size_t pi = 0; pi < n_pol; ++pi) {
      const MeanSe m = mean_se(scores(r, p, c, pi));
      double kept = 0;
      int64_t n = 0;
      for (const RulerOutcome& o : r.outcomes) {
        if (in_cell(o, c, p)) kept += o.kept[pi], ++n;
      }
      kept = n ? kept / static_cast<double>(n) : std::nan("");
      summary.push_back({{"policy", p.policies[pi].label},
                         {"task", c.task < 0 ? "all" : task_names[static_cast<size_t>(c.task)]},
                         {"length", c.length},
                         {"score", m.mean},
                         {"se", m.se},
                         {"trials", m.n},
                         {"share_of_full", full_mean > 0 ? m.mean / full_mean : std::nan("")},
                         {"kept", kept},
                         {"kvpress_compression_ratio", 1.0 - kept}});
    }
  }
  j["summary"] = summary;

  // Paired differences against d2o.
  nlohmann::json comparisons = nlohmann::json::array();
  std::vector<std::vector<std::string>> cmp_rows;
  if (d2o >= 0) {
    for (const Cell& c : all_cells) {
      for (size_t b = 0; b < n_pol; ++b) {
        if (static_cast<int>(b) == d2o) continue;
        const MeanSe m = mean_se(paired(r, p, c, static_cast<size_t>(d2o), b));
        const std::string v = paired_verdict(m.mean, m.se, m.n);
        comparisons.push_back(
            {{"task", c.task < 0 ? "all" : task_names[static_cast<size_t>(c.task)]},
             {"length", c.length},
             {"vs", p.policies[b].label},
             {"difference", m.mean},
             {"se", m.se},
             {"trials", m.n},
             {"verdict", v}});
        if (c.length == 0 || p.lengths.size() > 1) {
          cmp_rows.push_back({cell_name(p, c), p.policies[b].label,
                              fmt_pm(100 * m.mean, 100 * m.se, 1) + " pts", v});
        }
      }
    }
  }
  j["comparisons"] = comparisons;

  nlohmann::json trials = nlohmann::json::array();
  for (const RulerOutcome& o : r.outcomes) {
    trials.push_back({{"task", ruler_task_name(o.task)},
                      {"length", o.length},
                      {"trial", o.trial},
                      {"prompt_tokens", o.prompt_tokens},
                      {"query", o.query},
                      {"expected", o.expected},
                      {"depths", o.depths},
                      {"answers", o.answers},
                      {"scores", o.scores},
                      {"kept", o.kept}});
    if (p.shape.setting == QuestionSetting::kAfter)
      trials.back()["context_tokens"] = o.context_tokens;
    if (!o.more_queries.empty()) {
      trials.back()["more_queries"] = o.more_queries;
      trials.back()["more_answers"] = o.more_answers;
      trials.back()["more_scores"] = o.more_scores;
    }
  }
  j["trials"] = trials;

  // ---- Markdown ----
  std::string lens;
  for (int len : p.lengths) lens += (lens.empty() ? "" : ", ") + std::to_string(len);
  // How each context was fed (AnswerRequest::chunk).
  const std::string passes =
      p.chunk > 0 ? "in passes of " + std::to_string(p.chunk) +
                        " tokens fed to each policy (which compacts between them as its budget "
                        "says)"
                  : std::string("in one pass");
  const bool at_bytes = p.compression.rfind("bytes=", 0) == 0;  // --bytes
  const bool after = p.shape.setting == QuestionSetting::kAfter;
  std::string md = at_bytes
                       ? "# RULER-style synthetic tasks at equal KV bytes (`d2o eval ruler "
                         "--bytes`, " +
                             p.compression + ")\n\n"
                       : "# RULER-style synthetic tasks, " + lens + " tokens (`d2o eval ruler`" +
                             (after ? ", question after compression" : "") + ")\n\n";
  md += "Model `" + meta.model_name + "`; compression `" + p.compression + "` (" +
        (after ? "question after compression: the context turn " + passes + ", compacted after "
                 "it, then the question as the next turn, one pass, as a server session's "
                 "next request" +
                     (p.shape.questions > 1
                          ? std::string(", ") + std::to_string(p.shape.questions) +
                                " questions per context (niah and vt; cwe and fwe ask one), "
                                "each asked of a copy of the compacted context; a trial's "
                                "score is the mean over its questions"
                          : std::string()) +
                     ", then a greedy answer, evicting as it goes"
               : "question before compression: the whole prompt, question included, " + passes +
                     ", compacted after it, then a greedy answer, evicting as it goes") +
        "). Haystack: " + text.haystack +
        (text.haystack_note.empty() ? "" : " (" + text.haystack_note + ")") + "; prompts " +
        (text.chat_template ? "in the model's chat template" : "as plain text") +
        " with RULER's answer prefix. Lengths (prompt + answer budget): " + lens + " tokens; " +
        std::to_string(p.trials) +
        " trial(s) per task and length. Score = share of the expected strings found in the "
        "answer (RULER's string_match_all), in %; mean ± standard error over trials. Share = the "
        "policy's mean score over the full cache's.\n\n";
  auto score_table = [&](const std::vector<Cell>& cells, bool share) {
    std::vector<std::string> h = {"policy"};
    for (const Cell& c : cells) h.push_back(cell_name(p, c));
    std::vector<std::vector<std::string>> body;
    for (size_t pi = 0; pi < n_pol; ++pi) {
      std::vector<std::string> line = {p.policies[pi].label};
      for (const Cell& c : cells) {
        const MeanSe m = mean_se(scores(r, p, c, pi));
        if (!share) {
          line.push_back(fmt_pm(100 * m.mean, 100 * m.se, 1));
          continue;
        }
        const double f =
            full >= 0 ? mean_se(scores(r, p, c, static_cast<size_t>(full))).mean : std::nan("");
        line.push_back(f > 0 ? score_pct(m.mean / f) + "%" : "- (full scores 0)");
      }
      body.push_back(line);
    }
    return md_table(h, body);
  };
  md += "## Score by task, %\n\n" + score_table(pooled, false) + "\n";
  if (full >= 0) md += "## Share of the full cache's score\n\n" + score_table(pooled, true) + "\n";
  if (p.lengths.size() > 1) {
    md += "## Score by task and length, %\n\n" + score_table(by_length, false) + "\n";
  }
  // Compression reached.
  {
    std::vector<std::vector<std::string>> body;
    for (size_t pi = 0; pi < n_pol; ++pi) {
      double kept = 0;
      int64_t n = 0;
      for (const RulerOutcome& o : r.outcomes) kept += o.kept[pi], ++n;
      kept = n ? kept / static_cast<double>(n) : std::nan("");
      body.push_back({p.policies[pi].label, "`" + p.policies[pi].spec + "`", fmt_num("%.3f", kept),
                      fmt_num("%.3f", 1.0 - kept)});
    }
    md +=
        "## Compression reached\n\nKV slots per head and layer right after the prompt's "
        "compaction, over the prompt's tokens (d2o's ratio: the fraction kept), and kvpress's "
        "compression_ratio (the fraction removed, 1 − kept); means over all trials.\n\n" +
        md_table({"policy", "spec", "kept (d2o ratio)", "kvpress compression_ratio"}, body) + "\n";
  }
  if (d2o >= 0) {
    const std::string& me = p.policies[static_cast<size_t>(d2o)].label;
    md += "## Paired differences against d2o\n\nScore of `" + me +
          "` minus the other policy, paired by trial, in points ± one standard error; **wins** / "
          "**loses** beyond two standard errors, ties otherwise.\n\n" +
          md_table({"task", "vs", "d2o − other", "d2o"}, cmp_rows) + "\n";
  }
  // Heatmap: the score per policy (rows) and task/length cell (columns).
  {
    const std::vector<Cell>& cols = p.lengths.size() > 1 ? by_length : pooled;
    Heatmap hm;
    hm.title = "RULER score (" + p.compression + ")";
    hm.x_label = p.lengths.size() > 1 ? "task and length" : "task";
    hm.y_label = "policy";
    for (const Cell& c : cols) hm.x_ticks.push_back(cell_name(p, c));
    for (const PolicyUnderTest& q : p.policies) hm.y_ticks.push_back(q.label);
    for (size_t pi = 0; pi < n_pol; ++pi) {
      for (const Cell& c : cols) hm.values.push_back(mean_se(scores(r, p, c, pi)).mean);
    }
    hm.cell_w = 104;
    hm.cell_h = 26;
    const std::string svg = files.name + "_scores.svg";
    D2O_RETURN_IF_ERROR(write_file(files.dir + "/" + svg, render_heatmap(hm)));
    md += "![RULER scores](" + svg + ")\n\n";
  }
  D2O_ASSIGN_OR_RETURN(const std::string bytes_md, ruler_bytes_section(r, p, files, j));
  md += bytes_md;
  md += "Wall time " + format_duration(r.seconds) + " (" + std::to_string(r.n_prefills) +
        (p.chunk > 0 ? " prompt prefills per trial, each policy its own"
                     : " shared prompt pass(es) per trial") +
        ").\n";
  D2O_RETURN_IF_ERROR(write_file(files.path(".json"), j.dump(1) + "\n"));
  D2O_RETURN_IF_ERROR(write_file(files.path(".md"), md));
  return {};
}

}  // namespace d2o::eval
