// `d2o eval fidelity` (and `ablate`): how close each policy's next-token distributions stay to
// the full cache's after prompt-then-compress.
//
// Protocol, per sample s (n_samples windows of the text, evenly spaced):
//   1. the prompt (prompt_len tokens) goes through the model in one pass; each policy compacts
//      the cache right after it (ratio mode: rho of the prompt is kept). The pass runs once and
//      is shared by all policies (src/eval/fork.h; exact).
//   2. the true continuation is teacher-forced one token per pass (n_continue passes), so the
//      policy evicts (and merges) at every step, as during generation.
//   3. after every pass, each policy's next-token distribution q is compared with the full
//      cache's p: KL(p || q) in nats, top-1 agreement (argmax q == argmax p), and the NLL of the
//      true next token (policy minus full).
// Only predictions made after the compaction count: the prompt's own last-token prediction is
// computed before any eviction, identical for every policy, and is left out.
// Figures are means over the n_continue steps of a sample; the table reports their mean over
// samples ± the standard error over samples (the samples are independent text windows; steps
// within a sample are not).
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "d2o/status.h"
#include "eval/harness.h"
#include "eval/progress.h"
#include "runtime/engine.h"

namespace d2o::eval {

// One policy at one compression: a cell of the result table.
struct FidelityCase {
  FidelityCase() = default;
  FidelityCase(std::string row_, std::string column_, PolicyUnderTest policy_)
      : row(std::move(row_)), column(std::move(column_)), policy(std::move(policy_)) {}
  std::string row;     // table row: the policy or ablation variant
  std::string column;  // table column: the ratio ("0.2"), or "-" for the full cache
  PolicyUnderTest policy;
  // Equal-bytes comparisons (--bytes): the case's own storage type (none: FidelityParams::kv_type),
  // and the share of the F16 full cache's bytes its budget was sized for (0: not sized by bytes).
  std::optional<KvType> kv_type;
  double share = 0;
  int64_t budget = 0;  // the slots per KV head and layer that share gave
};

struct FidelityParams {
  std::vector<FidelityCase> cases;  // the full-cache reference is added internally
  int prompt_len = 2048;
  int n_samples = 8;
  int n_continue = 128;
  KvType kv_type = KvType::kF16;
  int n_ctx_train = 0;
  // > 0: each prompt is fed to every policy in passes of this many tokens (prefill_in_chunks,
  // src/eval/fork.h), so fixed budgets and prefill=bounded compact between them; 0: one pass
  // shared by the policies.
  int chunk = 0;
  // When >= 0, each window's first token is replaced by this one (the BOS of a tokenizer that
  // adds it): a window cut from the middle of the text then starts as the model's inputs always
  // do. Gemma 3 puts its attention sink on BOS; without it every prompt is out of distribution.
  TokenId bos = -1;
  // Continuations that begin with a new user turn (the question-after setting of
  // src/eval/turns.h), when turn_open is not empty: each window's prompt is a user message
  // (turn_prefix, BOS included, before it; turn_open after it: the user's turn closed and the
  // assistant's opened, where a server session compacts), and each continuation starts with
  // turn_reply (the assistant's acknowledgement, its turn closed, a new user turn opened), then
  // goes on with the text's next tokens as the user's next message. The n_continue steps count
  // the turn_reply tokens; `bos` is not used (turn_prefix starts the prompt).
  std::vector<TokenId> turn_prefix, turn_open, turn_reply;
  // The continuation teacher-forced in one pass, logits at every position, as a server feeds a
  // session's next request (a cold tier recalls for it), instead of one token per pass.
  bool continue_in_one_pass = false;
};

struct FidelityCaseResult {
  // Per sample, means over the n_continue steps.
  std::vector<double> kl, top1, nll, nll_full;
  std::vector<double> kl_by_step;   // [n_continue], mean over samples
  double slots_end = 0;             // slots per KV head and layer at the end (mean over samples)
  double kv_bytes_end = 0;          // key and value bytes held at the end (mean over samples)
  int64_t evicted = 0, merged = 0;  // summed over layers and samples
};

struct FidelityResult {
  std::vector<FidelityCaseResult> cases;  // as params.cases
  std::vector<int64_t> offsets;           // first token of each sample in the text
  int n_prefills = 0;                     // prompt passes per sample (policy groups)
  // Key and value bytes of a full F16 cache holding the context at the end (prompt +
  // continuation), and that context's length: the scale of the bytes axis.
  double f16_full_bytes_end = 0;
  int64_t context_end = 0;
  double seconds = 0;
  EngineTimings timings;
};

// Errors: no cases, sizes < 1, a window (prompt + continuation + 1) longer than the text or the
// model's trained context.
Result<FidelityResult> run_fidelity(Engine& engine, std::span<const TokenId> tokens,
                                    const FidelityParams& p, Progress* progress);

// KL(p || q) for two logit rows (p = softmax(ref), q = softmax(x)), in nats, computed in double.
// `ref_logp` must hold log_softmax(ref) (computed once per step and shared by the cases).
double kl_from_logits(std::span<const double> ref_logp, const float* x);
void log_softmax(const float* logits, int n, std::vector<double>& out);

struct FidelityReportText {
  std::string protocol = "fidelity";   // "fidelity" or "ablate"
  std::string title;                   // Markdown title
  std::string intro;                   // a paragraph under the title
  std::string column_prefix = "ρ = ";  // table headers of the columns (fidelity)
};

// Writes <name>.json, <name>.md (KL, top-1 agreement and ΔNLL tables: rows x columns) and
// <name>_kl_<column>.svg (mean KL against the continuation step, one chart per column).
Status write_fidelity_report(const FidelityResult& r, const FidelityParams& p, const RunMeta& meta,
                             const FidelityReportText& text, const ReportFiles& files);

// The equal-bytes section of a fidelity report (cases with FidelityCase::share > 0 or a full
// cache in a storage type of its own): per bytes value, every method's KL with its paired
// difference to the best combination of eviction and quantization, verdicts of that combination
// against every single method, and <name>_bytes.svg (KL against KV bytes per token of context,
// one line per method). Adds "bytes" to the report's JSON; returns the Markdown ("" when no case
// is on the bytes axis).
Result<std::string> fidelity_bytes_section(const FidelityResult& r, const FidelityParams& p,
                                           const ReportFiles& files, nlohmann::json& j);

// Storage type of case i (its own, else the run's).
KvType case_kv_type(const FidelityParams& p, size_t i);

}  // namespace d2o::eval
