// The helpers both AVX-512 files of the matmul share (matmul_avx512.cpp,
// matmul_kquant_avx512.cpp): broadcasts and loads, the store of a tile's rows, the IQ4 table.
// Included by each inside its anonymous namespace, so each object keeps its own internal copy (an
// inline function with external linkage could be merged with another level's copy:
// tests/check_isa_objects.cmake).
//
// Not a self-contained header: include it only there, inside `namespace d2o::mm { namespace {`,
// after <immintrin.h>, <cstring>, ops/matmul_kernels.h and ops/quant.h.

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
inline __m512i bcast4(const int16_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
inline __m512 half16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512i load64(const uint8_t* p) {
  return _mm512_loadu_si512(p);
}
inline __m256i load32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
// a | (b & c) in one instruction.
inline __m512i or_and(__m512i a, __m512i b, __m512i c) {
  return _mm512_ternarylogic_epi32(a, b, c, 0xF8);
}

inline void store_rows(const TileJob& job, int t, __m512 v) {
  float* y = job.y + t * job.y_stride;
  if (job.rows == kTileRows) {
    _mm512_storeu_ps(y, v);
  } else {
    _mm512_mask_storeu_ps(y, static_cast<__mmask16>((1u << job.rows) - 1u), v);
  }
}

// kIq4Values + 128 (1..241) in every 128-bit lane: vpshufb turns IQ4 nibbles into the unsigned
// bytes vpdpbusd takes; the excess 128 * sum(x) is removed with the block's bias.
inline __m512i iq4_lut_u8() {
  alignas(16) uint8_t v[16];
  for (int i = 0; i < 16; ++i) v[i] = static_cast<uint8_t>(kIq4Values[i] + 128);
  return _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(v)));
}
