// KV storage in GGUF's Q8_0 / Q4_0 blocks: the quantisers are bit-identical to the `gguf` PyPI
// package (fixtures made by scripts/gen_quant_fixtures.py into <cache>/test-data/quant or
// $D2O_QUANT_DIR; skipped when absent); --kv-type parsing; byte counts; attention over quantised
// slots equals attention over their dequantised values (every instruction-set level, MHA / GQA /
// MQA, slot counts that are not a multiple of the tile); every policy preset runs on quantised
// caches and agrees with the naive reference within the quantisation step; a merge writes the
// quantisation of the merged dequantised rows.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/quant_fixture.h"
#include "common/test_util.h"
#include "core/fp16.h"
#include "core/thread_pool.h"
#include "kv/attention.h"
#include "kv/kv_cache.h"
#include "ops/kernel_isa.h"
#include "ops/quant.h"
#include "unit/policy_sim.h"

namespace d2o {
namespace {

using test::quant_dir;

struct QuantizeFixture {
  GgmlType type = GgmlType::kF32;
  std::vector<float> x;
  std::vector<uint8_t> expected;
};

// Reads <quant_dir>/quantize_<name>.bin (layout documented in the generator script).
bool load_quantize_fixture(const std::string& name, QuantizeFixture* f, std::string* error) {
  const std::string path = quant_dir() + "/quantize_" + name + ".bin";
  std::ifstream in;
  uint32_t type = 0, n_a = 0, n_b = 0;
  if (!test::open_quant_fixture(path, &in, &type, &n_a, &n_b, error)) return false;
  f->type = static_cast<GgmlType>(type);
  f->x.resize(n_a);
  f->expected.resize(n_b);
  in.read(reinterpret_cast<char*>(f->x.data()), static_cast<std::streamsize>(f->x.size() * 4));
  in.read(reinterpret_cast<char*>(f->expected.data()),
          static_cast<std::streamsize>(f->expected.size()));
  if (!in || f->x.size() % kQK != 0 ||
      ggml_row_bytes(f->type, static_cast<int64_t>(f->x.size())) !=
          static_cast<int64_t>(f->expected.size())) {
    *error = path + ": truncated or inconsistent";
    return false;
  }
  return true;
}

class QuantizeGguf : public ::testing::TestWithParam<const char*> {};

// The quantiser itself, and the rows a KV cache stores through append(), equal the package's
// blocks byte for byte.
TEST_P(QuantizeGguf, BitIdenticalToGgufPackage) {
  if (!std::filesystem::exists(quant_dir() + "/quantize_" + GetParam() + ".bin")) {
    GTEST_SKIP() << "no quantisation references in " << quant_dir()
                 << " (scripts/setup.sh --test-data makes them)";
  }
  QuantizeFixture f;
  std::string error;
  ASSERT_TRUE(load_quantize_fixture(GetParam(), &f, &error)) << error;
  const int64_t n = static_cast<int64_t>(f.x.size());
  const size_t block = f.expected.size() / (f.x.size() / kQK);
  std::vector<uint8_t> got(f.expected.size());
  quantize_row(f.type, f.x.data(), got.data(), n);
  for (size_t b = 0; b < got.size() / block; ++b) {
    ASSERT_EQ(0, std::memcmp(got.data() + b * block, f.expected.data() + b * block, block))
        << "block " << b;
  }
  // Through the cache: rows of 64 elements, one head, one token per row.
  const KvElemType t = f.type == GgmlType::kQ8_0 ? KvElemType::kQ8_0 : KvElemType::kQ4_0;
  const int hd = 64, n_tok = static_cast<int>(n / hd);
  ASSERT_EQ(n % hd, 0);
  KvCache cache(KvCacheConfig{1, 1, hd, KvType{t, t}});
  ASSERT_TRUE(cache.reserve(0, n_tok, true).ok());
  std::vector<int32_t> pos(static_cast<size_t>(n_tok), 0);
  cache.append(0, f.x.data(), f.x.data(), pos.data(), n_tok);
  const KvLayer& L = cache.layer(0);
  EXPECT_EQ(0, std::memcmp(L.key_row(0, 0), f.expected.data(), f.expected.size()));
  EXPECT_EQ(0, std::memcmp(L.value_row(0, 0), f.expected.data(), f.expected.size()));
}

INSTANTIATE_TEST_SUITE_P(KvTypes, QuantizeGguf, ::testing::Values("Q8_0", "Q4_0"));

// Without the fixtures: a quantised row dequantises to within half a step (Q8_0) / one step
// (Q4_0) of the input, a zero block stays zero.
TEST(KvQuant, RoundTripWithinTheStep) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(8 * kQK), y(x.size());
  for (float& v : x) v = 3.0f * nd(rng);
  std::fill_n(x.begin(), kQK, 0.0f);
  for (GgmlType type : {GgmlType::kQ8_0, GgmlType::kQ4_0}) {
    const int64_t n = static_cast<int64_t>(x.size());
    std::vector<uint8_t> q(static_cast<size_t>(ggml_row_bytes(type, n)));
    quantize_row(type, x.data(), q.data(), static_cast<int64_t>(x.size()));
    dequantize_row(type, q.data(), y.data(), static_cast<int64_t>(x.size()));
    for (size_t b = 0; b < x.size() / kQK; ++b) {
      float amax = 0.0f;
      for (int j = 0; j < kQK; ++j) amax = std::max(amax, std::fabs(x[b * kQK + j]));
      const float step = type == GgmlType::kQ8_0 ? amax / 127.0f : amax / 8.0f;
      const float tol = (type == GgmlType::kQ8_0 ? 0.5f : 1.0f) * step * 1.01f;
      for (int j = 0; j < kQK; ++j) {
        ASSERT_LE(std::fabs(y[b * kQK + j] - x[b * kQK + j]), tol) << b << "," << j;
      }
    }
    for (int j = 0; j < kQK; ++j) EXPECT_EQ(y[static_cast<size_t>(j)], 0.0f);
  }
}

// Q8_0's rounding is std::round's (half away from zero) for every value it meets, on every
// instruction-set level: halves of each sign (blocks whose amax is 127 make x * id = x exactly),
// values a hair either side of them, and random rows; a block holding a NaN or an infinity is
// quantised as the library rounds it, and the blocks after it as before.
TEST(KvQuant, Q8RoundsHalvesAwayFromZeroAsTheLibrary) {
  auto reference = [](const float* x, BlockQ8_0* y, int64_t n) {
    for (int64_t i = 0; i < n / kQK; ++i, x += kQK) {
      float amax = 0.0f;
      for (int j = 0; j < kQK; ++j) amax = std::max(amax, std::fabs(x[j]));
      const float d = amax / 127.0f;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      y[i].d = fp32_to_fp16(d);
      for (int j = 0; j < kQK; ++j) y[i].qs[j] = static_cast<int8_t>(std::round(x[j] * id));
    }
  };
  std::vector<float> x;
  for (int k = -127; k <= 126; ++k) {  // every half between the steps, and beside it
    const float h = static_cast<float>(k) + 0.5f;
    x.push_back(h);
    x.push_back(std::nextafter(h, 0.0f));
    x.push_back(std::nextafter(h, h > 0 ? 200.0f : -200.0f));
  }
  while (x.size() % kQK != kQK - 1) x.push_back(0.25f);
  x.push_back(127.0f);  // the last block's amax too
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int i = 0; i < 64 * kQK; ++i) x.push_back(nd(rng) * (i % 3 == 0 ? 1e-3f : 4.0f));
  for (size_t b = 0; b + kQK <= x.size(); b += kQK) x[b] = 127.0f;       // amax 127: id exactly 1
  for (size_t b = kQK * 20; b + kQK <= x.size(); b += kQK) x[b] = 1.0f;  // then random amax
  const int64_t n = static_cast<int64_t>(x.size());
  std::vector<BlockQ8_0> got(static_cast<size_t>(n / kQK)), want(got.size());
  reference(x.data(), want.data(), n);
  for (KernelIsa isa : {KernelIsa::kScalar, KernelIsa::kAvx2, KernelIsa::kAvx512}) {
    if (!kernel_isa_available(isa)) continue;
    SCOPED_TRACE(kernel_isa_name(isa));
    quantize_row_q8_0_isa(isa, x.data(), got.data(), n);
    for (size_t b = 0; b < got.size(); ++b) {
      ASSERT_EQ(got[b].d, want[b].d) << "block " << b;
      for (int j = 0; j < kQK; ++j)
        ASSERT_EQ(got[b].qs[j], want[b].qs[j]) << "block " << b << " value " << x[b * kQK + j];
    }
  }
  quantize_row_q8_0(x.data(), got.data(), n);
  // The first block (amax 127, so x * id = x): -125.5 -> -126 (away from zero, not to the even
  // neighbour), a hair inside it -> -125, a hair beyond -126.5 -> -127.
  EXPECT_EQ(got[0].qs[3], -126);
  EXPECT_EQ(got[0].qs[4], -125);
  EXPECT_EQ(got[0].qs[2], -127);
  // A block with a NaN, one with an infinity, between finite ones: those two take the library
  // path (the same bytes as the reference), the blocks after them the row's own.
  std::vector<float> bad(5 * kQK);
  for (float& v : bad) v = nd(rng);
  bad[kQK + 3] = std::numeric_limits<float>::quiet_NaN();
  bad[3 * kQK + 7] = std::numeric_limits<float>::infinity();
  std::vector<BlockQ8_0> w(5);
  reference(bad.data(), w.data(), 5 * kQK);
  for (KernelIsa isa : {KernelIsa::kScalar, KernelIsa::kAvx2, KernelIsa::kAvx512}) {
    if (!kernel_isa_available(isa)) continue;
    SCOPED_TRACE(kernel_isa_name(isa));
    std::vector<BlockQ8_0> g(5);
    quantize_row_q8_0_isa(isa, bad.data(), g.data(), 5 * kQK);
    for (int b = 0; b < 5; ++b) {
      EXPECT_EQ(g[b].d, w[b].d) << b;
      if (b == 1 || b == 3) continue;  // (a NaN's or infinity's int8 is the library's business)
      for (int j = 0; j < kQK; ++j) EXPECT_EQ(g[b].qs[j], w[b].qs[j]) << b << "," << j;
    }
  }
}

