// `d2o eval`: options and set-up shared by its sub-subcommands (ppl, fidelity, niah, ruler,
// ablate).
// The protocols themselves live in src/eval/; these files only parse flags, load the model and
// the text, and hand over.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "commands.h"
#include "common.h"
#include "eval/fidelity.h"
#include "eval/harness.h"
#include "eval/progress.h"

namespace d2o::cli {

struct EvalCommonOptions {
  ModelOptions model;
  std::string text;  // -f: the text file ("" = the protocol's default)
  std::string out_dir = "eval-results";
  std::string name;      // report file stem ("" = the protocol name)
  std::string policies;  // ';'-separated specs ("" = the protocol's default list)
  uint64_t seed = 1;
  bool quick = false;
  bool quiet = false;  // no progress bar
};

// Registers -m -t --ubatch --kv-type --dequantize -f -o --name --policies --seed --quick --quiet.
void add_eval_common_options(CLI::App* app, EvalCommonOptions& o, const std::string& text_help);

// The teacher-forced protocols (fidelity, ablate): P-token prompts from S text windows, then C
// teacher-forced tokens; --skip drops the text's first tokens.
struct TeacherForcedOptions {
  int prompt = 2048;
  int samples = 8;
  int cont = 128;
  int64_t skip = 0;
};
// Registers --question (before | after, src/eval/turns.h) and --questions (1..kMaxQuestions;
// `questions_help` says what the protocol asks several times).
void add_question_options(CLI::App* app, std::string& question, int& questions,
                          const std::string& questions_help);

// How each context is prefilled and how much KV memory a sequence has (`eval ruler`, `eval niah`;
// `eval fidelity` takes --chunk and has its own --kv-mem-per-seq, BytesAxisOptions).
struct PrefillOptions {
  std::string kv_mem_per_seq;  // "": not given
  int chunk = -1;              // -1: not given
};
// Registers --kv-mem-per-seq and --chunk (with_mem false: --chunk only).
void add_prefill_options(CLI::App* app, PrefillOptions& o, bool with_mem);
// The prompt tokens per prefill pass: --chunk as given, else 512 with --kv-mem-per-seq (as `run`
// feeds a prompt), else 0 (one pass shared by every policy, the protocols' default).
int prefill_chunk_of(const PrefillOptions& o);
// " --kv-mem-per-seq M --chunk N" as given, for the recorded command line.
std::string prefill_args(const PrefillOptions& o);
// The policies to evaluate: each base spec with `compression` ("ratio=0.2", "budget=512") added,
// or with --kv-mem-per-seq the budget of the slots that fit it in `type` (spec_for_kv_mem); the
// full cache, and with `compression` specs that set their own ratio= or budget=, as given.
Result<std::vector<eval::PolicyUnderTest>> policies_with_compression(
    const std::vector<std::string>& bases, const std::string& compression,
    const PrefillOptions& o, const ModelHParams& hp, KvType type);

// Registers --prompt --samples --continue --skip.
void add_teacher_forced_options(CLI::App* app, TeacherForcedOptions& o,
                                const std::string& samples_help);
// --quick: at most 256 prompt tokens, 2 samples, 16 continuation tokens.
void shrink_for_quick(TeacherForcedOptions& o);
// " --prompt P --samples S --continue C [--skip K]", for the recorded command line.
std::string teacher_forced_args(const TeacherForcedOptions& o);

// The text's tokens after the first `skip` (an error names --skip when it is out of range).
Result<std::span<const TokenId>> tokens_after_skip(const std::vector<TokenId>& tokens,
                                                   int64_t skip);

// $D2O_CACHE_DIR, else the build's default cache folder (default_text_path: commands.h).
std::string default_cache_dir();

// Model and text loaded, metadata filled.
struct EvalSetup {
  Loaded loaded;
  eval::RunMeta meta;
  std::string text;             // the raw text (empty for protocols that build their own)
  std::vector<TokenId> tokens;  // the text tokenized (add_special as the model says)
};

// Loads the model and, when text_path is not empty, reads and tokenizes the text. `command`
// is recorded in the report.
Result<EvalSetup> eval_setup(const EvalCommonOptions& o, const std::string& text_path,
                             const std::string& command);

// The policies to run: o.policies split on ';', or the defaults.
std::vector<std::string> eval_policies(const EvalCommonOptions& o,
                                       const std::vector<std::string>& defaults);

// Comma-separated numbers ("256,1024", "0.2,0.4"); errors name the option.
Result<std::vector<int>> parse_int_list(const std::string& s, const std::string& option);
Result<std::vector<double>> parse_double_list(const std::string& s, const std::string& option);

// A progress bar on stderr (or none with --quiet).
std::unique_ptr<eval::Progress> make_progress(const EvalCommonOptions& o, const std::string& label,
                                              double total);

// Prints where the report went.
void print_report_paths(const eval::ReportFiles& f);

// The eight policies of the paper's comparison, in the order the reports use.
const std::vector<std::string>& all_policy_presets();

// "0.2" for 0.2 (shortest round-trip text of a ratio).
std::string ratio_label(double r);
// Fidelity cases: every base policy at every ratio (row = the policy, column = the ratio); the
// full cache and specs that set their own ratio/budget run once, as given (column "-").
Result<std::vector<eval::FidelityCase>> fidelity_cases(const std::vector<std::string>& policies,
                                                       const std::vector<double>& ratios);

// The haystack of niah and ruler: -f (a file, or a directory of .txt files joined in name
// order), else the Paul Graham essays fetched by setup, else the KJV text (`note` says so).
// --bytes / --kv-types / --kv-mem-per-seq (`eval fidelity`; cmd_eval_bytes.cpp).
struct BytesAxisOptions {
  std::string bytes;           // shares of the F16 full cache's bytes ("": not on the bytes axis)
  std::string kv_types;        // storage types each policy runs in ("": --kv-type)
  std::string kv_mem_per_seq;  // one KV memory per sequence ("": not given)
};
void add_bytes_axis_options(CLI::App* app, BytesAxisOptions& o);
bool bytes_axis_given(const BytesAxisOptions& o);
std::string bytes_axis_args(const BytesAxisOptions& o);  // for the recorded command line
// "f16,q8_0,k:q8_0,v:q4_0" -> types (duplicates dropped).
Result<std::vector<KvType>> parse_kv_type_list(const std::string& s);
// "POLICY@TYPE" runs in TYPE only: returns POLICY and sets `types` to {TYPE} (checked against the
// head size); a spec without '@' is returned as is, `types` unchanged.
Result<std::string> split_policy_type(const std::string& given, int head_dim,
                                      std::vector<KvType>& types);

// Every (policy, storage type) at every bytes value: a budgeted case per bytes value, or for
// `full` one case in that type (row "POLICY [TYPE]", column the bytes value or "-"). The budget
// is the largest that fits for a prompt of prompt_len tokens (eval/kv_bytes.h).
Result<std::vector<eval::FidelityCase>> fidelity_bytes_cases(
    const std::vector<std::string>& policies, const BytesAxisOptions& o, const ModelHParams& hp,
    KvType run_type, int64_t prompt_len);

struct HaystackChoice {
  std::string path, name, note, text;
};
Result<HaystackChoice> load_haystack(const std::string& given);
// Records the haystack in a report's metadata (path, name, size, hash) and prints its note.
void note_haystack(const HaystackChoice& hay, eval::RunMeta& meta);

// Sub-subcommands (cmd_eval.cpp: ppl, fidelity; cmd_eval_niah.cpp; cmd_eval_ruler.cpp;
// cmd_eval_ablate.cpp; cmd_eval_summary.cpp).
Action add_eval_ppl(CLI::App* eval);
Action add_eval_fidelity(CLI::App* eval);
Action add_eval_niah(CLI::App* eval);
Action add_eval_ruler(CLI::App* eval);
Action add_eval_ablate(CLI::App* eval);
Action add_eval_summary(CLI::App* eval);

}  // namespace d2o::cli
