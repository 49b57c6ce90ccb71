// Pieces shared by the evaluation protocols (ppl, fidelity, niah, ablate): the policies under
// test, reading texts, run metadata, and writing a report's files.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "d2o/status.h"
#include "kv/policy.h"
#include "runtime/engine.h"

namespace d2o::eval {

// One policy as the harness runs it: a label for tables and legends, the canonical spec, and
// the parsed policy (shared by every sequence that uses it).
struct PolicyUnderTest {
  std::string label;  // "d2o", "h2o", "d2o heavy_recent=1:1", ...
  std::string spec;   // canonical, from KvPolicy::spec()
  std::shared_ptr<const KvPolicy> policy;
  // Its own KV storage type (equal-bytes comparisons); none: the run's. Used by ruler; fidelity
  // cases carry theirs in FidelityCase.
  std::optional<KvType> kv_type;
};

// Parses `spec` (errors name the spec). label "" = the spec as given.
Result<PolicyUnderTest> make_policy(const std::string& spec, const std::string& label);

// True when the spec sets ratio= or budget= itself.
bool spec_has_compression(const std::string& spec);

// Appends key=value to a base spec ("d2o" -> "d2o:budget=256", "d2o:heavy_recent=1:1" ->
// "d2o:heavy_recent=1:1,budget=256"). Errors when the base spec already sets ratio= or budget= (the
// protocol sets the compression itself) or is "full" (which takes no keys).
Result<std::string> spec_with_compression(const std::string& base, const std::string& key_value);

// The name of a preset ("d2o:ratio=0.2" -> "d2o").
std::string spec_preset(const std::string& spec);

// Splits "a,b;c" style lists: items separated by `sep`, trimmed, empty items dropped. A policy
// list uses ';' (specs contain commas).
std::vector<std::string> split_list(const std::string& s, char sep);

// Reads a whole text file. Errors: missing or unreadable file, empty file (the message names
// the path).
Result<std::string> read_text_file(const std::string& path);

// FNV-1a 64-bit hash of bytes, as 16 hex digits: identifies the exact text a run used.
std::string fnv1a64_hex(std::string_view bytes);

// What every report records about the run (filled by the caller, extended by the protocol).
struct RunMeta {
  std::string command;     // the command line or a description
  std::string model_path;  // the GGUF file
  std::string model_name;  // general.name or the file name
  int n_layer = 0, n_head = 0, n_head_kv = 0, head_dim = 0, n_ctx_train = 0;
  std::string text_path;  // the text (or haystack) used
  std::string text_name;  // "kjv", "paul_graham_essays", ...
  size_t text_bytes = 0;
  std::string text_hash;  // fnv1a64 of the text bytes
  int64_t text_tokens = 0;
  std::string kv_type;
  int threads = 0;
  std::string kernels;  // the SIMD kernel level the run used: "avx512", "avx2" or "scalar"
  uint64_t seed = 0;
  bool quick = false;
  double wall_seconds = 0;  // filled when the run ends
};
nlohmann::json to_json(const RunMeta& m);
// The engine's time split as reports and benchmarks write it: {matmul, attention, policy, other}
// in seconds.
nlohmann::json timings_json(const EngineTimings& t);
RunMeta meta_from_json(const nlohmann::json& j);

// Where a report goes: <dir>/<name>.json, <dir>/<name>.md, <dir>/<name>_*.svg.
struct ReportFiles {
  std::string dir;
  std::string name;
  std::string path(const std::string& suffix) const;  // dir + "/" + name + suffix
};

// Creates the directory (and parents). Errors name the path.
Status ensure_dir(const std::string& dir);
// Writes a file in one go (to a temporary name, then renamed). Errors name the path.
Status write_file(const std::string& path, const std::string& content);

// Markdown helpers.
std::string md_table(const std::vector<std::string>& header,
                     const std::vector<std::vector<std::string>>& rows);
std::string fmt_num(const char* format, double v);
// "0.123 ± 0.004".
std::string fmt_pm(double v, double se, int decimals);

// Greedy choice over logits: the first maximum (the same rule as the sampler at temperature 0).
TokenId argmax(const float* logits, int n);

}  // namespace d2o::eval