TEST(KvQuant, ParsesAndNamesTypes) {
  struct Ok {
    const char* s;
    KvType t;
    const char* name;
  };
  const KvElemType f16 = KvElemType::kF16, q8 = KvElemType::kQ8_0, q4 = KvElemType::kQ4_0;
  for (const Ok& c : {Ok{"f16", KvType::kF16, "f16"}, Ok{"f32", KvType::kF32, "f32"},
                      Ok{"q8_0", KvType::kQ8_0, "q8_0"}, Ok{"q4_0", KvType::kQ4_0, "q4_0"},
                      Ok{"k:q8_0,v:q4_0", KvType{q8, q4}, "k:q8_0,v:q4_0"},
                      Ok{"v:q4_0,k:q8_0", KvType{q8, q4}, "k:q8_0,v:q4_0"},
                      Ok{"k:q4_0", KvType{q4, f16}, "k:q4_0,v:f16"},
                      Ok{"k:q8_0,v:q8_0", KvType::kQ8_0, "q8_0"}}) {
    auto t = parse_kv_type(c.s);
    ASSERT_TRUE(t.ok()) << c.s << ": " << t.status().message();
    EXPECT_TRUE(*t == c.t) << c.s;
    EXPECT_STREQ(kv_type_name(*t), c.name);
  }
  for (const char* bad : {"", "q5_0", "F16", "k:", "k:q8_0,", "k:q8_0,k:f16", "x:f16",
                          "k:q8_0;v:f16", "q8_0,v:f16", ",", "k:q8_0,v:q4_0,v:f16"}) {
    auto t = parse_kv_type(bad);
    EXPECT_FALSE(t.ok()) << "'" << bad << "' accepted";
    if (!t.ok()) {
      EXPECT_FALSE(t.status().message().empty());
    }
  }
}

