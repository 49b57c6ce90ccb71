// Policy spec strings: "name" or "name:key=value,key=value". One grammar for CLI, server, bench.
#include <string>

#include "kv/policy.h"

namespace d2o {

Result<std::unique_ptr<KvPolicy>> parse_kv_policy(std::string_view spec) {
  const std::string s(spec);
  if (s == "full" || s.empty()) return std::unique_ptr<KvPolicy>(new FullPolicy());
  return invalid_argument("unknown KV policy '" + s + "' (allowed: full)");
}

}  // namespace d2o
