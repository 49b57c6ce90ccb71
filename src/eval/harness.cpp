#include "eval/harness.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace d2o::eval {

Result<PolicyUnderTest> make_policy(const std::string& spec, const std::string& label) {
  auto p = parse_kv_policy(spec);
  if (!p.ok()) return p.status().with_context("policy '" + spec + "'");
  PolicyUnderTest t;
  t.policy = std::shared_ptr<const KvPolicy>(std::move(p).value());
  t.spec = t.policy->spec();
  t.label = label.empty() ? spec : label;
  return t;
}

std::string spec_preset(const std::string& spec) {
  const size_t c = spec.find(':');
  std::string name = c == std::string::npos ? spec : spec.substr(0, c);
  while (!name.empty() && name.back() == ' ') name.pop_back();
  while (!name.empty() && name.front() == ' ') name.erase(0, 1);
  return name;
}

bool spec_has_compression(const std::string& spec) {
  const size_t c = spec.find(':');
  if (c == std::string::npos) return false;
  for (const std::string& item : split_list(spec.substr(c + 1), ',')) {
    const std::string key = item.substr(0, item.find('='));
    std::string k = key;
    while (!k.empty() && k.back() == ' ') k.pop_back();
    if (k == "ratio" || k == "budget") return true;
  }
  return false;
}

Result<std::string> spec_with_compression(const std::string& base, const std::string& key_value) {
  if (spec_preset(base) == "full")
    return invalid_argument("'full' takes no compression (it keeps every token)");
  if (spec_has_compression(base)) {
    return invalid_argument(
        "policy '" + base +
        "' sets ratio= or budget= itself; this protocol sets the compression (" +
        key_value.substr(0, key_value.find('=')) +
        ") for every policy: give the policy without it");
  }
  return base.find(':') == std::string::npos ? base + ":" + key_value : base + "," + key_value;
}

std::vector<std::string> split_list(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string item;
  std::stringstream ss(s);
  while (std::getline(ss, item, sep)) {
    const size_t b = item.find_first_not_of(" \t\n");
    if (b == std::string::npos) continue;
    const size_t e = item.find_last_not_of(" \t\n");
    out.push_back(item.substr(b, e - b + 1));
  }
  return out;
}

Result<std::string> read_text_file(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec))
    return not_found("text file '" + path + "' does not exist");
  if (std::filesystem::is_directory(path, ec))
    return invalid_argument("'" + path + "' is a directory, not a text file");
  std::ifstream in(path, std::ios::binary);
  if (!in) return io_error("cannot read text file '" + path + "'");
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  if (text.empty()) return invalid_argument("text file '" + path + "' is empty");
  return text;
}

std::string fnv1a64_hex(std::string_view bytes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

nlohmann::json timings_json(const EngineTimings& t) {
  return nlohmann::json{{"matmul", t.matmul_s},
                        {"attention", t.attention_s},
                        {"policy", t.policy_s},
                        {"other", t.other_s}};
}

nlohmann::json to_json(const RunMeta& m) {
  return nlohmann::json{{"command", m.command},
                        {"model",
                         {{"path", m.model_path},
                          {"name", m.model_name},
                          {"n_layer", m.n_layer},
                          {"n_head", m.n_head},
                          {"n_head_kv", m.n_head_kv},
                          {"head_dim", m.head_dim},
                          {"n_ctx_train", m.n_ctx_train}}},
                        {"text",
                         {{"path", m.text_path},
                          {"name", m.text_name},
                          {"bytes", m.text_bytes},
                          {"fnv1a64", m.text_hash},
                          {"tokens", m.text_tokens}}},
                        {"kv_type", m.kv_type},
                        {"threads", m.threads},
                        {"kernels", m.kernels},
                        {"seed", m.seed},
                        {"quick", m.quick},
                        {"wall_seconds", m.wall_seconds}};
}

RunMeta meta_from_json(const nlohmann::json& j) {
  RunMeta m;
  m.command = j.value("command", "");
  const auto& mo = j.at("model");
  m.model_path = mo.value("path", "");
  m.model_name = mo.value("name", "");
  m.n_layer = mo.value("n_layer", 0);
  m.n_head = mo.value("n_head", 0);
  m.n_head_kv = mo.value("n_head_kv", 0);
  m.head_dim = mo.value("head_dim", 0);
  m.n_ctx_train = mo.value("n_ctx_train", 0);
  const auto& t = j.at("text");
  m.text_path = t.value("path", "");
  m.text_name = t.value("name", "");
  m.text_bytes = t.value("bytes", size_t{0});
  m.text_hash = t.value("fnv1a64", "");
  m.text_tokens = t.value("tokens", int64_t{0});
  m.kv_type = j.value("kv_type", "");
  m.threads = j.value("threads", 0);
  m.kernels = j.value("kernels", "");
  m.seed = j.value("seed", uint64_t{0});
  m.quick = j.value("quick", false);
  m.wall_seconds = j.value("wall_seconds", 0.0);
  return m;
}

std::string ReportFiles::path(const std::string& suffix) const {
  return dir + "/" + name + suffix;
}

Status ensure_dir(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec || !std::filesystem::is_directory(dir, ec)) {
    return io_error("cannot create the output directory '" + dir + "'" +
                    (ec ? ": " + ec.message() : ""));
  }
  return {};
}

Status write_file(const std::string& path, const std::string& content) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return io_error("cannot write '" + path + "'");
    out.write(content.data(), static_cast<std::streamsize>(content.size()));
    if (!out) return io_error("writing '" + path + "' failed");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) return io_error("cannot write '" + path + "': " + ec.message());
  return {};
}

std::string md_table(const std::vector<std::string>& header,
                     const std::vector<std::vector<std::string>>& rows) {
  auto line = [](const std::vector<std::string>& cells) {
    std::string s = "|";
    for (const std::string& c : cells) s += " " + c + " |";
    return s + "\n";
  };
  std::string o = line(header);
  o += "|";
  for (size_t i = 0; i < header.size(); ++i) o += i == 0 ? "---|" : "---:|";
  o += "\n";
  for (const auto& r : rows) o += line(r);
  return o;
}

std::string fmt_num(const char* format, double v) {
  if (std::isnan(v)) return "-";
  char buf[64];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

std::string fmt_pm(double v, double se, int decimals) {
  char f[32];
  std::snprintf(f, sizeof f, "%%.%df ± %%.%df", decimals, decimals);
  char buf[96];
  std::snprintf(buf, sizeof buf, f, v, se);
  return buf;
}

TokenId argmax(const float* logits, int n) {
  return static_cast<TokenId>(std::max_element(logits, logits + n) - logits);
}

}  // namespace d2o::eval
