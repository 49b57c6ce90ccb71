#include "ops/kernel_isa.h"

#include <iterator>

#include "core/cpu.h"

namespace d2o {

namespace {

bool isa_available(KernelIsa isa) {
  const CpuFeatures& f = cpu_features();
  const bool avx2 = f.avx2 && f.fma && f.f16c;
  switch (isa) {
    case KernelIsa::kScalar:
      return true;
    case KernelIsa::kAvx2:
      return avx2;
    case KernelIsa::kAvx512:
      // The *_avx512.cpp files are also compiled with -mavx512dq; every CPU with VNNI has DQ,
      // but cpu_features() does not report it separately, so VNNI + BW + VL stands for the set.
      return avx2 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512vnni;
  }
  return false;
}

}  // namespace

bool kernel_isa_available(KernelIsa isa) {
  // Asked in the kernels' asserts on every call: the answers, once.
  static const bool available[] = {isa_available(KernelIsa::kScalar),
                                   isa_available(KernelIsa::kAvx2),
                                   isa_available(KernelIsa::kAvx512)};
  const auto i = static_cast<size_t>(isa);
  return i < std::size(available) && available[i];
}

KernelIsa best_kernel_isa() {
  static const KernelIsa best = [] {
    if (kernel_isa_available(KernelIsa::kAvx512)) return KernelIsa::kAvx512;
    if (kernel_isa_available(KernelIsa::kAvx2)) return KernelIsa::kAvx2;
    return KernelIsa::kScalar;
  }();
  return best;
}

const char* kernel_isa_name(KernelIsa isa) {
  switch (isa) {
    case KernelIsa::kScalar:
      return "scalar";
    case KernelIsa::kAvx2:
      return "avx2";
    case KernelIsa::kAvx512:
      return "avx512";
  }
  return "unknown";
}

}  // namespace d2o
