// What the policy registry says about itself, for front ends that list it (the Python package's
// d2o.policies()): every preset with its defaults and the keys it accepts, every key with its old
// spelling, its value words and a line on what it does. The presets and keys come from the
// registries of spec.cpp and spec_keys.cpp; the lines from spec_docs.cpp.
#pragma once

#include <string>
#include <vector>

namespace d2o {

struct PolicyPresetDoc {
  std::string name;
  std::string doc;                // what it keeps, one or two sentences
  std::string spec;               // its canonical spec with every default (ratio mode)
  std::vector<std::string> keys;  // accepted keys besides ratio and budget, in canonical order
  std::vector<std::string> parts;  // what it is made of, one line per part
};

struct PolicyKeyDoc {
  std::string name;
  std::string old_name;             // "" when it kept its name
  std::vector<std::string> values;  // the value words of a word key ("" entries: none)
  std::string doc;
};

// Every preset, "full" first, in registry order.
std::vector<PolicyPresetDoc> policy_preset_docs();
// ratio, budget, then every key of the registry in its order.
std::vector<PolicyKeyDoc> policy_key_docs();

}  // namespace d2o
