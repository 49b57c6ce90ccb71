// The normalised Walsh-Hadamard transform: y = H x / sqrt(n) over blocks of n (a power of two)
// consecutive elements, H the Sylvester-ordered Hadamard matrix (H_1 = [1], H_2n = [[H_n, H_n],
// [H_n, -H_n]]; entry (i, j) is (-1)^popcount(i & j)). H / sqrt(n) is orthonormal and symmetric,
// hence its own inverse: applying the transform twice gives the input back (up to rounding).
//
// Computed as the fast transform (log2 n passes of n / 2 butterflies, no matrix): 6 passes for a
// block of 64. Used to spread outlier channels of KV rows over their block before quantisation
// (kv/kv_rotation.h).
#pragma once

#include <cstdint>

namespace d2o {

// Transforms x[0, len) in place, block by block; len must be a multiple of n, n a power of two.
void hadamard_blocks(float* x, int64_t len, int n);

}  // namespace d2o
