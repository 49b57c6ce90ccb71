// Fuzz target: the KV policy spec parser (--kv, and the same strings in the bench and server).
//
// A spec is refused with a Status or parsed; a parsed policy's canonical spec() must parse again
// to the same canonical spec. Read as a recorded spec (recorded_spec_today, as session files read
// theirs), it gives "" or a spec canonical today.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "kv/policy.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string spec(reinterpret_cast<const char*>(data), size);
  const std::string today = d2o::recorded_spec_today(spec);
  if (!today.empty()) {
    auto t = d2o::parse_kv_policy(today);
    if (!t.ok() || (*t)->spec() != today) {
      std::fprintf(stderr, "recorded spec '%s' reads as '%s', not canonical\n", spec.c_str(),
                   today.c_str());
      std::abort();
    }
  }
  auto p = d2o::parse_kv_policy(spec);
  if (!p.ok()) return 0;
  const std::string canon = (*p)->spec();
  auto again = d2o::parse_kv_policy(canon);
  if (!again.ok() || (*again)->spec() != canon) {
    std::fprintf(stderr, "canonical spec '%s' does not parse back to itself\n", canon.c_str());
    std::abort();
  }
  return 0;
}
