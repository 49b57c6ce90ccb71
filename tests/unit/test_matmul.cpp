// matmul: every kernel level against an exact reference on random matrices of odd shapes, exact
// equality where the arithmetic is exact, bit-identical results across levels, thread counts and
// token groupings, and the error paths of QMatrix::from_gguf_bytes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "common/test_util.h"
#include "core/cpu.h"
#include "core/fp16.h"
#include "ops/matmul.h"
#include "ops/quant.h"
#include "unit/unit_helpers.h"

namespace d2o {
namespace {

// Byte offsets of the fp16 fields (scales, mins) inside one GGUF block.
std::vector<int> half_fields(GgmlType type) {
  switch (type) {
    case GgmlType::kQ4_0:
    case GgmlType::kQ5_0:
    case GgmlType::kQ8_0:
    case GgmlType::kIQ4_NL:
    case GgmlType::kIQ4_XS:
      return {0};
    case GgmlType::kQ4_1:
    case GgmlType::kQ5_1:
    case GgmlType::kQ4_K:
    case GgmlType::kQ5_K:
      return {0, 2};
    case GgmlType::kQ2_K:
      return {80, 82};
    case GgmlType::kQ3_K:
      return {108};
    case GgmlType::kQ6_K:
      return {208};
    default:
      return {};
  }
}

void put_half(uint8_t* p, float v) {
  const uint16_t h = fp32_to_fp16(v);
  std::memcpy(p, &h, 2);
}

// Random GGUF bytes of an [n_rows, n_cols] matrix. kRealistic: random quants with small random
// scales (values of the size of real weights). kInteger: every weight is a small integer (unit
// scales, small integer mins and sub-block scales), so that integer activations make every
// product and sum exact in float.
enum class Fill { kRealistic, kInteger };

std::vector<uint8_t> random_weights(GgmlType type, int64_t n_rows, int64_t n_cols, Fill fill,
                                    std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::uniform_int_distribution<int> small(-8, 8);
  const int64_t n = n_rows * n_cols;
  std::vector<uint8_t> out(static_cast<size_t>(ggml_row_bytes(type, n_cols) * n_rows));
  auto value = [&]() {
    return fill == Fill::kInteger ? static_cast<float>(small(rng)) : 0.1f * u(rng);
  };
  if (type == GgmlType::kF32) {
    for (int64_t i = 0; i < n; ++i) {
      const float v = value();
      std::memcpy(out.data() + 4 * i, &v, 4);
    }
    return out;
  }
  if (type == GgmlType::kF16 || type == GgmlType::kBF16) {
    for (int64_t i = 0; i < n; ++i) {
      const float v = value();
      const uint16_t h = type == GgmlType::kF16 ? fp32_to_fp16(v) : fp32_to_bf16(v);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
    return out;
  }
  for (auto& b : out) b = static_cast<uint8_t>(rng());
  const int64_t block_bytes = ggml_row_bytes(type, ggml_block_size(type));
  const std::vector<int> fields = half_fields(type);
  for (size_t off = 0; off < out.size(); off += static_cast<size_t>(block_bytes)) {
    uint8_t* blk = out.data() + off;
    if (fill == Fill::kRealistic) {
      for (int f : fields) put_half(blk + f, 0.02f * u(rng));
      if (type == GgmlType::kQ4_1 || type == GgmlType::kQ5_1)
        put_half(blk + 2, -0.15f * std::fabs(u(rng)));
      continue;
    }
    for (int f : fields) put_half(blk + f, 1.0f);
    switch (type) {
      case GgmlType::kQ4_1:
      case GgmlType::kQ5_1:
        put_half(blk + 2, static_cast<float>(small(rng)));  // integer minimum
        break;
      case GgmlType::kQ4_K:
      case GgmlType::kQ5_K: {
        uint8_t sc[8], mn[8];
        for (int j = 0; j < 8; ++j) {
          sc[j] = static_cast<uint8_t>(rng() % 4);
          mn[j] = static_cast<uint8_t>(rng() % 4);
        }
        pack_scale_min_k4(sc, mn, blk + 4);
        break;
      }
      case GgmlType::kQ6_K:
        for (int j = 0; j < 16; ++j)
          blk[192 + j] = static_cast<uint8_t>(static_cast<int8_t>(rng() % 9 - 4));
        break;
      case GgmlType::kIQ4_XS: {  // sub-block scales -2..2 (stored biased by 32)
        uint16_t high = 0;
        for (int j = 0; j < 8; ++j) {
          const int ls = 30 + static_cast<int>(rng() % 5);
          blk[4 + j / 2] = static_cast<uint8_t>((blk[4 + j / 2] & (0xF0 >> (4 * (j % 2)))) |
                                                ((ls & 0x0F) << (4 * (j % 2))));
          high = static_cast<uint16_t>(high | ((ls >> 4) << (2 * j)));
        }
        std::memcpy(blk + 2, &high, 2);
        break;
      }
      default:
        break;
    }
  }
  return out;
}

// Activations: kRealistic = normal values with a few outliers; kInteger = integers in
// [-127, 127] with a +-127 at the start of every 32 elements, so 8-bit quantisation (per 32 or
// 256 elements) reproduces them exactly.
std::vector<float> random_acts(int64_t n_tok, int64_t n_cols, Fill fill, std::mt19937& rng) {
  std::vector<float> x(static_cast<size_t>(n_tok * n_cols));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> q(-127, 127);
  for (int64_t i = 0; i < n_tok * n_cols; ++i) {
    if (fill == Fill::kInteger) {
      x[i] = (i % n_cols) % 32 == 0 ? ((rng() & 1) ? 127.0f : -127.0f) : static_cast<float>(q(rng));
    } else {
      x[i] = nd(rng) * ((rng() % 61 == 0) ? 8.0f : 1.0f);
    }
  }
  if (fill == Fill::kInteger) {
    // Q8_1 keeps d * sum(q) in fp16, exact for integers up to 2048: pull block sums into range.
    for (int64_t b = 0; b < n_tok * n_cols / 32; ++b) {
      float sum = 0;
      for (int i = 0; i < 32; ++i) sum += x[32 * b + i];
      for (int i = 1; i < 32 && std::fabs(sum) > 2000; ++i) {
        sum -= x[32 * b + i];
        x[32 * b + i] = 0;
      }
    }
  }
  return x;
}

// Independent reference: dequantise the GGUF rows with the reference dequantiser (not through
// QMatrix) and accumulate in double. Also returns, per output, a bound on the error that 8-bit
// activation quantisation like llama.cpp's can cause: each activation moves by at most half a
// step (amax / 254) of its block; for blocks of 32 the step itself is rounded to fp16 (another
// amax / 2048, or 127 * 2^-25 for subnormal steps, at most), and Q4_1's minimum multiplies the
// fp16-rounded sum s of the block (relative error 2^-10, of at most sum |q| = sum |x| * 127 / amax
// + 16).
struct Reference {
  std::vector<float> y;
  std::vector<double> quant_bound;
  std::vector<double> abs_sum;  // sum |W * x|
};
Reference reference(GgmlType type, const std::vector<uint8_t>& bytes, int64_t n_rows,
                    int64_t n_cols, const std::vector<float>& x, int64_t n_tok, int64_t act_block) {
  Reference ref;
  ref.y.resize(static_cast<size_t>(n_rows * n_tok));
  ref.quant_bound.resize(ref.y.size());
  ref.abs_sum.resize(ref.y.size());
  std::vector<float> row(static_cast<size_t>(n_cols));
  const int64_t row_bytes = ggml_row_bytes(type, n_cols);
  const double step_error = act_block == 32 ? 1.0 / 254 + 1.0 / 2048 : 1.0 / 254;
  // fp16 steps below the normal range are absolute (2^-25 at most per unit of q <= 127).
  const double half_floor = act_block == 32 ? 127 * std::ldexp(1.0, -25) : 0.0;
  for (int64_t r = 0; r < n_rows; ++r) {
    const uint8_t* src = bytes.data() + r * row_bytes;
    dequantize_row_ref(type, src, row.data(), n_cols);
    for (int64_t t = 0; t < n_tok; ++t) {
      const float* xt = x.data() + t * n_cols;
      double s = 0, bound = 0, abs_sum = 0;
      for (int64_t c0 = 0; c0 < n_cols; c0 += act_block) {
        double amax = 0, xsum = 0;
        for (int64_t c = c0; c < c0 + act_block && c < n_cols; ++c) {
          amax = std::max(amax, std::fabs(static_cast<double>(xt[c])));
          xsum += std::fabs(static_cast<double>(xt[c]));
        }
        for (int64_t c = c0; c < c0 + act_block && c < n_cols; ++c) {
          s += static_cast<double>(row[c]) * xt[c];
          bound += std::fabs(static_cast<double>(row[c])) * (amax * step_error + half_floor);
          abs_sum += std::fabs(static_cast<double>(row[c]) * xt[c]);
        }
        if (type == GgmlType::kQ4_1 && amax > 0) {
          uint16_t m;
          std::memcpy(&m, src + (c0 / 32) * 20 + 2, 2);
          bound += std::fabs(fp16_to_fp32(m)) * std::ldexp(1.0, -10) * (amax / 127) *
                   (xsum * 127 / amax + 16);
        }
      }
      ref.y[t * n_rows + r] = static_cast<float>(s);
      ref.quant_bound[t * n_rows + r] = bound;
      ref.abs_sum[t * n_rows + r] = abs_sum;
    }
  }
  return ref;
}

// Whether QMatrix repacks an [n, n_cols] matrix of type t (BF16 only for rows of even length).
bool is_packed_type(GgmlType t, int64_t n_cols) {
  if (t == GgmlType::kBF16) return n_cols % 2 == 0;
  return t == GgmlType::kQ4_0 || t == GgmlType::kQ4_1 || t == GgmlType::kQ5_0 ||
         t == GgmlType::kQ8_0 || t == GgmlType::kQ4_K || t == GgmlType::kQ5_K ||
         t == GgmlType::kQ6_K || t == GgmlType::kIQ4_NL || t == GgmlType::kIQ4_XS ||
         t == GgmlType::kQ3_K || t == GgmlType::kQ2_K;
}
int64_t act_block_of(GgmlType t) {
  return ggml_block_size(t) == 256 ? 256 : 32;
  return 32;
}

QMatrix make_matrix(GgmlType type, int64_t n_rows, int64_t n_cols,
                    const std::vector<uint8_t>& bytes) {
  auto m = QMatrix::from_gguf_bytes(type, n_rows, n_cols, bytes.data(), bytes.size());
  EXPECT_TRUE(m.ok()) << m.status().to_string();
  return std::move(m).value();
}

// Runs matmul at `isa` with x and y at a 1-float offset from 64-byte alignment.
std::vector<float> run_misaligned(const QMatrix& w, const std::vector<float>& x, int64_t n_tok,
                                  ThreadPool& pool, KernelIsa isa) {
  AlignedBuffer<float> xb(x.size() + 16), yb(static_cast<size_t>(w.n_rows() * n_tok) + 16);
  std::memcpy(xb.data() + 1, x.data(), x.size() * sizeof(float));
  for (size_t i = 0; i < yb.size(); ++i) yb[i] = -12345.0f;
  matmul_isa(w, xb.data() + 1, n_tok, yb.data() + 3, pool, isa);
  EXPECT_EQ(yb[2], -12345.0f) << "wrote before y";
  EXPECT_EQ(yb[3 + w.n_rows() * n_tok], -12345.0f) << "wrote past y";
  return std::vector<float>(yb.data() + 3, yb.data() + 3 + w.n_rows() * n_tok);
}

struct Shape {
  int64_t rows, cols;
};

std::vector<Shape> shapes_for(GgmlType type) {
  const int64_t bs = ggml_block_size(type);
  if (bs == 256) return {{1, 256}, {5, 512}, {17, 256}, {37, 768}};
  if (bs == 32) return {{1, 32}, {7, 96}, {17, 64}, {33, 576}, {67, 160}};
  return {{1, 1}, {5, 77}, {17, 64}, {23, 130}};
}

class MatmulType : public ::testing::TestWithParam<GgmlType> {};

// Every level vs the exact reference within the bound of 8-bit activation quantisation (or of
// fp32 rounding for the fp32 path), on odd shapes, token counts and misaligned pointers; and all
// integer-kernel levels bit-identical to each other.
// A matrix read a slice of rows at a time (QMatrix::from_gguf_rows, how a model loads) holds the
// same bytes as one made from all of its rows at once, for any slice, and a reader's error stops
// it.
TEST_P(MatmulType, RowSlicesPackAsTheWholeMatrix) {
  const GgmlType type = GetParam();
  std::mt19937 rng(99 + static_cast<int>(type));
  for (const Shape& s : shapes_for(type)) {
    const auto bytes = random_weights(type, s.rows, s.cols, Fill::kRealistic, rng);
    const QMatrix whole = make_matrix(type, s.rows, s.cols, bytes);
    for (int64_t slice : {int64_t{1}, int64_t{3}, int64_t{16}, s.rows + 5}) {
      SCOPED_TRACE(std::to_string(s.rows) + "x" + std::to_string(s.cols) + ", slice " +
                   std::to_string(slice));
      std::vector<std::pair<uint64_t, uint64_t>> reads;
      auto m = QMatrix::from_gguf_rows(type, s.rows, s.cols, slice,
                                       [&](uint64_t offset, uint64_t n, uint8_t* dst) {
                                         reads.push_back({offset, n});
                                         std::memcpy(dst, bytes.data() + offset, n);
                                         return Status();
                                       });
      ASSERT_TRUE(m.ok()) << m.status().to_string();
      ASSERT_EQ(m->bytes(), whole.bytes());
      EXPECT_EQ(std::memcmp(m->data(), whole.data(), whole.bytes()), 0);
      // Whole rows, in order, each read once, none past the matrix's bytes.
      uint64_t next = 0;
      for (const auto& [offset, n] : reads) {
        EXPECT_EQ(offset, next);
        next += n;
      }
      EXPECT_EQ(next, bytes.size());
    }
    auto failed = QMatrix::from_gguf_rows(
        type, s.rows, s.cols, 1,
        [](uint64_t, uint64_t, uint8_t*) { return io_error("the file went away"); });
    ASSERT_FALSE(failed.ok());
    EXPECT_NE(failed.status().message().find("went away"), std::string::npos);
  }
}

TEST_P(MatmulType, MatchesReferenceOnRandomMatrices) {
  const GgmlType type = GetParam();
  std::mt19937 rng(1234 + static_cast<int>(type));
  ThreadPool pool(2);
  for (const Shape& s : shapes_for(type)) {
    const auto bytes = random_weights(type, s.rows, s.cols, Fill::kRealistic, rng);
    const QMatrix w = make_matrix(type, s.rows, s.cols, bytes);
    for (int64_t n_tok : {1, 2, 3, 5, 17}) {
      const auto x = random_acts(n_tok, s.cols, Fill::kRealistic, rng);
      const Reference ref = reference(type, bytes, s.rows, s.cols, x, n_tok, act_block_of(type));
      std::vector<float> first;
      for (KernelIsa isa : test::available_isas()) {
        const std::vector<float> y = run_misaligned(w, x, n_tok, pool, isa);
        for (size_t i = 0; i < y.size(); ++i) {
          // fp32 rounding of the accumulation (a generous n * 2^-23 of sum |w x|) plus, for the
          // integer kernels, the activation quantisation bound.
          double tol = 2.4e-7 * static_cast<double>(s.cols) * ref.abs_sum[i] + 1e-6;
          if (is_packed_type(type, s.cols))
            tol += 1.001 * ref.quant_bound[i] + 1e-5 * ref.abs_sum[i];
          ASSERT_NEAR(y[i], ref.y[i], tol)
              << ggml_type_name(type) << " " << kernel_isa_name(isa) << " shape [" << s.rows << ", "
              << s.cols << "] n_tok " << n_tok << " output " << i;
        }
        if (!is_packed_type(type, s.cols)) continue;
        if (first.empty()) {
          first = y;
        } else {
          for (size_t i = 0; i < y.size(); ++i) {
            ASSERT_EQ(fp32_to_bits(y[i]), fp32_to_bits(first[i]))
                << "levels disagree: " << kernel_isa_name(isa) << " output " << i;
          }
        }
      }
    }
  }
}

// Integer weights and activations that 8-bit quantisation reproduces exactly: every level must
// equal the reference exactly (a wrong nibble, bit or scale anywhere shows up as a mismatch).
TEST_P(MatmulType, ExactWhenArithmeticIsExact) {
  const GgmlType type = GetParam();
  std::mt19937 rng(99 + static_cast<int>(type));
  ThreadPool pool(1);
  for (const Shape& s : shapes_for(type)) {
    const auto bytes = random_weights(type, s.rows, s.cols, Fill::kInteger, rng);
    const QMatrix w = make_matrix(type, s.rows, s.cols, bytes);
    const int64_t n_tok = 5;
    const auto x = random_acts(n_tok, s.cols, Fill::kInteger, rng);
    const Reference ref = reference(type, bytes, s.rows, s.cols, x, n_tok, act_block_of(type));
    for (KernelIsa isa : test::available_isas()) {
      const std::vector<float> y = run_misaligned(w, x, n_tok, pool, isa);
      for (size_t i = 0; i < y.size(); ++i) {
        ASSERT_EQ(y[i], ref.y[i]) << ggml_type_name(type) << " " << kernel_isa_name(isa)
                                  << " shape [" << s.rows << ", " << s.cols << "] output " << i;
      }
    }
  }
}

// Thread counts 1, 2, 3 and single-token calls give bit-identical results; so do long prompts
// that are cut into several token chunks.
TEST_P(MatmulType, DeterministicAcrossThreadsAndGrouping) {
  const GgmlType type = GetParam();
  std::mt19937 rng(7 + static_cast<int>(type));
  const int64_t bs = ggml_block_size(type);
  const int64_t n_rows = 83, n_cols = bs == 256 ? 512 : (bs == 32 ? 192 : 101), n_tok = 131;
  const auto bytes = random_weights(type, n_rows, n_cols, Fill::kRealistic, rng);
  const QMatrix w = make_matrix(type, n_rows, n_cols, bytes);
  const auto x = random_acts(n_tok, n_cols, Fill::kRealistic, rng);
  for (KernelIsa isa : test::available_isas()) {
    std::vector<float> base;
    for (int threads : {1, 2, 3}) {
      ThreadPool pool(threads);
      std::vector<float> y(static_cast<size_t>(n_rows * n_tok));
      matmul_isa(w, x.data(), n_tok, y.data(), pool, isa);
      if (base.empty()) {
        base = y;
        continue;
      }
      ASSERT_EQ(0, std::memcmp(y.data(), base.data(), y.size() * sizeof(float)))
          << kernel_isa_name(isa) << " with " << threads << " threads";
    }
    // One token at a time (matvec) equals the batched result.
    ThreadPool pool(2);
    std::vector<float> one(static_cast<size_t>(n_rows));
    for (int64_t t = 0; t < n_tok; t += 13) {
      matmul_isa(w, x.data() + t * n_cols, 1, one.data(), pool, isa);
      ASSERT_EQ(0, std::memcmp(one.data(), base.data() + t * n_rows, one.size() * sizeof(float)))
          << kernel_isa_name(isa) << " token " << t;
    }
  }
}

// get_row gives the reference dequantisation of the original GGUF row, bit for bit, also from
// the repacked layouts; matmul_ref equals the independent double-precision product.
TEST_P(MatmulType, GetRowAndReference) {
  const GgmlType type = GetParam();
  std::mt19937 rng(5 + static_cast<int>(type));
  const Shape s = shapes_for(type).back();
  const auto bytes = random_weights(type, s.rows, s.cols, Fill::kRealistic, rng);
  const QMatrix w = make_matrix(type, s.rows, s.cols, bytes);
  EXPECT_EQ(w.type(), type);
  EXPECT_EQ(w.n_rows(), s.rows);
  EXPECT_EQ(w.n_cols(), s.cols);
  EXPECT_EQ(w.packed(), is_packed_type(type, s.cols));
  EXPECT_GE(w.bytes(), bytes.size());
  EXPECT_LE(w.bytes(), bytes.size() * 11 / 10 + 16 * 4096) << "packed layout overhead too large";
  const int64_t row_bytes = ggml_row_bytes(type, s.cols);
  std::vector<float> got(s.cols), want(s.cols);
  for (int64_t r = 0; r < s.rows; ++r) {
    w.get_row(r, got.data());
    dequantize_row_ref(type, bytes.data() + r * row_bytes, want.data(), s.cols);
    ASSERT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float))) << "row " << r;
  }
  const int64_t n_tok = 3;
  const auto x = random_acts(n_tok, s.cols, Fill::kRealistic, rng);
  std::vector<float> y(static_cast<size_t>(s.rows * n_tok));
  matmul_ref(w, x.data(), n_tok, y.data());
  const Reference ref = reference(type, bytes, s.rows, s.cols, x, n_tok, 32);
  ASSERT_EQ(0, std::memcmp(y.data(), ref.y.data(), y.size() * sizeof(float)));
}

