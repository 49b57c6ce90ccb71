// The presets of policy spec strings (streaming, h2o, snapkv, pyramidkv, roco, cam, d2o, keydiff):
// each one a list of the parts it is made of, each part with the values this preset starts it
// from and the keys through which a spec tunes it. The parts are the policy room's files (a
// keeper, scorers, layer budgets, head shares, a merger, the prompt phase, a cold tier); their
// keys are registered by those files (spec_keys.h). Internal to the spec parser (spec.cpp).
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "kv/policy/config.h"

namespace d2o::spec_detail {

// One part of a preset.
struct PresetPart {
  std::string what;                        // one line for users: "keeper: sinks + recent window"
  std::function<void(PolicyConfig&)> set;  // the values this preset starts the part from
  std::vector<const char*> keys;           // the part's keys this preset takes
};

struct PresetDef {
  const char* name;
  std::vector<PresetPart> parts;
  // Every key it takes besides ratio/budget (and d2o's reading), in the order its canonical form
  // prints them: its parts' keys in the parts' order, unless the preset gives an order of its own
  // (d2o: the order its specs were recorded in; the same keys, checked by a test).
  std::vector<const char*> keys;

  // The keys of its parts, in the parts' order.
  std::vector<const char*> part_keys() const;
  // Its defaults: each part's values, in order.
  void defaults(PolicyConfig& c) const;
  bool accepts(std::string_view key) const;
};

const std::vector<PresetDef>& presets();
const PresetDef* find_preset(std::string_view name);

// D2O as the paper states it (d2o:reading=paper): variance budgets, 3:1, weighted merges, the
// prompt compacted by its accumulated attention, evicted slots merged or dropped (no cold tier).
void paper_d2o(PolicyConfig& c);

}  // namespace d2o::spec_detail
