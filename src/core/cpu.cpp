#include "core/cpu.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>

namespace d2o {

namespace {
CpuFeatures detect() {
  CpuFeatures f;
  const char* force = std::getenv("D2O_FORCE_SCALAR");
  const bool force_scalar = force && std::strcmp(force, "0") != 0 && force[0] != '\0';
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  f.avx2 = __builtin_cpu_supports("avx2");
  f.fma = __builtin_cpu_supports("fma");
  f.avx512f = __builtin_cpu_supports("avx512f");
  f.avx512bw = __builtin_cpu_supports("avx512bw");
  f.avx512vl = __builtin_cpu_supports("avx512vl");
  f.avx512vnni = __builtin_cpu_supports("avx512vnni");
  f.avx512bf16 = __builtin_cpu_supports("avx512bf16");
  // F16C and AVX-VNNI are not known to every compiler's __builtin_cpu_supports: ask CPUID.
  unsigned a, b, c, d;
  __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(1), "c"(0));
  f.f16c = (c >> 29) & 1u;
  __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(1));
  f.avxvnni = (a >> 4) & 1u;
#endif
  return cap_features(f, force_scalar ? "scalar" : std::getenv("D2O_MAX_ISA"));
}
}  // namespace

CpuFeatures cap_features(CpuFeatures f, const char* max_isa) {
  if (max_isa == nullptr || max_isa[0] == '\0' || std::strcmp(max_isa, "avx512") == 0) return f;
  if (std::strcmp(max_isa, "avx2") == 0) {
    // What an AVX2-only CPU (Zen 3) offers: no AVX-512 and no AVX-VNNI.
    f.avx512f = f.avx512bw = f.avx512vl = f.avx512vnni = f.avx512bf16 = false;
    f.avxvnni = false;
    return f;
  }
  if (std::strcmp(max_isa, "scalar") != 0) {
    std::fprintf(stderr,
                 "d2o: D2O_MAX_ISA='%s' is not one of scalar, avx2, avx512; using scalar code\n",
                 max_isa);
  }
  return CpuFeatures{};
}

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

std::string cpu_description() {
  std::string model = "unknown CPU";
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      auto pos = line.find(':');
      if (pos != std::string::npos) model = line.substr(pos + 2);
      break;
    }
  }
  const CpuFeatures& f = cpu_features();
  std::string flags;
  auto add = [&](bool on, const char* name) {
    if (on) flags += std::string(flags.empty() ? "" : " ") + name;
  };
  add(f.avx2, "avx2");
  add(f.fma, "fma");
  add(f.f16c, "f16c");
  add(f.avx512f, "avx512f");
  add(f.avx512bw, "avx512bw");
  add(f.avx512vl, "avx512vl");
  add(f.avx512vnni, "avx512vnni");
  add(f.avx512bf16, "avx512bf16");
  add(f.avxvnni, "avxvnni");
  return model + " (" + (flags.empty() ? "scalar" : flags) + ")";
}

}  // namespace d2o