INSTANTIATE_TEST_SUITE_P(AllTypes, MatmulType,
                         ::testing::Values(GgmlType::kF32, GgmlType::kF16, GgmlType::kBF16,
                                           GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ5_0,
                                           GgmlType::kQ5_1, GgmlType::kQ8_0, GgmlType::kQ2_K,
                                           GgmlType::kQ3_K, GgmlType::kQ4_K, GgmlType::kQ5_K,
                                           GgmlType::kQ6_K, GgmlType::kIQ4_NL, GgmlType::kIQ4_XS),
                         [](const ::testing::TestParamInfo<GgmlType>& p) {
                           return ggml_type_name(p.param);
                         });

// Activations at the edges of the quantiser: all zeros, one huge value (the fp16 sum of Q8_1
// would overflow), exact rounding ties, tiny values (fp16 scale underflows). Levels agree bit for
// bit, stay finite and within the quantisation bound.
TEST(Matmul, ActivationEdgeCases) {
  std::mt19937 rng(31);
  ThreadPool pool(2);
  for (GgmlType type : {GgmlType::kQ4_1, GgmlType::kQ5_0, GgmlType::kQ8_0, GgmlType::kQ6_K,
                        GgmlType::kIQ4_NL, GgmlType::kIQ4_XS, GgmlType::kBF16}) {
    const int64_t n_rows = 19, n_cols = 512, n_tok = 4;
    const auto bytes = random_weights(type, n_rows, n_cols, Fill::kRealistic, rng);
    const QMatrix w = make_matrix(type, n_rows, n_cols, bytes);
    std::vector<float> x(static_cast<size_t>(n_tok * n_cols), 0.0f);  // token 0: zeros
    for (int64_t c = 0; c < n_cols; ++c) {
      x[n_cols + c] = c == 100 ? 1e6f : 1e-3f;  // token 1: one outlier
      // token 2: amax 127 (scale 1), so x * 127 / amax = x hits exact ties: round to even.
      x[2 * n_cols + c] = c % 32 == 0 ? 127.0f : (c % 2 ? 2.5f : -3.5f);
      x[3 * n_cols + c] = 1e-30f * static_cast<float>(c % 7);  // token 3: tiny (fp16 step 0)
    }
    const Reference ref = reference(type, bytes, n_rows, n_cols, x, n_tok, act_block_of(type));
    std::vector<float> first;
    for (KernelIsa isa : test::available_isas()) {
      std::vector<float> y(static_cast<size_t>(n_rows * n_tok));
      matmul_isa(w, x.data(), n_tok, y.data(), pool, isa);
      for (int64_t r = 0; r < n_rows; ++r) EXPECT_EQ(y[r], 0.0f);
      for (size_t i = 0; i < y.size(); ++i) {
        ASSERT_TRUE(std::isfinite(y[i])) << i;
        ASSERT_NEAR(y[i], ref.y[i], 1.001 * ref.quant_bound[i] + 1e-5 * ref.abs_sum[i] + 1e-30)
            << i;
      }
      if (first.empty()) first = y;
      ASSERT_EQ(0, std::memcmp(y.data(), first.data(), y.size() * sizeof(float)))
          << kernel_isa_name(isa);
    }
  }
}

