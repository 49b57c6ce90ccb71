// Internal: the matmul tiles of the formats in 256-element blocks (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
// IQ4_XS) and of BF16, for each SIMD level. They are compiled in files of their own
// (matmul_kquant_avx2.cpp, matmul_kquant_avx512.cpp), and the level's kernel table
// (make_kernel_table in matmul_table_impl.h) takes them from here. Only these plain functions,
// named after their level, cross from one file to the other: templates or inline functions shared
// by name would be weak symbols, which the linker may merge with another level's copy
// (tests/check_isa_objects.cmake).
#pragma once

#include "ops/matmul_kernels.h"

namespace d2o::mm {

// Each tile function dispatches on the job's token count itself.
struct KQuantTiles {
  TileFn q4_k = nullptr, q5_k = nullptr, q6_k = nullptr, iq4_xs = nullptr, bf16 = nullptr;
  TileFn q3_k = nullptr, q2_k = nullptr;
};

KQuantTiles kquant_tiles_avx2();
KQuantTiles kquant_tiles_avx512();

}  // namespace d2o::mm