TEST(KvQuant, RefusesHeadDimNotMultipleOf32) {
  EXPECT_TRUE(check_kv_type(KvType::kQ8_0, 64).ok());
  EXPECT_TRUE(check_kv_type(KvType::kF16, 48).ok());
  for (KvType t : {KvType::kQ8_0, KvType::kQ4_0, KvType{KvElemType::kF16, KvElemType::kQ4_0}}) {
    const Status s = check_kv_type(t, 48);
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.message().find("48"), std::string::npos) << s.message();
  }
}

// Every byte figure counts the real rows: 34 bytes per 32 elements (Q8_0), 18 (Q4_0).
TEST(KvQuant, ByteFiguresCountQuantisedRows) {
  const int layers = 3, G = 2, hd = 64, n = 40;
  const size_t meta = 20;  // pos, score, window, merged, row per slot and head
  const KvElemType q8 = KvElemType::kQ8_0, q4 = KvElemType::kQ4_0;
  for (KvType t : {KvType::kQ8_0, KvType::kQ4_0, KvType{q8, q4}, KvType{KvElemType::kF16, q4}}) {
    SCOPED_TRACE(kv_type_name(t));
    const size_t row = kv_row_bytes(t.k, hd) + kv_row_bytes(t.v, hd);
    EXPECT_EQ(kv_row_bytes(KvElemType::kQ8_0, hd), 68u);
    EXPECT_EQ(kv_row_bytes(KvElemType::kQ4_0, hd), 36u);
    const KvCacheConfig cfg{layers, G, hd, t};
    EXPECT_EQ(KvCache::bytes_for_slots(cfg, n), size_t{layers} * G * n * (row + meta));
    KvCache cache(cfg);
    EXPECT_EQ(cache.full_kv_bytes(n), size_t{layers} * G * n * row);
    std::vector<float> k(static_cast<size_t>(n) * G * hd, 0.5f);
    std::vector<int32_t> pos(static_cast<size_t>(n), 0);
    for (int il = 0; il < layers; ++il) {
      ASSERT_TRUE(cache.reserve(il, n, true).ok());
      cache.append(il, k.data(), k.data(), pos.data(), n);
    }
    EXPECT_EQ(cache.kv_bytes_used(), size_t{layers} * G * n * row);
    EXPECT_EQ(cache.kv_bytes_allocated(), size_t{layers} * G * n * row);
  }
}