// The largest integer sums the kernels can meet: every weight at the top (or bottom) of its
// range times activations of +-127 (scale 1, so the result is exact in float). The AVX2 kernels
// keep partial sums of these in int16; any overflow there would show as a wrong result.
TEST(Matmul, ExtremeQuantsAreExact) {
  ThreadPool pool(2);
  for (GgmlType type : {GgmlType::kQ4_0, GgmlType::kQ5_0, GgmlType::kIQ4_NL}) {
    const int64_t n_rows = 21, n_cols = 256, n_tok = 4;
    const int64_t block_bytes = ggml_row_bytes(type, 32);
    for (uint8_t fill : {uint8_t{0xFF}, uint8_t{0x00}}) {
      std::vector<uint8_t> bytes(static_cast<size_t>(ggml_row_bytes(type, n_cols) * n_rows), fill);
      for (size_t off = 0; off < bytes.size(); off += static_cast<size_t>(block_bytes))
        put_half(bytes.data() + off, 1.0f);
      const QMatrix w = make_matrix(type, n_rows, n_cols, bytes);
      std::vector<float> x(static_cast<size_t>(n_tok * n_cols));
      for (int64_t c = 0; c < n_cols; ++c) {
        x[c] = 127.0f;
        x[n_cols + c] = -127.0f;
        x[2 * n_cols + c] = c % 2 ? 127.0f : -127.0f;
        x[3 * n_cols + c] = (c / 16) % 2 ? 127.0f : -127.0f;
      }
      const Reference ref = reference(type, bytes, n_rows, n_cols, x, n_tok, 32);
      for (KernelIsa isa : test::available_isas()) {
        std::vector<float> y(static_cast<size_t>(n_rows * n_tok));
        matmul_isa(w, x.data(), n_tok, y.data(), pool, isa);
        for (size_t i = 0; i < y.size(); ++i) {
          ASSERT_EQ(y[i], ref.y[i]) << ggml_type_name(type) << " fill " << int{fill} << " "
                                    << kernel_isa_name(isa) << " output " << i;
        }
      }
    }
  }
}

