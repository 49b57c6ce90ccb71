// The helpers both AVX2 files of the matmul share (matmul_avx2.cpp, matmul_kquant_avx2.cpp):
// broadcasts and loads, the store of a half tile, the IQ4 table. Included by each inside its
// anonymous namespace, so each object keeps its own internal copy (an inline function with
// external linkage could be merged with another level's copy: tests/check_isa_objects.cmake).
//
// Not a self-contained header: include it only there, inside `namespace d2o::mm { namespace {`,
// after <immintrin.h>, <cstring>, ops/matmul_kernels.h and ops/quant.h.

inline __m256i bcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
inline __m256 half8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256i load32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
// Pins v in a register at this point: GCC 12 otherwise reassociates the exact integer sums of a
// block, computes all of its products first and spills them (AVX2 has 16 vector registers; the
// reordered Q4_1 kernel kept 14 products on the stack).
inline void pin(__m256i& v) {
  asm volatile("" : "+x"(v));
}

inline __m128i load16(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

inline void store_half(const TileJob& job, int t, int half, __m256 v) {
  float* y = job.y + t * job.y_stride + 8 * half;
  const int valid = job.rows - 8 * half;
  if (valid >= 8) {
    _mm256_storeu_ps(y, v);
  } else {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_maskstore_ps(y, _mm256_cmpgt_epi32(_mm256_set1_epi32(valid), idx), v);
  }
}

// kIq4Values (signed) in both 128-bit lanes, for vpshufb.
inline __m256i iq4_lut_s8() {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Values));
  return _mm256_broadcastsi128_si256(v);
}