struct AttnCase {
  int n_head, n_head_kv, head_dim, n_old, n_tok;
};

// Attention over a quantised cache and over an F32 cache holding the dequantised rows: the same
// arithmetic on the same values, so outputs and statistics are equal bit for bit, at every level
// and thread count; and both are close to the double-precision reference.
TEST(KvQuant, AttentionEqualsDequantizeThenAttend) {
  const KvElemType f16 = KvElemType::kF16, q8 = KvElemType::kQ8_0, q4 = KvElemType::kQ4_0;
  // Up to 4 query rows per KV head read the quantised rows directly; more share a dequantised
  // copy of each tile.
  const std::vector<AttnCase> cases = {
      {4, 4, 32, 300, 1},    // MHA decode over 2 tiles (direct)
      {9, 3, 64, 700, 1},    // GQA decode, SmolLM2 shape, 3 tiles, last one partial (direct)
      {8, 2, 128, 300, 1},   // GQA decode, head_dim 128 (direct)
      {4, 1, 256, 257, 1},   // MQA decode, head_dim 256 (direct)
      {9, 3, 64, 700, 3},    // GQA, 9 rows per KV head (tile copies)
      {4, 1, 128, 513, 20},  // MQA, 2 query blocks
      {6, 2, 64, 0, 37},     // GQA prefill, 3 query blocks
      {8, 2, 256, 257, 2},   // head_dim 256
  };
  for (KvType type : {KvType::kQ8_0, KvType::kQ4_0, KvType{q8, q4}, KvType{f16, q4}}) {
    for (const AttnCase& c : cases) {
      SCOPED_TRACE(std::string(kv_type_name(type)) + " H=" + std::to_string(c.n_head) +
                   " G=" + std::to_string(c.n_head_kv) + " hd=" + std::to_string(c.head_dim) +
                   " old=" + std::to_string(c.n_old) + " tok=" + std::to_string(c.n_tok));
      std::mt19937 rng(11);
      std::normal_distribution<float> nd(0.0f, 1.0f);
      const int total = c.n_old + c.n_tok, kv_dim = c.n_head_kv * c.head_dim;
      std::vector<float> k(static_cast<size_t>(total) * kv_dim), v(k.size());
      for (float& x : k) x = nd(rng);
      for (float& x : v) x = nd(rng);
      std::vector<int32_t> pos(static_cast<size_t>(total));
      for (int i = 0; i < total; ++i) pos[static_cast<size_t>(i)] = i;
      KvCache qc(KvCacheConfig{1, c.n_head_kv, c.head_dim, type});
      ASSERT_TRUE(qc.reserve(0, total, true).ok());
      qc.append(0, k.data(), v.data(), pos.data(), total);
      // The dequantised rows, in an F32 cache.
      const KvLayer& Q = qc.layer(0);
      for (int t = 0; t < total; ++t) {
        for (int g = 0; g < c.n_head_kv; ++g) {
          const size_t o = static_cast<size_t>(t) * kv_dim + static_cast<size_t>(g) * c.head_dim;
          Q.load_key(g, t, k.data() + o);
          Q.load_value(g, t, v.data() + o);
        }
      }
      KvCache fc(KvCacheConfig{1, c.n_head_kv, c.head_dim, KvType::kF32});
      ASSERT_TRUE(fc.reserve(0, total, true).ok());
      fc.append(0, k.data(), v.data(), pos.data(), total);
      std::vector<float> q(static_cast<size_t>(c.n_tok) * c.n_head * c.head_dim);
      for (float& x : q) x = 2.0f * nd(rng);
      AttnStatsRequest req;
      req.accumulate = true;
      req.window_first = std::max(0, c.n_tok - 2);
      const size_t out_n = q.size();
      std::vector<float> out_ref(out_n), out_q(out_n), out_f(out_n);
      AttnInput in{q.data(), out_ref.data(), c.n_tok, c.n_head,
                   1.0f / std::sqrt(static_cast<float>(c.head_dim))};
      {
        KvCache ref(fc.config());
        ASSERT_TRUE(ref.copy_from(fc).ok());
        attention_reference(in, ref.layer_for_attention(0), req);
      }
      for (KernelIsa isa : {KernelIsa::kScalar, KernelIsa::kAvx2, KernelIsa::kAvx512}) {
        if (!kernel_isa_available(isa)) continue;
        SCOPED_TRACE(kernel_isa_name(isa));
        for (int threads : {1, 2}) {
          SCOPED_TRACE(threads);
          KvCache a(qc.config()), b(fc.config());
          ASSERT_TRUE(a.copy_from(qc).ok());
          ASSERT_TRUE(b.copy_from(fc).ok());
          ThreadPool pool(threads);
          AttnScratch sa, sb;
          in.out = out_q.data();
          attention_forward_isa(in, a.layer_for_attention(0), req, pool, sa, isa);
          in.out = out_f.data();
          attention_forward_isa(in, b.layer_for_attention(0), req, pool, sb, isa);
          ASSERT_EQ(out_q, out_f);
          for (size_t i = 0; i < out_n; ++i) {
            ASSERT_NEAR(out_q[i], out_ref[i], 2e-5f * (1.0f + std::fabs(out_ref[i]))) << i;
          }
          const KvLayer &A = a.layer(0), &B = b.layer(0);
          for (int g = 0; g < c.n_head_kv; ++g) {
            for (int j = 0; j < total; ++j) {
              ASSERT_EQ(A.score(g)[j], B.score(g)[j]) << g << "," << j;
              ASSERT_EQ(A.window(g)[j], B.window(g)[j]) << g << "," << j;
            }
          }
        }
      }
    }
  }
}