// Several products in one call (shared and separate x, packed and fp32-path types) equal the
// separate calls bit for bit, at every level and thread count.
TEST(Matmul, ManyEqualsSeparateCalls) {
  std::mt19937 rng(77);
  struct Spec {
    GgmlType type;
    int64_t rows, cols;
    int x_index;
  };
  const Spec specs[] = {{GgmlType::kQ4_1, 83, 256, 0}, {GgmlType::kQ4_1, 40, 256, 0},
                        {GgmlType::kF16, 30, 256, 0},  {GgmlType::kQ6_K, 21, 256, 0},
                        {GgmlType::kQ8_0, 17, 512, 1}, {GgmlType::kQ4_K, 9, 512, 1},
                        {GgmlType::kQ5_0, 35, 512, 1}, {GgmlType::kQ5_0, 18, 256, 0}};
  for (int64_t n_tok : {1, 6, 70}) {
    std::vector<std::vector<float>> xs = {random_acts(n_tok, 256, Fill::kRealistic, rng),
                                          random_acts(n_tok, 512, Fill::kRealistic, rng)};
    std::vector<QMatrix> ws;
    for (const Spec& sp : specs) {
      ws.push_back(make_matrix(sp.type, sp.rows, sp.cols,
                               random_weights(sp.type, sp.rows, sp.cols, Fill::kRealistic, rng)));
    }
    for (KernelIsa isa : test::available_isas()) {
      for (int threads : {1, 3}) {
        ThreadPool pool(threads);
        std::vector<std::vector<float>> many(ws.size()), single(ws.size());
        std::vector<MatmulCall> calls;
        for (size_t i = 0; i < ws.size(); ++i) {
          many[i].assign(static_cast<size_t>(ws[i].n_rows() * n_tok), -1.0f);
          single[i].assign(many[i].size(), -2.0f);
          calls.push_back({&ws[i], xs[specs[i].x_index].data(), many[i].data()});
          matmul_isa(ws[i], xs[specs[i].x_index].data(), n_tok, single[i].data(), pool, isa);
        }
        matmul_many_isa(calls, n_tok, pool, isa);
        for (size_t i = 0; i < ws.size(); ++i) {
          ASSERT_EQ(0,
                    std::memcmp(many[i].data(), single[i].data(), many[i].size() * sizeof(float)))
              << "call " << i << " " << kernel_isa_name(isa) << " threads " << threads << " n_tok "
              << n_tok;
        }
      }
    }
  }
}

