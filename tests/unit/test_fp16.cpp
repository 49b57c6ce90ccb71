#include <gtest/gtest.h>

#include <cmath>

#include "core/fp16.h"

namespace d2o {
namespace {

// Every one of the 65536 half values survives fp16 -> fp32 -> fp16 unchanged (NaNs stay NaN).
TEST(Fp16, RoundTripsEveryHalf) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = fp16_to_fp32(static_cast<uint16_t>(h));
    const uint16_t back = fp32_to_fp16(f);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(fp16_to_fp32(back))) << h;
    } else {
      EXPECT_EQ(back, h) << "half 0x" << std::hex << h;
    }
  }
}

// Rounding to nearest-even: a float exactly between two halves goes to the even one, and any
// float goes to the nearest half (checked against a brute-force nearest search).
TEST(Fp16, RoundsToNearestEven) {
  EXPECT_EQ(fp32_to_fp16(1.0f + 1.0f / 2048.0f), 0x3c00);  // tie between 1 and 1+2^-10 -> 1
  EXPECT_EQ(fp32_to_fp16(1.0f + 3.0f / 2048.0f), 0x3c02);  // tie -> even mantissa 2
  EXPECT_EQ(fp32_to_fp16(65504.0f), 0x7bff);
  EXPECT_EQ(fp32_to_fp16(65520.0f), 0x7c00);  // overflow to Inf
  EXPECT_EQ(fp32_to_fp16(1e-8f), 0x0000);
  EXPECT_EQ(fp32_to_fp16(-0.0f), 0x8000);
  uint32_t seed = 12345;
  for (int k = 0; k < 20000; ++k) {
    seed = seed * 1664525u + 1013904223u;
    const float f = fp32_from_bits((seed & 0x807fffffu) | (((seed >> 23) % 40 + 100) << 23));
    const uint16_t h = fp32_to_fp16(f);
    const float back = fp16_to_fp32(h);
    const float up = fp16_to_fp32(static_cast<uint16_t>(h + 1));
    const float down = fp16_to_fp32(static_cast<uint16_t>(h - 1));
    if ((h & 0x7fff) != 0x7bff && (h & 0x7fff) != 0) {
      EXPECT_LE(std::fabs(back - f), std::fabs(up - f)) << f;
      EXPECT_LE(std::fabs(back - f), std::fabs(down - f)) << f;
    }
  }
}

TEST(Bf16, RoundTripAndNearestEven) {
  EXPECT_EQ(fp32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(bf16_to_fp32(0x3f80), 1.0f);
  EXPECT_EQ(fp32_to_bf16(fp32_from_bits(0x3f808000u)), 0x3f80);  // tie -> even
  EXPECT_EQ(fp32_to_bf16(fp32_from_bits(0x3f818000u)), 0x3f82);  // tie -> even
  EXPECT_TRUE(std::isnan(bf16_to_fp32(fp32_to_bf16(std::nanf("")))));
}

}  // namespace
}  // namespace d2o
