// Dequantisation vs the `gguf` PyPI package (fixtures made by scripts/gen_quant_fixtures.py, run
// by scripts/setup.sh --test-data into <cache>/test-data/quant or $D2O_QUANT_DIR), bit for bit, for the scalar reference and every SIMD level this CPU has; fp16 row conversions vs
// the scalar conversions of src/core/fp16.h on all 65536 halves.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "common/quant_fixture.h"
#include "common/test_util.h"
#include "core/fp16.h"
#include "ops/quant.h"
#include "unit/unit_helpers.h"

namespace d2o {
namespace {

struct QuantFile {
  GgmlType type = GgmlType::kF32;
  std::vector<uint8_t> raw;
  std::vector<float> expected;
};

using test::quant_dir;

// Reads <quant_dir>/dequant_<name>.bin (layout documented in the generator script).
bool load_fixture(const std::string& name, QuantFile* f, std::string* error) {
  const std::string path = quant_dir() + "/dequant_" + name + ".bin";
  std::ifstream in;
  uint32_t type = 0, n_a = 0, n_b = 0;
  if (!test::open_quant_fixture(path, &in, &type, &n_a, &n_b, error)) return false;
  f->type = static_cast<GgmlType>(type);
  f->expected.resize(n_a);
  f->raw.resize(n_b);
  in.read(reinterpret_cast<char*>(f->raw.data()), static_cast<std::streamsize>(f->raw.size()));
  in.read(reinterpret_cast<char*>(f->expected.data()),
          static_cast<std::streamsize>(f->expected.size() * sizeof(float)));
  if (!in) {
    *error = path + ": truncated";
    return false;
  }
  if (ggml_row_bytes(f->type, static_cast<int64_t>(f->expected.size())) !=
      static_cast<int64_t>(f->raw.size())) {
    *error = path + ": byte count does not match the element count";
    return false;
  }
  return true;
}

class DequantFixture : public ::testing::TestWithParam<const char*> {};

TEST_P(DequantFixture, BitIdenticalToGgufPackage) {
  if (!std::filesystem::is_directory(quant_dir())) {
    GTEST_SKIP() << "no dequantisation references in " << quant_dir()
                 << " (scripts/setup.sh --test-data makes them)";
  }
  QuantFile f;
  std::string error;
  ASSERT_TRUE(load_fixture(GetParam(), &f, &error)) << error;
  ASSERT_EQ(ggml_type_name(f.type), GetParam());
  ASSERT_TRUE(dequantize_supported(f.type));
  const int64_t n = static_cast<int64_t>(f.expected.size());

  // Source at a 2-byte offset from a 64-byte boundary (blocks inside a GGUF row need not be
  // vector aligned); F32 keeps 4-byte alignment.
  const size_t offset = f.type == GgmlType::kF32 ? 4 : 2;
  std::vector<uint8_t> buf(f.raw.size() + 64 + offset);
  uint8_t* base = buf.data() + (64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64;
  std::memcpy(base + offset, f.raw.data(), f.raw.size());

  auto check = [&](const std::vector<float>& got, const std::string& what) {
    int mismatches = 0;
    for (int64_t i = 0; i < n && mismatches < 5; ++i) {
      if (fp32_to_bits(got[i]) != fp32_to_bits(f.expected[i])) {
        ADD_FAILURE() << what << " element " << i << ": got " << got[i] << " expected "
                      << f.expected[i];
        ++mismatches;
      }
    }
  };
  std::vector<float> out(n + 1, -1.0f);
  dequantize_row_ref(f.type, base + offset, out.data(), n);
  EXPECT_EQ(out[n], -1.0f) << "wrote past the end";
  out.resize(n);
  check(out, "reference");
  for (KernelIsa isa : test::available_isas()) {
    std::vector<float> simd(n, -1.0f);
    dequantize_row_isa(isa, f.type, base + offset, simd.data(), n);
    check(simd, kernel_isa_name(isa));
  }
  std::vector<float> best(n);
  dequantize_row(f.type, base + offset, best.data(), n);
  check(best, "dequantize_row");

  // Block by block gives the same values as the whole row.
  const int64_t bs = ggml_block_size(f.type);
  if (bs > 1) {
    const int64_t bytes = ggml_row_bytes(f.type, bs);
    std::vector<float> one(bs);
    for (int64_t b = 0; b < n / bs; ++b) {
      dequantize_row(f.type, base + offset + b * bytes, one.data(), bs);
      for (int64_t i = 0; i < bs; ++i) {
        ASSERT_EQ(fp32_to_bits(one[i]), fp32_to_bits(f.expected[b * bs + i])) << b << " " << i;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllTypes, DequantFixture,
                         ::testing::Values("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                                           "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL",
                                           "IQ4_XS"),
                         [](const ::testing::TestParamInfo<const char*>& p) {
                           return std::string(p.param);
                         });

// Random blocks beyond the fixtures: every SIMD level equals the reference on many blocks.
TEST(Dequant, SimdMatchesReferenceOnRandomBlocks) {
  std::mt19937 rng(7);
  for (GgmlType type :
       {GgmlType::kF16, GgmlType::kBF16, GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ5_0,
        GgmlType::kQ5_1, GgmlType::kQ8_0, GgmlType::kQ2_K, GgmlType::kQ3_K, GgmlType::kQ4_K,
        GgmlType::kQ5_K, GgmlType::kQ6_K, GgmlType::kIQ4_NL, GgmlType::kIQ4_XS}) {
    const int64_t n = ggml_block_size(type) * 37 + (ggml_block_size(type) == 1 ? 5 : 0);
    std::vector<uint8_t> raw(static_cast<size_t>(ggml_row_bytes(type, n)));
    for (auto& b : raw) b = static_cast<uint8_t>(rng());
    // Make every 16-bit word finite as a half and as a bfloat16 (the scale fields are among
    // them; quantised payload bytes lose nothing by the tweak).
    for (size_t i = 0; i + 1 < raw.size(); i += 2) raw[i + 1] &= 0xBB;
    std::vector<float> ref(n), got(n);
    dequantize_row_ref(type, raw.data(), ref.data(), n);
    for (KernelIsa isa : test::available_isas()) {
      dequantize_row_isa(isa, type, raw.data(), got.data(), n);
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(fp32_to_bits(got[i]), fp32_to_bits(ref[i]))
            << ggml_type_name(type) << " " << kernel_isa_name(isa) << " element " << i;
      }
    }
  }
}

TEST(Dequant, SupportedTypes) {
  EXPECT_TRUE(dequantize_supported(GgmlType::kQ6_K));
  EXPECT_TRUE(dequantize_supported(GgmlType::kIQ4_NL));
  EXPECT_TRUE(dequantize_supported(GgmlType::kIQ4_XS));
  EXPECT_FALSE(dequantize_supported(GgmlType::kQ8_K));
  EXPECT_FALSE(dequantize_supported(GgmlType::kIQ2_XXS));
  EXPECT_FALSE(dequantize_supported(GgmlType::kI32));
}

TEST(Dequant, ScaleMinPackingRoundTrips) {
  std::mt19937 rng(3);
  for (int trial = 0; trial < 1000; ++trial) {
    uint8_t sc[8], m[8], packed[12];
    for (int j = 0; j < 8; ++j) {
      sc[j] = static_cast<uint8_t>(rng() % 64);
      m[j] = static_cast<uint8_t>(rng() % 64);
    }
    pack_scale_min_k4(sc, m, packed);
    for (int j = 0; j < 8; ++j) {
      uint8_t s2, m2;
      get_scale_min_k4(j, packed, &s2, &m2);
      ASSERT_EQ(s2, sc[j]);
      ASSERT_EQ(m2, m[j]);
    }
  }
}

// fp16 -> fp32 on all 65536 halves, at every level and at odd lengths / offsets.
TEST(Fp16Row, ToFp32MatchesScalarOnAllHalves) {
  std::vector<uint16_t> halves(65536 + 3);
  for (uint32_t h = 0; h < 65536; ++h) halves[h + 3] = static_cast<uint16_t>(h);
  for (KernelIsa isa : test::available_isas()) {
    std::vector<float> out(65536 + 3);
    // Offset 3 elements: the source and destination are not vector aligned.
    fp16_to_fp32_row_isa(isa, halves.data() + 3, out.data() + 3, 65536);
    for (uint32_t h = 0; h < 65536; ++h) {
      const float want = fp16_to_fp32(static_cast<uint16_t>(h));
      const float got = out[h + 3];
      if (std::isnan(want)) {
        ASSERT_TRUE(std::isnan(got)) << kernel_isa_name(isa) << " half 0x" << std::hex << h;
      } else {
        ASSERT_EQ(fp32_to_bits(got), fp32_to_bits(want))
            << kernel_isa_name(isa) << " half 0x" << std::hex << h;
      }
    }
  }
}

// acc += w * x over F16 x: on every level the bits of the product-then-sum loop (no fused
// multiply-add), every half, at an odd byte address and odd lengths, with weights whose products
// round.
TEST(Fp16Row, AxpyIsTheRoundedProductThenSumOnEveryLevel) {
  std::vector<uint8_t> bytes(2 * 65536 + 1);
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint16_t v = static_cast<uint16_t>(h * 40503u);  // every half, scattered
    std::memcpy(bytes.data() + 1 + 2 * h, &v, 2);
  }
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> acc0(-3.0f, 3.0f);
  for (float w : {0.3f, 1.0f / 3.0f, -0.7071f, 0.0f}) {
    for (int64_t n :
         {int64_t{1}, int64_t{7}, int64_t{8}, int64_t{9}, int64_t{64}, int64_t{65536}}) {
      std::vector<float> init(static_cast<size_t>(n));
      for (float& a : init) a = acc0(rng);
      std::vector<float> want = init;
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, bytes.data() + 1 + 2 * i, 2);
        volatile float prod = w * fp16_to_fp32(h);
        want[static_cast<size_t>(i)] = want[static_cast<size_t>(i)] + prod;
      }
      for (KernelIsa isa : test::available_isas()) {
        std::vector<float> got = init;
        fp16_axpy_row_isa(isa, got.data(), bytes.data() + 1, w, n);
        for (int64_t i = 0; i < n; ++i) {
          const float a = want[static_cast<size_t>(i)], b = got[static_cast<size_t>(i)];
          if (std::isnan(a)) {
            ASSERT_TRUE(std::isnan(b)) << kernel_isa_name(isa) << " i " << i;
          } else {
            ASSERT_EQ(fp32_to_bits(b), fp32_to_bits(a)) << kernel_isa_name(isa) << " i " << i;
          }
        }
      }
    }
  }
}

// fp32 -> fp16: every half's exact value, the midpoints between neighbouring halves (ties go to
// even) and random floats of all magnitudes, at every level.
TEST(Fp16Row, ToFp16MatchesScalarRounding) {
  std::vector<float> src;
  for (uint32_t h = 0; h < 65536; ++h) {
    const float v = fp16_to_fp32(static_cast<uint16_t>(h));
    src.push_back(v);
    if (!std::isnan(v) && !std::isinf(v) && (h & 0x7fff) != 0x7bff) {
      const float next = fp16_to_fp32(static_cast<uint16_t>(h + 1));
      src.push_back(static_cast<float>((static_cast<double>(v) + next) / 2));  // exact midpoint
      src.push_back(std::nextafter(static_cast<float>((static_cast<double>(v) + next) / 2), 0.0f));
    }
  }
  std::mt19937 rng(11);
  for (int i = 0; i < 100000; ++i) src.push_back(fp32_from_bits(static_cast<uint32_t>(rng())));
  src.push_back(70000.0f);
  src.push_back(-1e-10f);
  const int64_t n = static_cast<int64_t>(src.size());
  for (KernelIsa isa : test::available_isas()) {
    std::vector<uint16_t> out(n);
    fp32_to_fp16_row_isa(isa, src.data(), out.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t want = fp32_to_fp16(src[i]);
      if (std::isnan(src[i])) {
        ASSERT_TRUE(std::isnan(fp16_to_fp32(out[i]))) << kernel_isa_name(isa) << " " << i;
      } else {
        ASSERT_EQ(out[i], want) << kernel_isa_name(isa) << " value " << src[i];
      }
    }
  }
  std::vector<uint16_t> best(5);
  fp32_to_fp16_row(src.data(), best.data(), 5);  // the dispatching entry points
  std::vector<float> back(5);
  fp16_to_fp32_row(best.data(), back.data(), 5);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(best[i], fp32_to_fp16(src[i]));
}

}  // namespace
}  // namespace d2o
