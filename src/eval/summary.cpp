#include "eval/summary.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "eval/harness.h"
#include "eval/progress.h"
#include "eval/stats.h"

namespace d2o::eval {

namespace {

using nlohmann::json;

Result<json> load_json(const std::string& path) {
  auto text = read_text_file(path);
  if (!text.ok()) return text.status();
  json j = json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return format_error("'" + path + "' is not valid JSON");
  return j;
}

// The report's Markdown with headings one level deeper and image links under the prefix.
std::string embed(const std::string& md, const std::string& prefix) {
  std::string out;
  size_t i = 0;
  while (i < md.size()) {
    size_t e = md.find('\n', i);
    if (e == std::string::npos) e = md.size();
    std::string line = md.substr(i, e - i);
    if (!line.empty() && line[0] == '#') line = "#" + line;
    size_t at = 0;
    while ((at = line.find("](", at)) != std::string::npos) {
      const size_t close = line.find(')', at);
      const std::string target =
          close == std::string::npos ? "" : line.substr(at + 2, close - at - 2);
      if (target.size() > 4 && target.substr(target.size() - 4) == ".svg" &&
          target.find('/') == std::string::npos) {
        line.insert(at + 2, prefix);
        at += prefix.size();
      }
      at += 2;
    }
    out += line + "\n";
    i = e + 1;
  }
  return out;
}

std::string pm(double v, double se, int dec) {
  return fmt_pm(v, se, dec);
}

bool is_d2o_default(const std::string& spec) {
  return spec_preset(spec) == "d2o";
}

// A report recorded while d2o's defaults were the paper's: a canonical d2o spec in it reads as
// another policy today (paper_era_d2o_spec).
bool paper_defaults_report(const json& j) {
  if (j.is_object() || j.is_array()) {
    for (const json& x : j) {
      if (paper_defaults_report(x)) return true;
    }
    return false;
  }
  if (!j.is_string()) return false;
  const std::string& s = j.get_ref<const std::string&>();
  return s.find(",sinks=") != std::string::npos && !paper_era_d2o_spec(s).empty();
}

const char* const kPaperDefaultsNote =
    "*Recorded while `d2o`'s defaults were the paper's: here a `d2o` label or spec is the "
    "paper's reading with the keys shown. Today `d2o:reading=paper,` followed by those keys "
    "runs it (`d2o` alone is today's default, the best D2O found).*\n\n";

// `note` after the report's first line (its title) and the blank line that follows it.
std::string insert_after_title(const std::string& md, const std::string& note) {
  const size_t eol = md.find('\n');
  if (eol == std::string::npos) return md + "\n\n" + note;
  size_t at = eol + 1;
  if (at < md.size() && md[at] == '\n') ++at;
  return md.substr(0, at) + note + md.substr(at);
}

// The row the verdicts are about: `d2o` where a report has it, else `d2o:reading=paper` (the
// paper's D2O, which reports recorded while d2o's defaults were the paper's label `d2o`).
std::string d2o_row(const std::vector<std::string>& labels) {
  std::string found;
  for (const std::string& l : labels) {
    if (l == "d2o") return l;
    if (l == "d2o:reading=paper") found = l;
  }
  return found;
}

template <typename Get>
std::string d2o_row_of(const json& items, Get get) {
  std::vector<std::string> labels;
  for (const json& x : items) labels.push_back(get(x));
  return d2o_row(labels);
}

// The reports a results directory may hold, in page order: the fixed protocols, with the other
// RULER runs after `ruler`: first those at other lengths (ruler_*.json, e.g. ruler_4k), then the
// equal-bytes ones (ruler_bytes*.json, one per bytes value), each group in name order.
std::vector<std::string> report_names(const std::string& dir) {
  namespace fs = std::filesystem;
  std::vector<std::string> length_runs, bytes_runs;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const fs::path& f = it->path();
    const std::string stem = f.stem().string();
    if (f.extension() != ".json") continue;
    if (stem.rfind("ruler_bytes", 0) == 0)
      bytes_runs.push_back(stem);
    else if (stem.rfind("ruler_", 0) == 0)
      length_runs.push_back(stem);
  }
  std::sort(length_runs.begin(), length_runs.end());
  std::sort(bytes_runs.begin(), bytes_runs.end());
  std::vector<std::string> names = {"ppl",  "fidelity",  "fidelity_bytes",
                                    "niah", "niah_long", "ruler"};
  names.insert(names.end(), length_runs.begin(), length_runs.end());
  names.insert(names.end(), bytes_runs.begin(), bytes_runs.end());
  names.push_back("ablate");
  return names;
}

}  // namespace

