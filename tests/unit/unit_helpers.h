// Small helpers that several unit test files share.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kv/policy.h"
#include "ops/kernel_isa.h"

namespace d2o::test {

// The kernel levels this machine can run (scalar always), lowest first.
inline std::vector<KernelIsa> available_isas() {
  std::vector<KernelIsa> out;
  for (KernelIsa isa : {KernelIsa::kScalar, KernelIsa::kAvx2, KernelIsa::kAvx512}) {
    if (kernel_isa_available(isa)) out.push_back(isa);
  }
  return out;
}

// The policy `spec` names; a spec that does not parse fails the calling test.
inline std::unique_ptr<KvPolicy> policy_of(const std::string& spec) {
  auto p = parse_kv_policy(spec);
  EXPECT_TRUE(p.ok()) << p.status().message();
  return std::move(p).value();
}

}  // namespace d2o::test
