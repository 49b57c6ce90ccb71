// The evaluation harness's statistics, charts and helpers against brute-force references and
// known values: standard errors, batch means, bootstrap, Wilson intervals, KL divergence, SVG
// well-formedness, spec helpers, answer matching.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <set>

#include "common/xml_check.h"
#include "eval/fidelity.h"
#include "eval/harness.h"
#include "eval/niah.h"
#include "eval/stats.h"
#include "eval/svg.h"

namespace d2o::eval {
namespace {

TEST(EvalStats, MeanSeMatchesTextbookFormula) {
  const std::vector<double> x = {2, 4, 4, 4, 5, 5, 7, 9};
  const MeanSe m = mean_se(x);
  EXPECT_DOUBLE_EQ(m.mean, 5.0);
  // Sample variance 32/7; se = sqrt(32/7/8).
  EXPECT_NEAR(m.se, std::sqrt(32.0 / 7.0 / 8.0), 1e-12);
  EXPECT_EQ(mean_se(std::vector<double>{3.0}).se, 0.0);
  EXPECT_EQ(mean_se(std::vector<double>{}).n, 0);
}

TEST(EvalStats, BatchMeansWithBlockOneIsThePlainStandardError) {
  std::mt19937 g(5);
  std::normal_distribution<double> nd(1.0, 2.0);
  std::vector<double> x(1000);
  for (double& v : x) v = nd(g);
  const MeanSe a = mean_se(x), b = batch_means_se(x, 1);
  EXPECT_NEAR(a.mean, b.mean, 1e-12);
  EXPECT_NEAR(a.se, b.se, 1e-12);
}

TEST(EvalStats, BatchMeansMatchesBruteForceOnBlocks) {
  // 10 blocks of 7 plus a remainder of 3 folded into the last block.
  std::vector<double> x(73);
  for (size_t i = 0; i < x.size(); ++i)
    x[i] = std::sin(0.3 * static_cast<double>(i)) + 0.01 * static_cast<double>(i);
  const MeanSe m = batch_means_se(x, 7);
  std::vector<double> means, w;
  for (int b = 0; b < 10; ++b) {
    const int begin = 7 * b, end = b == 9 ? 73 : begin + 7;
    double s = 0;
    for (int i = begin; i < end; ++i) s += x[static_cast<size_t>(i)];
    means.push_back(s / (end - begin));
    w.push_back(end - begin);
  }
  double mean = 0;
  for (double v : x) mean += v;
  mean /= 73;
  double acc = 0;
  for (int b = 0; b < 10; ++b) acc += w[b] * w[b] * (means[b] - mean) * (means[b] - mean);
  EXPECT_NEAR(m.mean, mean, 1e-12);
  EXPECT_NEAR(m.se, std::sqrt(acc / (73.0 * 73.0) * 10.0 / 9.0), 1e-12);
}

TEST(EvalStats, BatchMeansSeesAutocorrelation) {
  // A slowly varying series: the naive standard error understates the uncertainty a lot.
  std::vector<double> x(4096);
  for (size_t i = 0; i < x.size(); ++i) x[i] = (i / 1024) % 2 ? 1.0 : -1.0;
  EXPECT_GT(batch_means_se(x, 512).se, 5 * mean_se(x).se);
}

TEST(EvalStats, WilsonKnownValues) {
  // 8/10 at 95%: [0.4902, 0.9433] (standard tables).
  const Interval a = wilson_interval(8, 10, 1.959964);
  EXPECT_NEAR(a.lo, 0.4902, 1e-4);
  EXPECT_NEAR(a.hi, 0.9433, 1e-4);
  const Interval z = wilson_interval(0, 20, 1.959964);
  EXPECT_EQ(z.lo, 0.0);
  EXPECT_NEAR(z.hi, 0.1611, 1e-4);
  const Interval none = wilson_interval(0, 0, 1.96);
  EXPECT_EQ(none.lo, 0.0);
  EXPECT_EQ(none.hi, 1.0);
}

TEST(EvalStats, BootstrapIsDeterministicAndBracketsTheMean) {
  std::vector<double> x;
  for (int i = 0; i < 50; ++i) x.push_back(static_cast<double>((i * 37) % 11));
  const Interval a = bootstrap_mean_ci(x, 2000, 0.95, 42), b = bootstrap_mean_ci(x, 2000, 0.95, 42);
  EXPECT_EQ(a.lo, b.lo);
  EXPECT_EQ(a.hi, b.hi);
  const double m = mean_se(x).mean, se = mean_se(x).se;
  EXPECT_LT(a.lo, m);
  EXPECT_GT(a.hi, m);
  // Close to the normal interval for a mean of 50 values.
  EXPECT_NEAR(a.hi - a.lo, 2 * 1.96 * se, 0.25 * 2 * 1.96 * se);
  const Interval c = bootstrap_mean_ci(x, 2000, 0.95, 43);
  EXPECT_TRUE(c.lo != a.lo || c.hi != a.hi);
}

TEST(EvalStats, SplitMixBelowIsInRangeAndUsesTheRange) {
  SplitMix64 r(7);
  std::vector<int> hits(10);
  for (int i = 0; i < 10000; ++i) {
    const uint64_t v = r.below(10);
    ASSERT_LT(v, 10u);
    ++hits[v];
  }
  for (int h : hits) EXPECT_GT(h, 800);
}

// Seeds 1-8 over the ruler's cells (6 tasks x 3 lengths x 200 trials): no cell seed shared by
// two runs or two cells, and seed 1 gives the cells of the recorded reports (the run's seed
// XORed into the cell key, then mixed).
TEST(EvalStats, CellSeedsOfDifferentRunsDiffer) {
  std::set<uint64_t> seen;
  size_t n = 0;
  for (uint64_t run = 1; run <= 8; ++run) {
    for (uint64_t task = 1; task <= 6; ++task) {
      for (uint64_t len : {2048u, 4096u, 8192u}) {
        for (uint64_t trial = 0; trial < 200; ++trial) {
          const uint64_t cell = (task << 56) ^ (len << 24) ^ trial;
          const uint64_t s = cell_seed(run, cell);
          seen.insert(s);
          ++n;
          if (run == 1) {
            SplitMix64 old(1u ^ cell);
            ASSERT_EQ(s, old.next());
          }
        }
      }
    }
  }
  EXPECT_EQ(seen.size(), n);
}

TEST(EvalKl, MatchesBruteForceAndIsZeroForIdenticalRows) {
  std::mt19937 g(3);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  const int n = 1000;
  std::vector<float> p(n), q(n);
  for (int i = 0; i < n; ++i) p[i] = nd(g), q[i] = p[i] + 0.3f * nd(g);
  std::vector<double> lp;
  log_softmax(p.data(), n, lp);
  // Brute force in long double.
  long double zp = 0, zq = 0;
  for (int i = 0; i < n; ++i)
    zp += std::exp(static_cast<long double>(p[i])), zq += std::exp(static_cast<long double>(q[i]));
  long double kl = 0;
  for (int i = 0; i < n; ++i) {
    const long double a = std::exp(static_cast<long double>(p[i])) / zp,
                      b = std::exp(static_cast<long double>(q[i])) / zq;
    kl += a * std::log(a / b);
  }
  EXPECT_NEAR(kl_from_logits(lp, q.data()), static_cast<double>(kl), 1e-9);
  EXPECT_EQ(kl_from_logits(lp, p.data()), 0.0);
  // A shift of all logits does not change the distribution (up to rounding of the shift).
  std::vector<float> s(p);
  for (float& v : s) v += 8.0f;
  EXPECT_LT(kl_from_logits(lp, s.data()), 1e-9);
}

TEST(EvalSvg, LineChartIsWellFormedAndEscapesText) {
  LineChart c;
  c.title = "A <title> & \"quotes\"";
  c.x_label = "x";
  c.y_label = "y's";
  LineSeries a;
  a.name = "d2o<1>";
  a.x = {1, 2, 3, 4};
  a.y = {1.0, std::nan(""), 2.0, 3.0};
  a.lo = {0.5, 0.5, 1.5, 2.5};
  a.hi = {1.5, 1.5, 2.5, 3.5};
  LineSeries b;
  b.name = "full";
  b.x = {1, 4};
  b.y = {2, 2};
  b.dashed = true;
  c.series = {a, b};
  const std::string svg = render_line_chart(c);
  EXPECT_EQ(test::xml_problem(svg), "");
  EXPECT_NE(svg.find("A &lt;title&gt; &amp; &quot;quotes&quot;"), std::string::npos);
  EXPECT_NE(svg.find("d2o&lt;1&gt;"), std::string::npos);
  EXPECT_NE(svg.find("stroke-dasharray"), std::string::npos);
  // The NaN breaks the line: two "M" moves in the series path.
  const size_t path = svg.find("<path d=\"M");
  ASSERT_NE(path, std::string::npos);
  const std::string d = svg.substr(path, svg.find('"', path + 9) - path);
  EXPECT_EQ(std::count(d.begin(), d.end(), 'M'), 2) << d;
  EXPECT_EQ(render_line_chart(c), svg);  // same data, same bytes
  // Degenerate inputs still give a valid document.
  LineChart empty;
  EXPECT_EQ(test::xml_problem(render_line_chart(empty)), "");
  LineChart logx = c;
  logx.log_x = true;
  EXPECT_EQ(test::xml_problem(render_line_chart(logx)), "");
}

TEST(EvalSvg, HeatmapIsWellFormedWithOneCellPerValue) {
  Heatmap h;
  h.title = "needle: d2o";
  h.x_ticks = {"1K", "2K", "4K"};
  h.y_ticks = {"0%", "50%"};
  h.values = {1.0, 0.5, 0.0, std::nan(""), 0.25, 1.0};
  const std::string svg = render_heatmap(h);
  EXPECT_EQ(test::xml_problem(svg), "");
  EXPECT_NE(svg.find("#cccccc"), std::string::npos);  // the NaN cell is grey
  EXPECT_NE(svg.find(">0.25<"), std::string::npos);
}

TEST(EvalXmlCheck, CatchesBrokenDocuments) {
  EXPECT_NE(test::xml_problem("<svg><g></svg>"), "");
  EXPECT_NE(test::xml_problem("<svg a=1></svg>"), "");
  EXPECT_NE(test::xml_problem("<svg>a & b</svg>"), "");
  EXPECT_NE(test::xml_problem("<svg></svg><svg></svg>"), "");
  EXPECT_EQ(
      test::xml_problem("<?xml version=\"1.0\"?>\n<svg a=\"1\"><g/><text>a &amp; b</text></svg>\n"),
      "");
}

TEST(EvalHarness, SpecHelpers) {
  EXPECT_EQ(*spec_with_compression("d2o", "budget=256"), "d2o:budget=256");
  EXPECT_EQ(*spec_with_compression("d2o:nm=1:1", "ratio=0.2"), "d2o:nm=1:1,ratio=0.2");
  EXPECT_FALSE(spec_with_compression("d2o:ratio=0.3", "budget=256").ok());
  EXPECT_FALSE(spec_with_compression("h2o: budget = 64", "ratio=0.2").ok());
  EXPECT_FALSE(spec_with_compression("full", "ratio=0.2").ok());
  EXPECT_TRUE(spec_has_compression("snapkv:window=8,budget=64"));
  EXPECT_FALSE(spec_has_compression("snapkv:window=8"));
  EXPECT_EQ(spec_preset(" d2o :beta=0.5"), "d2o");
  EXPECT_EQ(split_list("full; d2o:nm=1:1,beta=0.5 ;;h2o", ';'),
            (std::vector<std::string>{"full", "d2o:nm=1:1,beta=0.5", "h2o"}));
  auto bad = make_policy("d2o:beta=2", "");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("d2o:beta=2"), std::string::npos);
  EXPECT_EQ(fnv1a64_hex(""), "cbf29ce484222325");
  EXPECT_EQ(fnv1a64_hex("a"), "af63dc4c8601ec8c");
}

TEST(EvalHarness, ReadTextFileErrors) {
  EXPECT_EQ(read_text_file("/nonexistent/x.txt").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(read_text_file("/").status().code(), StatusCode::kInvalidArgument);
}

TEST(EvalNiah, AnswerMatchesTheFirstNumberOnly) {
  EXPECT_TRUE(answer_matches(" 71432.", "71432"));
  EXPECT_TRUE(answer_matches("is 71432, remember", "71432"));
  EXPECT_FALSE(answer_matches(" 714321.", "71432"));
  EXPECT_FALSE(answer_matches(" 7143.", "71432"));
  EXPECT_FALSE(answer_matches(" 123 then 71432", "71432"));
  EXPECT_FALSE(answer_matches(" none", "71432"));
}

}  // namespace
TEST(EvalStats, PairedVerdictUsesTheSpreadOrASignTest) {
  EXPECT_EQ(paired_verdict(0.3, 0.1, 8), "**wins**");
  EXPECT_EQ(paired_verdict(-0.3, 0.1, 8), "**loses**");
  EXPECT_EQ(paired_verdict(0.1, 0.1, 8), "ties");
  EXPECT_EQ(paired_verdict(0.0, 0.0, 8), "ties (identical)");
  EXPECT_EQ(paired_verdict(std::nan(""), 0.1, 8), "-");
  // 6/6 retrievals against 0/6: every pair differs by +1, no spread. 2 * 0.5^6 = 0.031.
  std::vector<double> d(6, 1.0);
  const MeanSe m = mean_se(d);
  ASSERT_EQ(m.se, 0.0);
  EXPECT_EQ(paired_verdict(m.mean, m.se, m.n), "**wins** (all 6 pairs, sign test p = 0.031)");
  EXPECT_EQ(paired_verdict(-1.0, 0.0, 6), "**loses** (all 6 pairs, sign test p = 0.031)");
  // Five alike pairs give p = 0.0625: not beyond the two-standard-error level.
  EXPECT_EQ(paired_verdict(1.0, 0.0, 5),
            "not resolved (all 5 pairs differ alike; sign test p = 0.062)");
  EXPECT_EQ(paired_verdict(1.0, 0.0, 1), "not resolved (one pair: no standard error)");
}

// The run facts a report keeps survive the JSON round trip; the kernel level is among them, and a
// report written before it was recorded reads back with an empty level.
TEST(EvalHarness, RunMetaRoundTripsThroughJson) {
  RunMeta m;
  m.command = "d2o eval fidelity";
  m.model_name = "m.gguf";
  m.n_layer = 30;
  m.threads = 2;
  m.kernels = "avx2";
  m.seed = 7;
  m.wall_seconds = 1.5;
  nlohmann::json j = to_json(m);
  const RunMeta back = meta_from_json(j);
  EXPECT_EQ(back.command, m.command);
  EXPECT_EQ(back.n_layer, 30);
  EXPECT_EQ(back.threads, 2);
  EXPECT_EQ(back.kernels, "avx2");
  EXPECT_EQ(back.seed, 7u);
  j.erase("kernels");
  EXPECT_EQ(meta_from_json(j).kernels, "");
}

// The time split every report and benchmark writes: the four parts, in seconds, by name.
TEST(EvalHarness, TimingsJsonNamesEachPart) {
  EngineTimings t;
  t.matmul_s = 1.5;
  t.attention_s = 0.25;
  t.policy_s = 0.125;
  t.other_s = 2.0;
  const nlohmann::json j = timings_json(t);
  ASSERT_EQ(j.size(), 4u);
  EXPECT_EQ(j["matmul"].get<double>(), 1.5);
  EXPECT_EQ(j["attention"].get<double>(), 0.25);
  EXPECT_EQ(j["policy"].get<double>(), 0.125);
  EXPECT_EQ(j["other"].get<double>(), 2.0);
}

}  // namespace d2o::eval
