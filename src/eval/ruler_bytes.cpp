// The equal-bytes section of `d2o eval ruler --bytes` (ruler.h): every (policy, storage type) at
// the same share of the F16 full cache's KV bytes, against the best combination of eviction and
// quantization, paired by trial.
#include <algorithm>
#include <cmath>

#include "eval/ruler.h"
#include "eval/stats.h"
#include "eval/svg.h"

namespace d2o::eval {

namespace {

bool type_quantized(KvType t) {
  return kv_quantized(t.k) || kv_quantized(t.v);
}

}  // namespace

Result<std::string> ruler_bytes_section(const RulerResult& r, const RulerParams& p,
                                        const ReportFiles& files, nlohmann::json& j) {
  const size_t n = p.policies.size();
  bool any = false;
  for (const PolicyUnderTest& t : p.policies) any = any || t.kv_type.has_value();
  if (!any || p.head_dim < 1 || r.outcomes.empty()) return std::string();
  const double f16_row = 4.0 * p.head_dim;  // a key and a value row of F16
  std::vector<double> score(n), se(n), kept(n), share(n);
  std::vector<int> kind(n);  // 0 no eviction, 1 eviction only, 2 combination
  for (size_t i = 0; i < n; ++i) {
    std::vector<double> s, k;
    for (const RulerOutcome& o : r.outcomes) {
      s.push_back(o.scores[i]);
      k.push_back(o.kept[i]);
    }
    const MeanSe m = mean_se(s);
    score[i] = m.mean, se[i] = m.se;
    kept[i] = mean_se(k).mean;
    const KvType t = p.policies[i].kv_type.value_or(p.kv_type);
    share[i] = kept[i] *
               static_cast<double>(kv_row_bytes(t.k, p.head_dim) + kv_row_bytes(t.v, p.head_dim)) /
               f16_row;
    const bool evicts = kept[i] < 1.0 - 1e-9;
    kind[i] = !evicts ? 0 : type_quantized(t) ? 2 : 1;
  }
  size_t best = n;
  for (size_t i = 0; i < n; ++i) {
    if (kind[i] == 2 && (best == n || score[i] > score[best])) best = i;
  }
  static const char* kKind[] = {"no eviction (quantization only)", "eviction only",
                                "eviction + quantization"};
  std::string md = "## At equal KV bytes\n\n";
  md +=
      "Every policy keeps, in each storage type, the share of the prompt's slots whose key and "
      "value rows fit `" +
      p.compression +
      "` (quantized rows with their block scales; to the nearest slot, as a ratio) and holds "
      "them while it answers (SnapKV and PyramidKV with `hold_budget=on`). KV bytes: slots kept "
      "right after the prompt's compaction, as a share of a full F16 cache's bytes for the prompt. "
      "Scores pooled over tasks and lengths, ± one standard error over trials; "
      "the difference to the best combination of eviction and quantization is paired by "
      "trial; a single method (eviction alone, or a full cache in a quantized type) counts as "
      "beaten beyond two standard errors.\n\n";
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return score[a] > score[b]; });
  std::vector<std::vector<std::string>> rows;
  nlohmann::json jm = nlohmann::json::array();
  int singles = 0, beaten = 0;
  for (size_t i : order) {
    std::string diff = "-", v = i == best ? "best combination" : "-";
    MeanSe d;
    if (best < n && i != best) {
      std::vector<double> x;
      for (const RulerOutcome& o : r.outcomes) x.push_back(o.scores[best] - o.scores[i]);
      d = mean_se(x);
      diff = fmt_pm(100 * d.mean, 100 * d.se, 1);
      // Only methods that fit the bytes count as rivals (the full F16 reference does not).
      if (kind[i] != 2 && share[i] <= share[best] * 1.02 + 1e-9) {
        ++singles;
        const bool won = d.se > 0 && d.mean > 2 * d.se;
        beaten += won;
        v = won                                ? "**combination better**"
            : (d.se > 0 && d.mean < -2 * d.se) ? "**combination worse**"
                                               : "not resolved";
      }
    }
    rows.push_back({"`" + p.policies[i].label + "`", kKind[kind[i]], fmt_num("%.3f", kept[i]),
                    fmt_num("%.1f%%", 100 * share[i]), fmt_pm(100 * score[i], 100 * se[i], 1), diff,
                    v});
    jm.push_back({{"label", p.policies[i].label},
                  {"kind", kKind[kind[i]]},
                  {"kept", kept[i]},
                  {"share", share[i]},
                  {"score", score[i]},
                  {"score_se", se[i]},
                  {"best_minus_this", d.mean},
                  {"best_minus_this_se", d.se},
                  {"verdict", v}});
  }
  md += md_table({"method", "kind", "kept", "KV bytes (% of F16 full)", "score % ± SE",
                  "best combination − method, pts", "verdict"},
                 rows) +
        "\n";
  if (best < n) {
    md += "Best combination: `" + p.policies[best].label + "`; better than " +
          std::to_string(beaten) + " of " + std::to_string(singles) +
          " single methods within its bytes beyond two standard errors.\n\n";
  }
  j["bytes"] = {{"best_combination", best < n ? p.policies[best].label : ""},
                {"singles", singles},
                {"singles_beaten", beaten},
                {"better_than_every_single", best < n && singles > 0 && beaten == singles},
                {"methods", jm}};
  LineChart chart;
  chart.title = "RULER score against KV bytes (" + p.compression + ")";
  chart.x_label = "KV bytes kept, % of a full F16 cache";
  chart.y_label = "score, % (all tasks)";
  for (size_t i = 0; i < n; ++i) {
    LineSeries s;
    s.name = p.policies[i].label;
    s.x = {100 * share[i]};
    s.y = {100 * score[i]};
    chart.series.push_back(s);
  }
  chart.height = std::max(420, 120 + 18 * static_cast<int>(n));
  chart.width = 860;
  const std::string svg = files.name + "_bytes.svg";
  D2O_RETURN_IF_ERROR(write_file(files.dir + "/" + svg, render_line_chart(chart)));
  md += "![RULER score against KV bytes](" + svg + ")\n\n";
  return md;
}

}  // namespace d2o::eval
