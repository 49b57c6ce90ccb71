#include "ops/hadamard.h"

#include <cmath>

#include "core/assert.h"

namespace d2o {

namespace {

// One block: the butterflies of each pass touch x[j] and x[j + h] for h = 1, 2, 4, ...; the inner
// loop runs over contiguous j, which the compiler vectorises once h reaches the vector width.
void hadamard_block(float* x, int n, float scale) {
  for (int h = 1; h < n; h *= 2) {
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

void hadamard_blocks(float* x, int64_t len, int n) {
  D2O_ASSERT_MSG(n > 0 && (n & (n - 1)) == 0, "Hadamard block size must be a power of two");
  D2O_ASSERT_MSG(len % n == 0, "Hadamard transform: length not a multiple of the block size");
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)));
  for (int64_t o = 0; o < len; o += n) hadamard_block(x + o, n, scale);
}

}  // namespace d2o
