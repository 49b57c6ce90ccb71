// CPU facts: instruction-set features detected once at start-up, for kernel dispatch.
#pragma once

#include <string>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace d2o {

struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512vnni = false;
  bool avx512bf16 = false;
  bool avxvnni = false;
};

// Detected once (thread-safe static), then capped (cap_features): D2O_MAX_ISA=avx2 keeps an
// AVX-512 machine on the AVX2 kernels, which reproduces bit for bit figures made on an AVX2-only
// one; D2O_FORCE_SCALAR=1 (the same as D2O_MAX_ISA=scalar) disables all SIMD paths, which is how
// the tests compare each kernel against its scalar reference end to end.
const CpuFeatures& cpu_features();

// `f` capped at `max_isa` ("scalar", "avx2", "avx512", or null/empty for no cap). An unknown
// value is reported on stderr and caps at scalar, the safe choice.
CpuFeatures cap_features(CpuFeatures f, const char* max_isa);

// "AMD EPYC ... (avx2 fma f16c avx512f ...)", for reports.
std::string cpu_description();

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

}  // namespace d2o
