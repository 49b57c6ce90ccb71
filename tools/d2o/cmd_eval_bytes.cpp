// `d2o eval fidelity --bytes / --kv-types / --kv-mem-per-seq`: policies and storage types
// compared at equal KV bytes (src/eval/kv_bytes.h counts the bytes).
#include <algorithm>

#include "cmd_eval.h"
#include "eval/kv_bytes.h"
#include "model/layer_desc.h"
#include "runtime/kv_pool.h"

namespace d2o::cli {

void add_bytes_axis_options(CLI::App* app, BytesAxisOptions& o) {
  app->add_option("--bytes", o.bytes,
                  "Compare at equal KV bytes instead of --ratios: shares of a full F16 cache's "
                  "key and value bytes for the prompt, e.g. 0.1,0.2,0.4; each policy in each "
                  "--kv-types type gets the largest budget that fits");
  app->add_option("--kv-types", o.kv_types,
                  "With --bytes or --kv-mem-per-seq: storage types each policy runs in, e.g. "
                  "f16,q8_0,q4_0r (k:TYPE,v:TYPE allowed); a policy written POLICY@TYPE runs in "
                  "that type only (default: --kv-type)");
  app->add_option("--kv-mem-per-seq", o.kv_mem_per_seq,
                  "Compare at one KV memory per sequence, e.g. 4M: the budget is the slots whose "
                  "keys, values and slot metadata fit, as in `bench throughput`");
}

bool bytes_axis_given(const BytesAxisOptions& o) {
  return !o.bytes.empty() || !o.kv_mem_per_seq.empty();
}

std::string bytes_axis_args(const BytesAxisOptions& o) {
  std::string s;
  if (!o.bytes.empty()) s += " --bytes " + o.bytes;
  if (!o.kv_mem_per_seq.empty()) s += " --kv-mem-per-seq " + o.kv_mem_per_seq;
  if (!o.kv_types.empty()) s += " --kv-types " + o.kv_types;
  return s;
}

Result<std::vector<KvType>> parse_kv_type_list(const std::string& s) {
  // Items are separated by commas; "k:TYPE,v:TYPE" is one item (its "v:" part is joined back).
  std::vector<std::string> items;
  for (const std::string& it : eval::split_list(s, ',')) {
    if (it.rfind("v:", 0) == 0 && !items.empty() && items.back().rfind("k:", 0) == 0 &&
        items.back().find(',') == std::string::npos) {
      items.back() += "," + it;
    } else {
      items.push_back(it);
    }
  }
  std::vector<KvType> out;
  for (const std::string& it : items) {
    auto t = ::d2o::parse_kv_type(it);
    if (!t.ok()) return t.status().with_context("--kv-types");
    if (std::find(out.begin(), out.end(), *t) == out.end()) out.push_back(*t);
  }
  if (out.empty()) return invalid_argument("--kv-types: no type given");
  return out;
}

Result<std::string> split_policy_type(const std::string& given, int head_dim,
                                      std::vector<KvType>& types) {
  const size_t at = given.rfind('@');
  if (at == std::string::npos) return given;
  auto t = ::d2o::parse_kv_type(given.substr(at + 1));
  if (!t.ok()) return t.status().with_context("policy '" + given + "'");
  if (Status st = check_kv_type(*t, head_dim); !st.ok())
    return st.with_context("policy '" + given + "'");
  types = {*t};
  return given.substr(0, at);
}

Result<std::vector<eval::FidelityCase>> fidelity_bytes_cases(
    const std::vector<std::string>& policies, const BytesAxisOptions& o, const ModelHParams& hp,
    KvType run_type, int64_t prompt_len) {
  if (!o.bytes.empty() && !o.kv_mem_per_seq.empty())
    return invalid_argument("give --bytes or --kv-mem-per-seq, not both");
  std::vector<KvType> types = {run_type};
  if (!o.kv_types.empty()) {
    D2O_ASSIGN_OR_RETURN(types, parse_kv_type_list(o.kv_types));
  }
  for (const KvType& t : types) {
    if (Status st = check_kv_type(t, hp.head_dim); !st.ok()) return st.with_context("--kv-types");
  }
  // The columns: (label, nominal share of the F16 full cache's bytes for the prompt).
  std::vector<std::pair<std::string, double>> cols;
  size_t mem = 0;
  const double f16_prompt = static_cast<double>(
      eval::full_kv_bytes(eval::f16_config(kv_cache_config(hp, run_type)), prompt_len));
  if (!o.bytes.empty()) {
    D2O_ASSIGN_OR_RETURN(std::vector<double> shares, parse_double_list(o.bytes, "--bytes"));
    for (double s : shares) {
      if (!(s > 0 && s <= 1))
        return invalid_argument("--bytes: " + ratio_label(s) + " is not in (0, 1]");
      cols.push_back({ratio_label(s), s});
    }
  } else {
    auto cap = parse_byte_size(o.kv_mem_per_seq);
    if (!cap.ok()) return cap.status().with_context("--kv-mem-per-seq");
    mem = *cap;
    cols.push_back({"mem " + o.kv_mem_per_seq, static_cast<double>(mem) / f16_prompt});
  }
  std::vector<eval::FidelityCase> cases;
  for (const std::string& given : policies) {
    std::vector<KvType> mine = types;
    D2O_ASSIGN_OR_RETURN(const std::string base, split_policy_type(given, hp.head_dim, mine));
    if (eval::spec_preset(base) != "full" && eval::spec_has_compression(base)) {
      return invalid_argument("policy '" + base + "' sets ratio= or budget= itself; with " +
                              (mem ? "--kv-mem-per-seq" : "--bytes") +
                              " the bytes set every budget: give the policy without it");
    }
    for (const KvType& t : mine) {
      const std::string row = base + " [" + kv_type_name(t) + "]";
      if (eval::spec_preset(base) == "full") {
        // A full cache holds what it holds: one case, placed on the axis at its own bytes.
        D2O_ASSIGN_OR_RETURN(eval::PolicyUnderTest pt, eval::make_policy(base, row));
        eval::FidelityCase c{row, "-", pt};
        c.kv_type = t;
        cases.push_back(std::move(c));
        continue;
      }
      const KvCacheConfig cfg = kv_cache_config(hp, t);
      for (const auto& [label, share] : cols) {
        int64_t slots = 0;
        if (mem) {
          int s = 0;
          D2O_ASSIGN_OR_RETURN(std::string sp,
                               spec_for_kv_mem(base, o.kv_mem_per_seq, cfg, hp.n_ctx_train, &s));
          slots = s;
        } else {
          auto b = eval::budget_for_share(cfg, prompt_len, share);
          if (!b.ok()) return b.status().with_context("--bytes " + label + ", " + row);
          slots = b->slots;
        }
        D2O_ASSIGN_OR_RETURN(std::string spec,
                             eval::spec_with_compression(base, "budget=" + std::to_string(slots)));
        D2O_ASSIGN_OR_RETURN(eval::PolicyUnderTest pt, eval::make_policy(spec, row));
        eval::FidelityCase c{row, label, pt};
        c.kv_type = t;
        c.share = share;
        c.budget = slots;
        cases.push_back(std::move(c));
      }
    }
  }
  if (cases.empty()) return invalid_argument("no policies to evaluate");
  return cases;
}

}  // namespace d2o::cli
