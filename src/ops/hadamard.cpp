#include "ops/hadamard.h"

#include <cmath>

#include "core/assert.h"

namespace d2o {

namespace {

// The first three passes (h = 1, 2, 4) on each group of 8, in registers: their inner loops are
// too short to vectorise.
void hadamard8(float* p) {
  const float a0 = p[0] + p[1], a1 = p[0] - p[1], a2 = p[2] + p[3], a3 = p[2] - p[3];
  const float a4 = p[4] + p[5], a5 = p[4] - p[5], a6 = p[6] + p[7], a7 = p[6] - p[7];
  const float b0 = a0 + a2, b2 = a0 - a2, b1 = a1 + a3, b3 = a1 - a3;
  const float b4 = a4 + a6, b6 = a4 - a6, b5 = a5 + a7, b7 = a5 - a7;
  p[0] = b0 + b4, p[4] = b0 - b4, p[1] = b1 + b5, p[5] = b1 - b5;
  p[2] = b2 + b6, p[6] = b2 - b6, p[3] = b3 + b7, p[7] = b3 - b7;
}

// One block: the butterflies of each pass touch x[j] and x[j + h] for h = 1, 2, 4, ...; from
// h = 8 on the inner loop runs over contiguous j, which the compiler vectorises.
inline void hadamard_block(float* x, int n, float scale) {
  int h = 1;
  if (n >= 8) {
    for (int i = 0; i < n; i += 8) hadamard8(x + i);
    h = 8;
  }
  for (; h < n; h *= 2) {
    for (int i = 0; i < n; i += 2 * h) {
      float* a = x + i;
      float* b = x + i + h;
      for (int j = 0; j < h; ++j) {
        const float u = a[j], w = b[j];
        a[j] = u + w;
        b[j] = u - w;
      }
    }
  }
  for (int j = 0; j < n; ++j) x[j] *= scale;
}

}  // namespace

// The block size as a constant: loops of known trip counts, unrolled and vectorised.
template <int N>
void hadamard_fixed(float* x, int64_t len, float scale) {
  for (int64_t o = 0; o < len; o += N) hadamard_block(x + o, N, scale);
}

void hadamard_blocks(float* x, int64_t len, int n) {
  D2O_ASSERT_MSG(n > 0 && (n & (n - 1)) == 0, "Hadamard block size must be a power of two");
  D2O_ASSERT_MSG(len % n == 0, "Hadamard transform: length not a multiple of the block size");
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)));
  switch (n) {
    case 64: return hadamard_fixed<64>(x, len, scale);
    case 128: return hadamard_fixed<128>(x, len, scale);
    case 256: return hadamard_fixed<256>(x, len, scale);
    default:
      for (int64_t o = 0; o < len; o += n) hadamard_block(x + o, n, scale);
  }
}

}  // namespace d2o