// llama.cpp's own product (ggml_mul_mat; fixtures made by scripts/setup.sh --test-data with
// scripts/gen_matmul_fixtures.py into <cache>/test-data/matmul, or $D2O_MATMUL_DIR): d2o must
// reproduce it up to float summation order, i.e. quantise activations exactly like llama.cpp.
// Both differ from the exact product by far more than they differ from each other.
class LlamaCppMatmul : public ::testing::TestWithParam<const char*> {};

TEST_P(LlamaCppMatmul, ReproducesGgmlMulMat) {
  const std::string dir = test::test_data_dir("D2O_MATMUL_DIR", "matmul");
  if (!std::filesystem::is_directory(dir)) {
    GTEST_SKIP() << "no matmul references in " << dir
                 << " (scripts/setup.sh --test-data makes them)";
  }
  const std::string path = dir + "/matmul_" + GetParam() + ".bin";
  std::FILE* f = std::fopen(path.c_str(), "rb");
  ASSERT_NE(f, nullptr) << "missing " << path << " (scripts/setup.sh --test-data)";
  char magic[4];
  uint32_t h[5];
  ASSERT_EQ(std::fread(magic, 1, 4, f), 4u);
  ASSERT_EQ(std::fread(h, 4, 5, f), 5u);
  ASSERT_EQ(std::memcmp(magic, "D2OM", 4), 0);
  ASSERT_EQ(h[0], 1u);
  const auto type = static_cast<GgmlType>(h[1]);
  const int64_t n_rows = h[2], n_cols = h[3], n_tok = h[4];
  std::vector<uint8_t> bytes(static_cast<size_t>(ggml_row_bytes(type, n_cols) * n_rows));
  std::vector<float> x(static_cast<size_t>(n_tok * n_cols)),
      want(static_cast<size_t>(n_tok * n_rows));
  ASSERT_EQ(std::fread(bytes.data(), 1, bytes.size(), f), bytes.size());
  ASSERT_EQ(std::fread(x.data(), 4, x.size(), f), x.size());
  ASSERT_EQ(std::fread(want.data(), 4, want.size(), f), want.size());
  std::fclose(f);

  const QMatrix w = make_matrix(type, n_rows, n_cols, bytes);
  const Reference exact = reference(type, bytes, n_rows, n_cols, x, n_tok, act_block_of(type));
  ThreadPool pool(2);
  for (KernelIsa isa : test::available_isas()) {
    const std::vector<float> y = run_misaligned(w, x, n_tok, pool, isa);
    double max_vs_ggml = 0, max_vs_exact = 0;
    for (size_t i = 0; i < y.size(); ++i) {
      ASSERT_NEAR(y[i], want[i], 1e-5 * exact.abs_sum[i] + 1e-6)
          << GetParam() << " " << kernel_isa_name(isa) << " output " << i;
      max_vs_ggml = std::max(max_vs_ggml, static_cast<double>(std::fabs(y[i] - want[i])));
      max_vs_exact = std::max(max_vs_exact, static_cast<double>(std::fabs(y[i] - exact.y[i])));
    }
    EXPECT_LT(max_vs_ggml, 0.01 * max_vs_exact) << GetParam() << " " << kernel_isa_name(isa);
  }
}