// One merge on Q8_0: the merged slot holds exactly quantize(sum of w * dequantised rows), the
// terms added in plan order in float, as KvCache::apply documents; kept slots move unchanged.
TEST(KvQuant, MergeWritesQuantisedMergeOfDequantisedRows) {
  const int hd = 64, n = 6;
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  KvCache cache(KvCacheConfig{1, 1, hd, KvType::kQ8_0});
  std::vector<float> k(static_cast<size_t>(n) * hd), v(k.size());
  for (float& x : k) x = nd(rng);
  for (float& x : v) x = nd(rng);
  std::vector<int32_t> pos = {0, 1, 2, 3, 4, 5};
  ASSERT_TRUE(cache.reserve(0, n, true).ok());
  cache.append(0, k.data(), v.data(), pos.data(), n);
  const KvLayer& L = cache.layer(0);
  std::vector<std::vector<uint8_t>> kraw(n), vraw(n);
  for (int j = 0; j < n; ++j) {
    kraw[static_cast<size_t>(j)].assign(L.key_row(0, j), L.key_row(0, j) + L.key_row_bytes());
    vraw[static_cast<size_t>(j)].assign(L.value_row(0, j), L.value_row(0, j) + L.value_row_bytes());
  }
  CompactionPlan plan;
  plan.reset(1, 3);
  const int32_t keep[3] = {0, 2, 4};
  std::copy(keep, keep + 3, plan.keep_of(0));
  plan.merges = {{0, 2, 2, 0.5f}, {0, 2, 3, 0.3f}, {0, 2, 1, 0.2f}};
  // The naive merge.
  std::vector<float> row(hd), acc_k(hd, 0.0f), acc_v(hd, 0.0f);
  for (const MergeTerm& m : plan.merges) {
    L.load_key(0, m.src, row.data());
    for (int d = 0; d < hd; ++d) acc_k[static_cast<size_t>(d)] += m.w * row[static_cast<size_t>(d)];
    L.load_value(0, m.src, row.data());
    for (int d = 0; d < hd; ++d) acc_v[static_cast<size_t>(d)] += m.w * row[static_cast<size_t>(d)];
  }
  std::vector<uint8_t> want_k(L.key_row_bytes()), want_v(L.value_row_bytes());
  quantize_row(GgmlType::kQ8_0, acc_k.data(), want_k.data(), hd);
  quantize_row(GgmlType::kQ8_0, acc_v.data(), want_v.data(), hd);
  cache.apply(0, plan);
  ASSERT_EQ(L.n_slot(), 3);
  EXPECT_EQ(0, std::memcmp(L.key_row(0, 1), want_k.data(), want_k.size()));
  EXPECT_EQ(0, std::memcmp(L.value_row(0, 1), want_v.data(), want_v.size()));
  EXPECT_EQ(L.merged(0)[1], 2);
  for (int i : {0, 2}) {
    const size_t src = static_cast<size_t>(keep[i]);
    EXPECT_EQ(0, std::memcmp(L.key_row(0, i), kraw[src].data(), kraw[src].size())) << i;
    EXPECT_EQ(0, std::memcmp(L.value_row(0, i), vraw[src].data(), vraw[src].size())) << i;
    EXPECT_EQ(L.pos(0)[i], keep[i]);
  }
}

