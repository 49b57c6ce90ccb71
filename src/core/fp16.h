// Scalar IEEE half (F16) and bfloat16 (BF16) conversions.
//
// fp32_to_fp16 rounds to nearest-even and handles subnormals, infinities and NaN, so values
// written here read back exactly as other GGUF tools read them. Bulk SIMD conversions live in
// src/ops/ (F16C), tested against these.
#pragma once

#include <cstdint>
#include <cstring>

namespace d2o {

inline float fp32_from_bits(uint32_t w) {
  float f;
  std::memcpy(&f, &w, 4);
  return f;
}
inline uint32_t fp32_to_bits(float f) {
  uint32_t w;
  std::memcpy(&w, &f, 4);
  return w;
}

inline float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0) {
    if (man == 0) return fp32_from_bits(sign);
    // Subnormal: value = man * 2^-24.
    const float v = static_cast<float>(man) * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  if (exp == 31) return fp32_from_bits(sign | 0x7f800000u | (man << 13));
  return fp32_from_bits(sign | ((exp + 112) << 23) | (man << 13));
}

inline uint16_t fp32_to_fp16(float f) {
  const uint32_t x = fp32_to_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) {  // Inf or NaN (keep NaN quiet and non-zero)
    return static_cast<uint16_t>(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u | ((ax >> 13) & 0x3ffu) : 0));
  }
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: Inf
  if (ax < 0x38800000u) {
    // Result is subnormal or zero: scale so that one unit in the last place is 2^-24, then round
    // to nearest-even through the float adder.
    const float v = fp32_from_bits(ax) + 0.5f;  // 0.5 = 2^-1; mantissa bits now hold man * 2^-24
    return static_cast<uint16_t>(sign | ((fp32_to_bits(v) - 0x3f000000u) & 0x7ffu));
  }
  // Normal: rebias exponent and round the 13 dropped bits to nearest-even.
  const uint32_t mant_odd = (ax >> 13) & 1u;
  const uint32_t rounded = ax + 0xfffu + mant_odd;
  return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
}

inline float bf16_to_fp32(uint16_t h) { return fp32_from_bits(static_cast<uint32_t>(h) << 16); }

inline uint16_t fp32_to_bf16(float f) {
  const uint32_t x = fp32_to_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 64u);  // quiet NaN
  return static_cast<uint16_t>((x + (0x7fffu + ((x >> 16) & 1u))) >> 16);  // nearest-even
}

}  // namespace d2o