INSTANTIATE_TEST_SUITE_P(PackedTypes, LlamaCppMatmul,
                         ::testing::Values("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K",
                                           "IQ4_NL", "IQ4_XS", "BF16", "Q3_K", "Q2_K"),
                         [](const ::testing::TestParamInfo<const char*>& p) {
                           return std::string(p.param);
                         });

TEST(Matmul, FromGgufBytesRejectsBadInput) {
  std::vector<uint8_t> bytes(4096);
  auto bad_type = QMatrix::from_gguf_bytes(GgmlType::kIQ2_XXS, 1, 256, bytes.data(), 66);
  ASSERT_FALSE(bad_type.ok());
  EXPECT_EQ(bad_type.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(bad_type.status().message().find("IQ2_XXS"), std::string::npos);
  for (GgmlType t :
       {GgmlType::kQ8_K, GgmlType::kI32, GgmlType::kTQ1_0, static_cast<GgmlType>(77)}) {
    auto m = QMatrix::from_gguf_bytes(t, 1, 256, bytes.data(), 256);
    ASSERT_FALSE(m.ok());
    EXPECT_EQ(m.status().code(), StatusCode::kUnsupported);
  }
  auto not_multiple = QMatrix::from_gguf_bytes(GgmlType::kQ4_K, 2, 128, bytes.data(), 144);
  ASSERT_FALSE(not_multiple.ok());
  EXPECT_EQ(not_multiple.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(not_multiple.status().message().find("block size"), std::string::npos);
  auto wrong_size = QMatrix::from_gguf_bytes(GgmlType::kQ4_1, 2, 64, bytes.data(), 79);
  ASSERT_FALSE(wrong_size.ok());
  EXPECT_EQ(wrong_size.status().code(), StatusCode::kInvalidArgument);
  auto zero_rows = QMatrix::from_gguf_bytes(GgmlType::kF32, 0, 4, bytes.data(), 0);
  EXPECT_FALSE(zero_rows.ok());
  auto negative = QMatrix::from_gguf_bytes(GgmlType::kF32, 4, -4, bytes.data(), 64);
  EXPECT_FALSE(negative.ok());
  auto huge = QMatrix::from_gguf_bytes(GgmlType::kF32, int64_t{1} << 39, int64_t{1} << 39,
                                       bytes.data(), 64);
  EXPECT_FALSE(huge.ok());
  auto null_data = QMatrix::from_gguf_bytes(GgmlType::kF32, 1, 4, nullptr, 16);
  EXPECT_FALSE(null_data.ok());
  auto fine = QMatrix::from_gguf_bytes(GgmlType::kQ4_1, 2, 64, bytes.data(), 80);
  EXPECT_TRUE(fine.ok()) << fine.status().to_string();
}

// D2O_FORCE_SCALAR=1 selects the scalar kernels (ctest runs this test again with the variable
// set; without it the test only checks that the best level is available).
TEST(KernelIsa, ForceScalarSelectsScalar) {
  const char* force = std::getenv("D2O_FORCE_SCALAR");
  if (force != nullptr && std::string(force) == "1") {
    EXPECT_EQ(best_kernel_isa(), KernelIsa::kScalar);
    EXPECT_FALSE(kernel_isa_available(KernelIsa::kAvx2));
  } else {
    EXPECT_TRUE(kernel_isa_available(best_kernel_isa()));
  }
  std::printf("kernel level: %s\n", kernel_isa_name(best_kernel_isa()));
}

// D2O_MAX_ISA caps the level (ctest runs this test again with D2O_MAX_ISA=avx2).
TEST(KernelIsa, MaxIsaCapsTheLevel) {
  const char* cap = std::getenv("D2O_MAX_ISA");
  if (cap != nullptr && std::string(cap) == "avx2") {
    EXPECT_FALSE(kernel_isa_available(KernelIsa::kAvx512));
    EXPECT_NE(best_kernel_isa(), KernelIsa::kAvx512);
  }
  CpuFeatures all;
  all.avx2 = all.fma = all.f16c = true;
  all.avx512f = all.avx512bw = all.avx512vl = all.avx512vnni = all.avx512bf16 = true;
  all.avxvnni = true;
  const CpuFeatures none = cap_features(all, nullptr);
  EXPECT_TRUE(none.avx512f && none.avx512vnni && none.avxvnni);
  const CpuFeatures top = cap_features(all, "avx512");
  EXPECT_TRUE(top.avx512f && top.avx512bw && top.avx512vl && top.avx512vnni && top.avx512bf16);
  const CpuFeatures two = cap_features(all, "avx2");
  EXPECT_TRUE(two.avx2 && two.fma && two.f16c);
  EXPECT_FALSE(two.avx512f || two.avx512bw || two.avx512vl || two.avx512vnni || two.avx512bf16);
  EXPECT_FALSE(two.avxvnni);  // an AVX2-only CPU such as Zen 3 has no AVX-VNNI either
  const CpuFeatures scalar = cap_features(all, "scalar");
  EXPECT_FALSE(scalar.avx2 || scalar.fma || scalar.f16c || scalar.avx512f);
  testing::internal::CaptureStderr();
  const CpuFeatures bad = cap_features(all, "avx-2");
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_FALSE(bad.avx2 || bad.avx512f);  // an unknown level caps at scalar, and says so
  EXPECT_NE(err.find("D2O_MAX_ISA='avx-2'"), std::string::npos) << err;
}

}  // namespace
}  // namespace d2o