// Every preset on Q8_0 / Q4_0 storage (keys and values, and mixed), statistics from attention
// over the quantised slots: the same slots survive as in the naive reference run on the
// dequantised rows, and merged rows differ from its float merge by at most the quantisation step.
TEST(KvQuant, EveryPolicyRunsOnQuantisedStorage) {
  const KvElemType q8 = KvElemType::kQ8_0, q4 = KvElemType::kQ4_0;
  for (KvType type : {KvType::kQ8_0, KvType::kQ4_0, KvType{q8, q4}}) {
    for (const char* spec :
         {"d2o:ratio=0.3", "h2o:ratio=0.25", "roco:budget=12",
          "streaming:budget=10,pos=shift", "cam:ratio=0.3", "snapkv:budget=12,window=4",
          "pyramidkv:budget=12,window=4", "keydiff:ratio=0.3", "d2o:ratio=0.3,mrope=pre"}) {
      for (int heads : {2, 1}) {
        SCOPED_TRACE(std::string(spec) + " " + kv_type_name(type) + " " + test::layout_name(heads));
        test::SimSetup s;
        s.n_layer = 3;
        s.n_head_kv = heads;
        s.head_dim = 32;
        s.type = type;
        s.n_head = 4;
        test::PolicySim sim(spec, s);
        // Values of N(0, 1): a Q4_0 step is up to max|x| / 8 (about 0.4), a Q8_0 one 1/16 of it.
        sim.tol = type.k == q4 || type.v == q4 ? 0.5 : 0.05;
        ASSERT_EQ(sim.pass(40), "");
        for (int step = 0; step < 12; ++step) ASSERT_EQ(sim.pass(1), "") << "step " << step;
        for (int il = 0; il < s.n_layer; ++il) {
          const KvLayer& L = sim.cache.layer(il);
          ASSERT_GT(L.n_slot(), 0);
          std::vector<float> row(static_cast<size_t>(s.head_dim));
          for (int g = 0; g < heads; ++g) {
            for (int j = 0; j < L.n_slot(); ++j) {
              L.load_key(g, j, row.data());
              for (float x : row) ASSERT_TRUE(std::isfinite(x));
              L.load_value(g, j, row.data());
              for (float x : row) ASSERT_TRUE(std::isfinite(x));
              if (j > 0) {
                ASSERT_LT(L.pos(g)[j - 1], L.pos(g)[j]);
              }
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace d2o
