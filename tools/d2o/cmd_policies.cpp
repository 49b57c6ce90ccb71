// d2o policies [NAME] [--spec SPEC] [--json]: the KV policies (--kv) and what they are made of:
// each preset's default spec, what it keeps, its parts and its keys; with NAME, every key it takes
// with what the key does; with --spec, a spec in its canonical form (old spellings read as today's)
// or why it is refused.
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "kv/policy.h"
#include "kv/policy/spec_docs.h"

namespace d2o::cli {

namespace {

struct PoliciesOptions {
  std::string name;
  std::string spec;
  bool json = false;
};

nlohmann::json preset_json(const PolicyPresetDoc& p) {
  return {{"name", p.name}, {"doc", p.doc}, {"spec", p.spec}, {"parts", p.parts}, {"keys", p.keys}};
}

void print_preset(const PolicyPresetDoc& p, const std::map<std::string, PolicyKeyDoc>& keys,
                  bool with_keys) {
  std::printf("%s\n  %s\n  default: %s\n", p.name.c_str(), p.doc.c_str(), p.spec.c_str());
  for (const std::string& part : p.parts) std::printf("  - %s\n", part.c_str());
  if (p.keys.empty()) return;
  if (!with_keys) {
    std::string line;
    for (const std::string& k : p.keys) line += (line.empty() ? "" : ", ") + k;
    std::printf("  keys: ratio, budget, %s\n", line.c_str());
    return;
  }
  std::printf("  keys:\n");
  for (const char* k : {"ratio", "budget"}) {
    std::printf("    %-24s %s\n", k, keys.at(k).doc.c_str());
  }
  for (const std::string& k : p.keys) {
    const auto it = keys.find(k);
    std::printf("    %-24s %s\n", k.c_str(), it == keys.end() ? "" : it->second.doc.c_str());
  }
}

int run_policies(const PoliciesOptions& o) {
  if (!o.spec.empty()) {
    auto policy = parse_kv_policy(o.spec);
    if (!policy.ok()) return fail(policy.status());
    if (o.json) {
      std::printf("%s\n", nlohmann::json{{"spec", (*policy)->spec()}}.dump(2).c_str());
    } else {
      std::printf("%s\n", (*policy)->spec().c_str());
    }
    return 0;
  }
  std::map<std::string, PolicyKeyDoc> keys;
  for (PolicyKeyDoc& k : policy_key_docs()) keys.emplace(k.name, std::move(k));
  std::vector<PolicyPresetDoc> presets = policy_preset_docs();
  std::string names;
  const PolicyPresetDoc* chosen = nullptr;
  for (const PolicyPresetDoc& p : presets) {
    names += (names.empty() ? "" : ", ") + p.name;
    if (p.name == o.name) chosen = &p;
  }
  if (!o.name.empty() && !chosen) {
    return fail(invalid_argument("unknown KV policy '" + o.name + "' (allowed: " + names + ")"));
  }
  if (o.json) {
    nlohmann::json doc = nlohmann::json::array();
    for (const PolicyPresetDoc& p : presets) {
      if (!chosen || &p == chosen) doc.push_back(preset_json(p));
    }
    std::printf("%s\n", doc.dump(2).c_str());
    return 0;
  }
  for (const PolicyPresetDoc& p : presets) {
    if (chosen && &p != chosen) continue;
    print_preset(p, keys, chosen != nullptr);
    if (!chosen) std::printf("\n");
  }
  if (!chosen) std::printf("`d2o policies NAME` lists a preset's keys with what each does.\n");
  return 0;
}

}  // namespace

Action add_policies_command(CLI::App& app) {
  auto o = std::make_shared<PoliciesOptions>();
  CLI::App* sub = app.add_subcommand(
      "policies",
      "The KV policies (--kv): each preset's default spec, what it keeps, its parts "
      "and keys");
  sub->add_option("name", o->name, "One preset: its keys with what each does");
  sub->add_option("--spec", o->spec,
                  "Print this spec in its canonical form (old spellings read as today's), or why "
                  "it is refused");
  sub->add_flag("--json", o->json, "JSON instead of text");
  return [o] { return run_policies(*o); };
}

}  // namespace d2o::cli
