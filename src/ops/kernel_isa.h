// Kernel instruction-set levels and the run-time choice between them.
//
// Every SIMD kernel in src/ops/ exists in up to three variants: portable scalar code, AVX2 (+FMA,
// F16C) in *_avx2.cpp files, and AVX-512 (F/BW/VL/DQ + VNNI) in *_avx512.cpp files. The best level
// the CPU offers is chosen from cpu_features() (D2O_FORCE_SCALAR=1 makes it kScalar); tests and
// benchmarks can ask for a specific level to compare the variants with each other.
#pragma once

namespace d2o {

enum class KernelIsa {
  kScalar = 0,
  kAvx2 = 1,    // AVX2 + FMA + F16C
  kAvx512 = 2,  // AVX-512 F/BW/VL/DQ + VNNI (and everything kAvx2 needs)
};

// True when this CPU can run kernels of that level.
bool kernel_isa_available(KernelIsa isa);
// The best available level (computed once).
KernelIsa best_kernel_isa();
const char* kernel_isa_name(KernelIsa isa);

}  // namespace d2o