Result<std::string> build_results_markdown(const SummaryOptions& o) {
  namespace fs = std::filesystem;
  std::map<std::string, json> rep;
  std::map<std::string, std::string> mds;
  const std::vector<std::string> names = report_names(o.dir);
  for (const std::string& name : names) {
    const std::string base = o.dir + "/" + name;
    std::error_code ec;
    if (!fs::exists(base + ".json", ec)) continue;
    D2O_ASSIGN_OR_RETURN(json j, load_json(base + ".json"));
    rep[name] = std::move(j);
    auto md = read_text_file(base + ".md");
    mds[name] = md.ok() ? *md : std::string();
  }
  if (rep.empty())
    return not_found(
        "no eval reports (ppl.json, fidelity.json, fidelity_bytes.json, niah.json, ruler.json, "
        "ablate.json) in '" +
        o.dir + "'");

  std::string md = "# " + o.title + "\n\n";
  md +=
      "Generated by `scripts/make_results.sh` (`d2o eval ppl|fidelity|niah|ruler|ablate`, then "
      "`d2o eval "
      "summary`). "
      "Every figure is a mean with its standard error or a 95% interval (each section says which); "
      "a difference "
      "counts as a win or a loss only beyond two standard errors of the paired difference, "
      "otherwise it is a "
      "tie.\n\n";
  // Run facts.
  std::vector<std::vector<std::string>> facts;
  double total = 0;
  for (const auto& [name, j] : rep) {
    const RunMeta m = meta_from_json(j.at("meta"));
    total += m.wall_seconds;
    facts.push_back({name, "`" + m.model_name + "`", m.text_name, m.kv_type,
                     std::to_string(m.threads), m.kernels.empty() ? "-" : m.kernels,
                     std::to_string(m.seed), format_duration(m.wall_seconds),
                     "`" + m.command + "`"});
  }
  md += md_table(
      {"report", "model", "text", "KV", "threads", "kernels", "seed", "wall time", "command"},
      facts);
  md += "\nKernels: the SIMD level of the run (`avx512`, `avx2`, `scalar`; `-`: not recorded). "
        "A figure is reproduced bit for bit by the same commit, kernel level and threads; "
        "`D2O_MAX_ISA=avx2` runs the AVX2 kernels on an AVX-512 machine.\n";
  md += "\nTotal wall time " + format_duration(total) + ".\n\n";

  // ---- Verdicts ----------------------------------------------------------------------------
  md += "## Where D2O wins, ties or loses\n\n";
  md +=
      "Paired differences, signed so that a positive number favours D2O; ± one standard error.\n\n";
  std::vector<std::vector<std::string>> rows;
  if (rep.count("ppl")) {
    const json cmps = rep["ppl"].value("comparisons", json::array());
    const std::string row =
        d2o_row_of(cmps, [](const json& c) { return c.value("a", std::string()); });
    for (const json& c : cmps) {
      // The D2O row (d2o_row); its variants are rows of the tables, not this verdict.
      if (row.empty() || c.value("a", std::string()) != row) continue;
      const double d = c["delta_nll"], se = c["se"];
      rows.push_back({"ppl, capacity " + std::to_string(c["capacity"].get<int>()),
                      c["b"].get<std::string>(), "tail NLL (nats), D2O − other = " + pm(d, se, 4),
                      paired_verdict(-d, se, c.value("n", int64_t{0}))});
    }
  }
  if (rep.count("fidelity")) {
    const json& cases = rep["fidelity"]["cases"];
    const std::string row = d2o_row_of(cases, [](const json& c) { return c.value("row", ""); });
    for (const json& a : cases) {
      if (!is_d2o_default(a["spec"]) || row.empty() || a["row"] != row) continue;
      for (const json& b : cases) {
        if (b["column"] != a["column"] || b["row"] == a["row"] || b["row"] == "full") continue;
        std::vector<double> dk, dt;
        const auto& ka = a["per_sample"]["kl"];
        const auto& kb = b["per_sample"]["kl"];
        const auto& ta = a["per_sample"]["top1"];
        const auto& tb = b["per_sample"]["top1"];
        for (size_t s = 0; s < ka.size() && s < kb.size(); ++s) {
          dk.push_back(ka[s].get<double>() - kb[s].get<double>());
          dt.push_back(ta[s].get<double>() - tb[s].get<double>());
        }
        const MeanSe k = mean_se(dk), t = mean_se(dt);
        rows.push_back({"fidelity, ρ = " + a["column"].get<std::string>(),
                        b["row"].get<std::string>(),
                        "KL, D2O − other = " + pm(k.mean, k.se, 4) +
                            "; top-1, D2O − other = " + pm(100 * t.mean, 100 * t.se, 1) + " pts",
                        paired_verdict(-k.mean, k.se, k.n)});
      }
    }
  }
  // niah: the main run; niah_long: a second run at longer contexts (e.g. 16K and 32K).
  for (const char* niah_name : {"niah", "niah_long"}) {
    if (!rep.count(niah_name)) continue;
    const json& n = rep[niah_name];
    std::string lens;
    for (const json& l : n["params"].value("lengths", json::array())) {
      const int v = l.get<int>();
      lens += (lens.empty() ? " at " : "/") +
              (v % 1024 == 0 ? std::to_string(v / 1024) + "K" : std::to_string(v));
    }
    const json& pols = n["policies"];
    int d2o = -1;
    const std::string row = d2o_row_of(pols, [](const json& p) { return p.value("label", ""); });
    for (size_t i = 0; i < pols.size(); ++i) {
      if (!row.empty() && pols[i]["label"] == row) d2o = static_cast<int>(i);
    }
    if (d2o >= 0) {
      for (const json& task : n["params"]["tasks"]) {
        for (size_t b = 0; b < pols.size(); ++b) {
          if (static_cast<int>(b) == d2o || pols[b]["label"] == "full") continue;
          std::vector<double> d;
          for (const json& t : n["trials"]) {
            if (t["task"] != task) continue;
            d.push_back(t["correct"][static_cast<size_t>(d2o)].get<double>() -
                        t["correct"][b].get<double>());
          }
          const MeanSe m = mean_se(d);
          rows.push_back({"niah " + task.get<std::string>() + ", " +
                              n["params"]["compression"].get<std::string>() + lens,
                          pols[b]["label"].get<std::string>(),
                          "accuracy, D2O − other = " + pm(100 * m.mean, 100 * m.se, 1) + " pts (" +
                              std::to_string(m.n) + " paired trials)",
                          paired_verdict(m.mean, m.se, m.n)});
        }
      }
    }
  }
  if (rep.count("ruler")) {
    // Each task pooled over lengths, and all tasks; the full cache is the reference, not a rival.
    const json& r = rep["ruler"];
    const std::string comp = r["params"].value("compression", std::string());
    for (const json& c : r.value("comparisons", json::array())) {
      if (c.value("length", -1) != 0 || c["vs"] == "full") continue;
      const std::string task = c["task"];
      const double d = c["difference"].is_number() ? c["difference"].get<double>() : std::nan("");
      const double se = c["se"].is_number() ? c["se"].get<double>() : 0.0;
      rows.push_back(
          {(task == "all" ? std::string("ruler, all tasks") : "ruler " + task) + ", " + comp,
           c["vs"].get<std::string>(),
           "score, D2O − other = " + pm(100 * d, 100 * se, 1) + " pts (" +
               std::to_string(c.value("trials", 0)) + " paired trials)",
           c.value("verdict", paired_verdict(d, se, c.value("trials", int64_t{0})))});
    }
  }
  md += md_table({"experiment", "vs", "paired difference", "D2O"}, rows) + "\n";

  // ---- The paper's claims ------------------------------------------------------------------
  md += "## Direction of each result against the paper's claim\n\n";
  std::vector<std::vector<std::string>> claims;
  if (rep.count("ppl")) {
    // Rank of D2O by tail NLL among the compressed policies, per capacity.
    std::map<int, std::vector<std::pair<double, std::string>>> by_cap;
    for (const json& r : rep["ppl"]["runs"]) {
      if (r["capacity"].get<int>() > 0)
        by_cap[r["capacity"]].push_back({r["tail_nll"], r["label"]});
    }
    for (auto& [cap, v] : by_cap) {
      std::sort(v.begin(), v.end());
      std::vector<std::string> labels;
      for (const auto& e : v) labels.push_back(e.second);
      const std::string row = d2o_row(labels);
      int rank = 0;
      for (size_t i = 0; i < v.size(); ++i) {
        if (!row.empty() && v[i].second == row) rank = static_cast<int>(i) + 1;
      }
      int wins = 0, losses = 0, n = 0;
      for (const json& c : rep["ppl"]["comparisons"]) {
        if (c["capacity"] != cap) continue;
        ++n;
        const double d = c["delta_nll"], se = c["se"];
        wins += se > 0 && -d > 2 * se;
        losses += se > 0 && d > 2 * se;
      }
      claims.push_back(
          {"PG-19 perplexity, cache of 2048: D2O lowest among compressed methods",
           "capacity " + std::to_string(cap) + ": D2O ranks " + std::to_string(rank) + " of " +
               std::to_string(v.size()) + " by tail NLL (best: " + v[0].second +
               "); resolved wins " + std::to_string(wins) + ", losses " + std::to_string(losses) +
               " of " + std::to_string(n),
           rank == 1 ? (losses == 0 ? "agrees" : "mixed")
                     : (losses > 0 ? "disagrees" : "disagrees in rank, not resolved")});
    }
  }
  if (rep.count("fidelity")) {
    for (const std::string& col : {std::string("0.2")}) {
      int wins = 0, losses = 0, n = 0;
      std::string detail;
      for (const auto& row : rows) {
        if (row[0] != "fidelity, ρ = " + col) continue;
        if (row[1] != "streaming" && row[1] != "h2o" && row[1] != "roco" && row[1] != "cam")
          continue;
        ++n;
        wins += row[3].starts_with("**wins**");
        losses += row[3].starts_with("**loses**");
        detail += (detail.empty() ? "" : "; ") + row[1] + ": " + row[3];
      }
      if (n == 0) continue;
      claims.push_back(
          {"LongBench at ρ = 0.2: D2O beats StreamingLLM, H2O, RoCo and CaM (our proxy: fidelity "
           "KL at "
           "ρ = 0.2)",
           detail, wins == n ? "agrees" : (losses > 0 ? "disagrees" : "not resolved")});
    }
  }
  if (rep.count("niah")) {
    const json& n = rep["niah"];
    std::map<std::string, std::pair<double, std::string>> acc;  // "task/policy"
    for (const json& s : n["summary"]) {
      const std::string key = s["task"].get<std::string>() + "/" + s["policy"].get<std::string>();
      acc[key] = {s["accuracy"].get<double>(),
                  fmt_num("%.0f%%", 100 * s["accuracy"].get<double>()) + " [" +
                      fmt_num("%.0f", 100 * s["ci95"][0].get<double>()) + "–" +
                      fmt_num("%.0f%%", 100 * s["ci95"][1].get<double>()) + "]"};
    }
    const std::string row =
        d2o_row_of(n["summary"], [](const json& x) { return x.value("policy", ""); });
    for (const json& task : n["params"]["tasks"]) {
      const std::string t = task;
      if (row.empty() || !acc.count(t + "/" + row) || !acc.count(t + "/h2o") ||
          !acc.count(t + "/streaming"))
        continue;
      const double d = acc[t + "/" + row].first, h = acc[t + "/h2o"].first,
                   s = acc[t + "/streaming"].first;
      claims.push_back(
          {"Needle in a haystack: D2O 94.5% > H2O 82.3% > StreamingLLM 62.8%",
           t + ": D2O " + acc[t + "/" + row].second + ", H2O " + acc[t + "/h2o"].second +
               ", StreamingLLM " + acc[t + "/streaming"].second + " (95% Wilson)",
           (d > h && h > s)     ? "agrees (order)"
           : (d >= h && d >= s) ? "partly"
                                : "disagrees in order (see the paired differences above)"});
    }
  }
  if (rep.count("ablate")) {
    for (const json& v : rep["ablate"].value("verdicts", json::array())) {
      const std::string verdict_s = v["verdict"];
      claims.push_back({"Ablation (" + v["group"].get<std::string>() + "): " +
                            v["better"].get<std::string>() + " > " + v["worse"].get<std::string>(),
                        "KL difference " + pm(v["kl_difference"], v["se"], 4),
                        verdict_s == "supported"      ? "agrees"
                        : verdict_s == "contradicted" ? "disagrees"
                                                      : "not resolved"});
    }
  }
  md += md_table({"paper's claim", "this run", "direction"}, claims) + "\n";
  const bool fid_bytes = rep.count("fidelity_bytes") && rep["fidelity_bytes"].contains("bytes");
  std::vector<std::string> ruler_bytes;  // RULER reports at equal bytes
  for (const std::string& name : names) {
    if (name.rfind("ruler", 0) == 0 && rep.count(name) && rep[name].contains("bytes"))
      ruler_bytes.push_back(name);
  }
  if (fid_bytes || !ruler_bytes.empty()) {
    // Equal KV bytes: is the best combination of eviction and quantization better than every
    // single method (eviction alone, quantization alone)?
    md += "## At equal KV bytes: eviction and quantization together\n\n";
    std::vector<std::vector<std::string>> eq;
    auto row = [&](const std::string& what, const json& v) {
      const int singles = v.value("singles", 0), beaten = v.value("singles_beaten", 0);
      eq.push_back({what, "`" + v.value("best_combination", std::string()) + "`",
                    std::to_string(beaten) + " of " + std::to_string(singles),
                    v.value("better_than_every_single", false) ? "**yes**" : "no"});
    };
    if (fid_bytes) {
      for (const json& v : rep["fidelity_bytes"]["bytes"].value("values", json::array()))
        row("fidelity (KL), " + fmt_num("%.0f%%", 100 * v.value("share", 0.0)), v);
    }
    for (const std::string& name : ruler_bytes) {
      row("ruler (score), " + rep[name]["params"].value("compression", std::string()),
          rep[name]["bytes"]);
    }
    md += md_table({"protocol, KV bytes (share of the F16 full cache)", "best combination",
                    "single methods it beats beyond 2 SE", "better than every single method"},
                   eq) +
          "\n";
  }
  if (!o.notes.empty()) md += o.notes + "\n";

  // ---- The reports ---------------------------------------------------------------------------
  for (const std::string& name : names) {
    if (!mds.count(name) || mds[name].empty()) continue;
    std::string report = embed(mds[name], o.image_prefix);
    if (paper_defaults_report(rep[name])) report = insert_after_title(report, kPaperDefaultsNote);
    md += report + "\n";
  }
  return md;
}

}  // namespace d2o::eval
