// The report of `d2o eval niah`: JSON with every trial, Markdown tables, one heatmap per policy
// and task.
#include <algorithm>
#include <cmath>

#include "eval/niah.h"
#include "eval/stats.h"
#include "eval/svg.h"

namespace d2o::eval {

namespace {

std::string acc_pct(double v) {
  return fmt_num("%.0f%%", 100.0 * v);
}

std::string safe(const std::string& s) {
  std::string o;
  for (char c : s) o += (std::isalnum(static_cast<unsigned char>(c)) || c == '-') ? c : '_';
  return o;
}

struct Tally {
  int64_t k = 0, n = 0;
  double acc() const { return n ? static_cast<double>(k) / static_cast<double>(n) : std::nan(""); }
};

}  // namespace

Status write_niah_report(const NiahResult& r, const NiahParams& p, const RunMeta& meta,
                         const NiahReportText& text, const ReportFiles& files) {
  D2O_RETURN_IF_ERROR(ensure_dir(files.dir));
  const size_t n_pol = p.policies.size();
  constexpr double kZ = 1.959964;  // 95%
  nlohmann::json j;
  j["protocol"] = "niah";
  j["description"] =
      "Needle (magic number in prose) and passkey (in repeated filler) retrieval; "
      "prompt-then-compress, greedy "
      "answer, correct = the first digit run of the answer equals the key. Accuracy intervals: 95% "
      "Wilson score "
      "intervals over all trials of a policy and task.";
  j["meta"] = to_json(meta);
  std::vector<std::string> tasks;
  for (NiahTask t : p.tasks) tasks.push_back(niah_task_name(t));
  j["params"] = {{"tasks", tasks},
                 {"lengths", p.lengths},
                 {"depths", p.depths},
                 {"trials", p.trials},
                 {"compression", p.compression},
                 {"chunk", p.chunk},
                 {"seed", p.seed},
                 {"question", question_setting_name(p.shape.setting)},
                 {"questions", p.shape.questions}};
  j["haystack"] = {{"needle_task", text.haystack},
                   {"note", text.haystack_note},
                   {"chat_template", text.chat_template}};
  j["prefills_per_trial"] = r.n_prefills;
  j["seconds"] = r.seconds;
  nlohmann::json pols = nlohmann::json::array();
  for (const PolicyUnderTest& q : p.policies)
    pols.push_back({{"label", q.label}, {"spec", q.spec}});
  j["policies"] = pols;
  nlohmann::json trials = nlohmann::json::array();
  for (const NiahOutcome& o : r.outcomes) {
    trials.push_back({{"task", niah_task_name(o.task)},
                      {"length", o.length},
                      {"depth", o.depth},
                      {"depth_used", o.depth_used},
                      {"trial", o.trial},
                      {"key", o.key},
                      {"word", o.word},
                      {"answers", o.answers},
                      {"correct", o.correct}});
    if (!o.more_keys.empty()) {
      trials.back()["more_keys"] = o.more_keys;
      trials.back()["more_answers"] = o.more_answers;
      trials.back()["more_correct"] = o.more_correct;
    }
  }
  j["trials"] = trials;

  // How each context was fed (AnswerRequest::chunk).
  const std::string passes =
      p.chunk > 0 ? "in passes of " + std::to_string(p.chunk) +
                        " tokens fed to each policy (which compacts between them as its budget "
                        "says)"
                  : std::string("in one pass");
  const bool after = p.shape.setting == QuestionSetting::kAfter;
  std::string md = std::string("# Needle in a haystack and passkey retrieval (`d2o eval niah`") +
                   (after ? ", question after compression" : "") + ")\n\n";
  md += "Model `" + meta.model_name + "`; compression `" + p.compression + "` (" +
        (after ? "question after compression: the context turn " + passes +
                     ", compacted after it, then the question as the next turn, one pass, as a "
                     "server session's next request" +
                     (p.shape.questions > 1
                          ? ", " + std::to_string(p.shape.questions) +
                                " needles and questions per needle-task context, each question "
                                "asked of a copy of the compacted context; the tables count the "
                                "question about the cell's needle, the last one all of them"
                          : std::string())
               : "question before compression: the whole prompt, question included, " + passes +
                     ", compacted after it") +
        "; then a greedy answer of a few tokens, evicting as it goes). Needle haystack: " +
        text.haystack + (text.haystack_note.empty() ? "" : " (" + text.haystack_note + ")") +
        "; passkey filler: repeated sentences. Prompt " +
        (text.chat_template ? "in the model's chat template" : "as plain text (no chat template)") +
        ", with an answer prefix. Correct = the answer's first number equals the key. " +
        std::to_string(p.trials) +
        " trial(s) per cell; intervals are 95% Wilson score intervals over all trials of a policy "
        "and task.\n\n";
  // Overall accuracy per policy and task.
  std::vector<std::string> header = {"policy", "spec"};
  for (const std::string& t : tasks) header.push_back(t + " accuracy (95% CI)");
  std::vector<std::vector<std::string>> rows;
  nlohmann::json summary = nlohmann::json::array();
  for (size_t pi = 0; pi < n_pol; ++pi) {
    std::vector<std::string> line = {p.policies[pi].label, "`" + p.policies[pi].spec + "`"};
    for (NiahTask task : p.tasks) {
      Tally t;
      for (const NiahOutcome& o : r.outcomes) {
        if (o.task != task) continue;
        t.k += o.correct[pi];
        ++t.n;
      }
      const Interval ci = wilson_interval(t.k, t.n, kZ);
      line.push_back(acc_pct(t.acc()) + " (" + acc_pct(ci.lo) + "–" + acc_pct(ci.hi) + "), " +
                     std::to_string(t.k) + "/" + std::to_string(t.n));
      summary.push_back({{"policy", p.policies[pi].label},
                         {"task", niah_task_name(task)},
                         {"correct", t.k},
                         {"trials", t.n},
                         {"accuracy", t.acc()},
                         {"ci95", {ci.lo, ci.hi}}});
    }
    rows.push_back(line);
  }
  j["summary"] = summary;
  md += "## Accuracy\n\n" + md_table(header, rows) + "\n";
  if (p.shape.questions > 1) {
    // Every question of the needle task, the cell's and the follow-ups (questions about one
    // context are not independent: the interval is indicative).
    std::vector<std::vector<std::string>> all_rows;
    for (size_t pi = 0; pi < n_pol; ++pi) {
      Tally t;
      for (const NiahOutcome& o : r.outcomes) {
        if (o.task != NiahTask::kNeedle) continue;
        t.k += o.correct[pi];
        ++t.n;
        for (const std::vector<uint8_t>& c : o.more_correct) t.k += c[pi], ++t.n;
      }
      const Interval ci = wilson_interval(t.k, t.n, kZ);
      all_rows.push_back({p.policies[pi].label, acc_pct(t.acc()) + " (" + acc_pct(ci.lo) + "–" +
                                                    acc_pct(ci.hi) + "), " + std::to_string(t.k) +
                                                    "/" + std::to_string(t.n)});
    }
    md += "## needle: accuracy over all " + std::to_string(p.shape.questions) +
          " questions of each context\n\n" + md_table({"policy", "accuracy (95% CI)"}, all_rows) +
          "\n";
  }

  // Accuracy by length, per task.
  for (NiahTask task : p.tasks) {
    md += "## " + std::string(niah_task_name(task)) + ": accuracy by context length\n\n";
    std::vector<std::string> h = {"policy"};
    for (int len : p.lengths) h.push_back(std::to_string(len));
    std::vector<std::vector<std::string>> body;
    for (size_t pi = 0; pi < n_pol; ++pi) {
      std::vector<std::string> line = {p.policies[pi].label};
      for (int len : p.lengths) {
        Tally t;
        for (const NiahOutcome& o : r.outcomes) {
          if (o.task != task || o.length != len) continue;
          t.k += o.correct[pi];
          ++t.n;
        }
        line.push_back(acc_pct(t.acc()) + " (" + std::to_string(t.k) + "/" + std::to_string(t.n) +
                       ")");
      }
      body.push_back(line);
    }
    md += md_table(h, body) + "\n";
  }

  // Heatmaps: rows = depths, columns = lengths.
  md += "## Heatmaps (accuracy per cell; rows: needle depth, columns: context length)\n\n";
  for (NiahTask task : p.tasks) {
    std::string line_imgs;
    for (size_t pi = 0; pi < n_pol; ++pi) {
      Heatmap hm;
      hm.title = std::string(niah_task_name(task)) + ": " + p.policies[pi].label;
      hm.x_label = "context length (tokens)";
      hm.y_label = "needle depth";
      for (int len : p.lengths)
        hm.x_ticks.push_back(len >= 1024 && len % 1024 == 0 ? std::to_string(len / 1024) + "K"
                                                            : std::to_string(len));
      for (double d : p.depths) hm.y_ticks.push_back(fmt_num("%.0f%%", 100.0 * d));
      hm.value_format = p.trials > 1 ? "%.2f" : "";
      hm.cell_w = 56;
      hm.cell_h = 26;
      for (double d : p.depths) {
        for (int len : p.lengths) {
          Tally t;
          for (const NiahOutcome& o : r.outcomes) {
            if (o.task != task || o.length != len || o.depth != d) continue;
            t.k += o.correct[pi];
            ++t.n;
          }
          hm.values.push_back(t.acc());
        }
      }
      const std::string svg =
          files.name + "_" + niah_task_name(task) + "_" + safe(p.policies[pi].label) + ".svg";
      D2O_RETURN_IF_ERROR(write_file(files.dir + "/" + svg, render_heatmap(hm)));
      line_imgs +=
          "![" + std::string(niah_task_name(task)) + " " + p.policies[pi].label + "](" + svg + ") ";
    }
    md += "### " + std::string(niah_task_name(task)) + "\n\n" + line_imgs + "\n\n";
  }
  md += "Wall time " + format_duration(r.seconds) + " (" + std::to_string(r.n_prefills) +
        (p.chunk > 0 ? " prompt prefills per trial, each policy its own"
                     : " shared prompt pass(es) per trial") +
        ").\n";
  D2O_RETURN_IF_ERROR(write_file(files.path(".json"), j.dump(1) + "\n"));
  D2O_RETURN_IF_ERROR(write_file(files.path(".md"), md));
  return {};
}

}  // namespace d2o::eval
