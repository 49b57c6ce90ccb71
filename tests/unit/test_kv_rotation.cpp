// Rotated KV storage (kv/kv_rotation.h): the normalised Walsh-Hadamard transform against a
// double-precision matrix, the storage types' parsing and checks, attention through KvAttention
// with rotated storage against plain storage, the accuracy gain on rows with an outlier channel,
// and every compacting policy on a random-weight model with rotated F32 storage.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <memory>
#include <random>

#include "common/random_model.h"
#include "gguf/gguf.h"
#include "kv/kv_cache.h"
#include "kv/kv_rotation.h"
#include "kv/policy.h"
#include "model/kv_attention.h"
#include "model/model.h"
#include "ops/hadamard.h"
#include "runtime/engine.h"

namespace d2o {
namespace {

// Entry (i, j) of the Sylvester Hadamard matrix of size n, normalised.
double hadamard_entry(int i, int j, int n) {
  return (std::popcount(static_cast<unsigned>(i & j)) % 2 ? -1.0 : 1.0) / std::sqrt(double(n));
}

TEST(KvRotation, TransformIsTheNormalisedHadamardMatrixAndItsOwnInverse) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int n : {1, 2, 4, 8, 16, 32, 64, 128, 256}) {
    SCOPED_TRACE(n);
    // Column j is the transform of the unit vector e_j.
    for (int j = 0; j < n; ++j) {
      std::vector<float> e(static_cast<size_t>(n), 0.0f);
      e[static_cast<size_t>(j)] = 1.0f;
      hadamard_blocks(e.data(), n, n);
      for (int i = 0; i < n; ++i)
        ASSERT_NEAR(e[static_cast<size_t>(i)], hadamard_entry(i, j, n), 1e-7) << i << "," << j;
    }
    // Three blocks at once: each block alone; norms kept; applied twice, the input back.
    std::vector<float> x(static_cast<size_t>(3 * n));
    for (float& v : x) v = nd(rng);
    std::vector<float> y = x;
    hadamard_blocks(y.data(), 3 * n, n);
    for (int b = 0; b < 3; ++b) {
      double nx = 0, ny = 0;
      for (int i = 0; i < n; ++i) {
        double want = 0;
        for (int j = 0; j < n; ++j)
          want += hadamard_entry(i, j, n) * x[static_cast<size_t>(b * n + j)];
        EXPECT_NEAR(y[static_cast<size_t>(b * n + i)], want, 1e-5);
        nx += double(x[static_cast<size_t>(b * n + i)]) * x[static_cast<size_t>(b * n + i)];
        ny += double(y[static_cast<size_t>(b * n + i)]) * y[static_cast<size_t>(b * n + i)];
      }
      EXPECT_NEAR(ny, nx, 1e-5 * nx);
    }
    hadamard_blocks(y.data(), 3 * n, n);
    for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(y[i], x[i], 1e-5);
  }
}

TEST(KvRotation, BlockSizes) {
  // Keys: the largest power of two dividing the head size; values: 64.
  EXPECT_EQ(kv_rot_block_k(64), 64);
  EXPECT_EQ(kv_rot_block_k(128), 128);
  EXPECT_EQ(kv_rot_block_k(192), 64);
  EXPECT_EQ(kv_rot_block_k(256), 256);
  EXPECT_EQ(kv_rot_block_k(320), 64);
  for (int hd : {64, 128, 256}) EXPECT_EQ(kv_rot_block_v(hd), 64);
}

TEST(KvRotation, ParsesNamesAndChecksRotatedTypes) {
  const KvElemType f32 = KvElemType::kF32, f16 = KvElemType::kF16, q8 = KvElemType::kQ8_0,
                   q4 = KvElemType::kQ4_0;
  struct Ok {
    const char* s;
    KvType t;
    const char* name;
  };
  for (const Ok& c : {Ok{"q4_0r", KvType{q4, q4, true, true}, "q4_0r"},
                      Ok{"q4_0", KvType{q4, q4, false, false}, "q4_0"},
                      Ok{"f32r", KvType{f32, f32, true, true}, "f32r"},
                      Ok{"k:q8_0r,v:q4_0r", KvType{q8, q4, true, true}, "k:q8_0r,v:q4_0r"},
                      Ok{"k:q8_0r,v:q4_0", KvType{q8, q4, true, false}, "k:q8_0r,v:q4_0"},
                      Ok{"v:q4_0r", KvType{f16, q4, false, true}, "k:f16,v:q4_0r"},
                      Ok{"k:q4_0,v:q4_0r", KvType{q4, q4, false, true}, "k:q4_0,v:q4_0r"}}) {
    auto t = parse_kv_type(c.s);
    ASSERT_TRUE(t.ok()) << c.s << ": " << t.status().message();
    EXPECT_TRUE(*t == c.t) << c.s;
    EXPECT_STREQ(kv_type_name(*t), c.name);
  }
  for (const char* bad : {"r", "q4_0rr", "q4_0R", "k:r", "rq4_0", "q5_0r", "k:q8_0r,v:"}) {
    auto t = parse_kv_type(bad);
    EXPECT_FALSE(t.ok()) << "'" << bad << "' accepted";
  }
  // Head sizes: multiples of 64 only, for either part rotated.
  for (int hd : {64, 128, 192, 256}) EXPECT_TRUE(check_kv_type(*parse_kv_type("q4_0r"), hd).ok());
  EXPECT_TRUE(check_kv_type(KvType::kQ4_0, 32).ok());
  for (const char* s : {"q4_0r", "f32r", "k:q8_0r,v:q4_0", "k:q8_0,v:q4_0r"}) {
    for (int hd : {32, 96, 48, 0}) {
      const Status st = check_kv_type(*parse_kv_type(s), hd);
      ASSERT_FALSE(st.ok()) << s << " " << hd;
      EXPECT_NE(st.message().find(std::to_string(hd)), std::string::npos) << st.message();
    }
  }
}

TEST(KvRotation, ByteCountsAndReportUnchanged) {
  for (const char* s : {"f32", "f16", "q8_0", "q4_0", "k:q8_0,v:q4_0"}) {
    const KvType plain = *parse_kv_type(s);
    const KvType rot = *parse_kv_type(
        std::string(s).find(':') == std::string::npos ? std::string(s) + "r" : "k:q8_0r,v:q4_0r");
    SCOPED_TRACE(kv_type_name(rot));
    EXPECT_EQ(plain.k, rot.k);
    EXPECT_EQ(plain.v, rot.v);
    const KvCacheConfig a{2, 3, 128, plain}, b{2, 3, 128, rot};
    EXPECT_EQ(KvCache::bytes_for_slots(a, 77), KvCache::bytes_for_slots(b, 77));
    KvCache ca(a), cb(b);
    EXPECT_EQ(ca.full_kv_bytes(1000), cb.full_kv_bytes(1000));
    EXPECT_EQ(ca.layer(0).key_row_bytes(), cb.layer(0).key_row_bytes());
    EXPECT_EQ(ca.layer(0).value_row_bytes(), cb.layer(0).value_row_bytes());
  }
}

struct NoHooks final : ForwardHooks {
  Status after_attention(int, int, const LayerDesc&, int) override { return {}; }
  void logits(std::span<const int>, const float*) override {}
};

struct AttnRun {
  std::vector<float> out;  // every pass's outputs, concatenated
  std::unique_ptr<KvCache> cache;
};

// A prefill of n_prompt tokens and n_decode one-token passes through KvAttention (one sequence),
// with score statistics; k, v and q from `rng_seed`, channel `outlier` of keys and values
// (every head) scaled up by 10 when >= 0.
AttnRun run_attention(KvType type, int H, int G, int hd, int n_prompt, int n_decode, int outlier,
                      AttnSplit split) {
  std::mt19937 rng(9);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  ThreadPool pool(2);
  KvAttention attn(pool, split, H, G, hd);
  AttnRun r;
  r.cache = std::make_unique<KvCache>(KvCacheConfig{1, G, hd, type});
  LayerDesc d;
  d.attn_scale = 1.0f / std::sqrt(static_cast<float>(hd));
  NoHooks hooks;
  int past = 0;
  for (int pass = 0; pass <= n_decode; ++pass) {
    const int n = pass == 0 ? n_prompt : 1;
    std::vector<float> q(static_cast<size_t>(n) * H * hd), k(static_cast<size_t>(n) * G * hd),
        v(k.size()), out(q.size());
    for (float& x : q) x = nd(rng);
    for (float& x : k) x = nd(rng);
    for (float& x : v) x = nd(rng);
    if (outlier >= 0) {
      for (size_t o = static_cast<size_t>(outlier); o < k.size(); o += static_cast<size_t>(hd)) {
        k[o] *= 10.0f;
        v[o] *= 10.0f;
      }
    }
    std::vector<int32_t> tokens(static_cast<size_t>(n), 1), pos(static_cast<size_t>(n));
    for (int t = 0; t < n; ++t) pos[static_cast<size_t>(t)] = past + t;
    SeqRows sr;
    sr.cache = r.cache.get();
    sr.r0 = 0;
    sr.r1 = n;
    sr.stats.accumulate = true;
    const std::vector<SeqRows> seqs = {sr};
    const std::vector<int> logit_rows;
    const UbatchInput in{tokens, pos, seqs, logit_rows};
    EXPECT_TRUE(attn.run(0, d, in, q.data(), k.data(), v.data(), out.data(), hooks).ok());
    r.out.insert(r.out.end(), out.begin(), out.end());
    past += n;
  }
  return r;
}

double rms_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
  return std::sqrt(s / static_cast<double>(a.size()));
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(double(a[i]) - b[i]));
  return m;
}

// Rotated F32 storage: the same outputs and statistics as plain F32 up to float rounding, and the
// stored rows are the rotated ones (so the test cannot pass with the rotation left out).
TEST(KvRotation, AttentionWithRotatedStorageEqualsPlainStorage) {
  struct Case {
    int H, G, hd;
  };
  for (const Case& c : {Case{4, 4, 64}, Case{8, 2, 128}, Case{6, 3, 192}, Case{4, 1, 256}}) {
    for (AttnSplit split : {AttnSplit::kWithinSequence, AttnSplit::kAcrossSequences}) {
      SCOPED_TRACE("H=" + std::to_string(c.H) + " G=" + std::to_string(c.G) +
                   " hd=" + std::to_string(c.hd));
      const AttnRun plain = run_attention(KvType::kF32, c.H, c.G, c.hd, 37, 3, -1, split);
      const AttnRun rot = run_attention(*parse_kv_type("f32r"), c.H, c.G, c.hd, 37, 3, -1, split);
      ASSERT_EQ(plain.out.size(), rot.out.size());
      EXPECT_LT(max_abs_diff(plain.out, rot.out), 2e-5);
      const KvLayer& P = plain.cache->layer(0);
      const KvLayer& R = rot.cache->layer(0);
      ASSERT_EQ(P.n_slot(), 40);
      ASSERT_EQ(R.n_slot(), 40);
      std::vector<float> pk(static_cast<size_t>(c.hd)), rk(pk.size()), pv(pk.size()), rv(pk.size());
      for (int g = 0; g < c.G; ++g) {
        for (int j = 0; j < P.n_slot(); ++j) {
          EXPECT_NEAR(P.score(g)[j], R.score(g)[j], 1e-5);
          P.load_key(g, j, pk.data());
          R.load_key(g, j, rk.data());
          P.load_value(g, j, pv.data());
          R.load_value(g, j, rv.data());
          // Stored rotated, and distinct from the plain rows.
          EXPECT_GT(max_abs_diff(pk, rk), 1e-3);
          hadamard_blocks(pk.data(), c.hd, kv_rot_block_k(c.hd));
          hadamard_blocks(pv.data(), c.hd, kv_rot_block_v(c.hd));
          ASSERT_LT(max_abs_diff(pk, rk), 1e-5);
          ASSERT_LT(max_abs_diff(pv, rv), 1e-5);
        }
      }
    }
  }
}

// Keys and values with one channel 10 times the others: rotated Q4_0 and Q8_0 storage give
// attention outputs much closer (RMS) to F32 than plain storage does (about half the
// error of plain storage for Q4_0 at head size 128, 0.4 of it elsewhere).
TEST(KvRotation, RotatedQuantisedStorageIsCloserToF32WithAnOutlierChannel) {
  for (const char* base : {"q4_0", "q8_0"}) {
    SCOPED_TRACE(base);
    const KvType plain = *parse_kv_type(base), rot = *parse_kv_type(std::string(base) + "r");
    for (int hd : {64, 128}) {
      const auto ref = run_attention(KvType::kF32, 8, 2, hd, 60, 4, 5, AttnSplit::kAuto);
      const auto p = run_attention(plain, 8, 2, hd, 60, 4, 5, AttnSplit::kAuto);
      const auto r = run_attention(rot, 8, 2, hd, 60, 4, 5, AttnSplit::kAuto);
      const double ep = rms_diff(ref.out, p.out), er = rms_diff(ref.out, r.out);
      EXPECT_LT(er, 0.6 * ep) << "hd " << hd << ": plain " << ep << ", rotated " << er;
    }
  }
}

// ---- every compacting policy through the engine, rotated F32 against plain F32 ------------

std::unique_ptr<Model> load_model(const test::RandomModelConfig& c, std::vector<uint8_t>& bytes,
                                  std::unique_ptr<GgufFile>& file) {
  bytes = test::make_random_model(c).to_bytes();
  auto f = GgufFile::from_memory(bytes.data(), bytes.size(), "random.gguf");
  EXPECT_TRUE(f.ok()) << f.status().to_string();
  if (!f.ok()) return nullptr;
  file = std::move(f).value();
  auto m = Model::load(*file);
  EXPECT_TRUE(m.ok()) << m.status().to_string();
  if (!m.ok()) return nullptr;
  return std::move(m).value();
}

// Logits of a 48-token prompt then 10 one-token passes (fixed tokens), concatenated.
Status feed(Engine& engine, Sequence& seq, const std::vector<TokenId>& toks,
            std::vector<float>* logits) {
  const int n_vocab = engine.model().hparams().n_vocab;
  auto sink = [&](int, int, const float* l) { logits->insert(logits->end(), l, l + n_vocab); };
  BatchEntry be;
  be.seq = &seq;
  be.tokens = std::span<const TokenId>(toks.data(), 48);
  D2O_RETURN_IF_ERROR(engine.forward({&be, 1}, sink));
  for (size_t i = 48; i < toks.size(); ++i) {
    be.tokens = std::span<const TokenId>(toks.data() + i, 1);
    D2O_RETURN_IF_ERROR(engine.forward({&be, 1}, sink));
  }
  return {};
}

TEST(KvRotation, EveryPolicyOnARandomModelMatchesPlainStorage) {
  test::RandomModelConfig c = test::random_qwen3_config();
  c.head_dim = 64;  // rotated storage needs a multiple of 64
  c.n_layer = 2;
  std::vector<uint8_t> bytes;
  std::unique_ptr<GgufFile> file;
  auto model = load_model(c, bytes, file);
  ASSERT_TRUE(model);
  ThreadPool pool(2);
  Engine engine(*model, pool, EngineOptions{});
  const std::vector<TokenId> toks = test::random_model_tokens(58, c.n_vocab);
  const KvType f32r = *parse_kv_type("f32r");
  for (const char* spec : {"full", "h2o:ratio=0.3", "roco:ratio=0.3", "streaming:ratio=0.3",
                           "snapkv:ratio=0.3", "pyramidkv:ratio=0.3", "cam:ratio=0.3",
                           "d2o:ratio=0.3", "keydiff:ratio=0.3", "d2o:budget=20,sim=kv"}) {
    SCOPED_TRACE(spec);
    auto parsed = parse_kv_policy(spec);
    ASSERT_TRUE(parsed.ok()) << parsed.status().message();
    std::shared_ptr<const KvPolicy> pol(std::move(parsed).value());
    Sequence plain(model->hparams(), KvType::kF32, pol), rot(model->hparams(), f32r, pol);
    std::vector<float> lp, lr;
    ASSERT_TRUE(feed(engine, plain, toks, &lp).ok());
    ASSERT_TRUE(feed(engine, rot, toks, &lr).ok());
    ASSERT_EQ(lp.size(), lr.size());
    double mx = 0;
    for (float x : lp) mx = std::max(mx, double(std::fabs(x)));
    EXPECT_LT(max_abs_diff(lp, lr), 1e-4 * mx);
    // The same slots kept (and merged) in every layer and head.
    for (int il = 0; il < c.n_layer; ++il) {
      const KvLayer& P = plain.cache().layer(il);
      const KvLayer& R = rot.cache().layer(il);
      ASSERT_EQ(P.n_slot(), R.n_slot());
      for (int g = 0; g < P.n_head_kv(); ++g) {
        for (int j = 0; j < P.n_slot(); ++j) {
          ASSERT_EQ(P.pos(g)[j], R.pos(g)[j]) << il << " " << g << " " << j;
          ASSERT_EQ(P.merged(g)[j], R.merged(g)[j]) << il << " " << g << " " << j;
        }
      }
    }
  }
}

// Gemma 3's sliding-window layers and head size 256 (key block 256, value block 64), no policy.
TEST(KvRotation, Gemma3ForwardWithRotatedStorageMatchesPlain) {
  test::RandomModelConfig c = test::random_gemma3_config();
  c.head_dim = 256;
  std::vector<uint8_t> bytes;
  std::unique_ptr<GgufFile> file;
  auto model = load_model(c, bytes, file);
  ASSERT_TRUE(model);
  ThreadPool pool(2);
  Engine engine(*model, pool, EngineOptions{});
  const std::vector<TokenId> toks = test::random_model_tokens(58, c.n_vocab);
  std::shared_ptr<const KvPolicy> pol(parse_kv_policy("full").value());
  Sequence plain(model->hparams(), KvType::kF32, pol);
  Sequence rot(model->hparams(), *parse_kv_type("f32r"), pol);
  std::vector<float> lp, lr;
  ASSERT_TRUE(feed(engine, plain, toks, &lp).ok());
  ASSERT_TRUE(feed(engine, rot, toks, &lr).ok());
  ASSERT_EQ(lp.size(), lr.size());
  double mx = 0;
  for (float x : lp) mx = std::max(mx, double(std::fabs(x)));
  EXPECT_LT(max_abs_diff(lp, lr), 1e-4 * mx);
}

// RoPE applied to stored keys (pos=shift, mrope=pre) does not commute with the key rotation:
// refused with a clear error; rotating values only is fine.
TEST(KvRotation, PoliciesThatReRotateKeysRefuseRotatedKeys) {
  test::RandomModelConfig c = test::random_qwen3_config();
  c.head_dim = 64;
  c.n_layer = 2;
  std::vector<uint8_t> bytes;
  std::unique_ptr<GgufFile> file;
  auto model = load_model(c, bytes, file);
  ASSERT_TRUE(model);
  ThreadPool pool(1);
  Engine engine(*model, pool, EngineOptions{});
  const std::vector<TokenId> toks = test::random_model_tokens(58, c.n_vocab);
  for (const char* spec : {"streaming:budget=20,pos=shift", "d2o:budget=20,mrope=pre"}) {
    SCOPED_TRACE(spec);
    std::shared_ptr<const KvPolicy> pol(parse_kv_policy(spec).value());
    std::vector<float> l;
    Sequence bad(model->hparams(), *parse_kv_type("q4_0r"), pol);
    const Status st = feed(engine, bad, toks, &l);
    ASSERT_FALSE(st.ok());
    EXPECT_NE(st.message().find(std::string(spec).find("pos") != std::string::npos
                                    ? "positions=shifted"
                                    : "merge_keys=unrotated"),
              std::string::npos)
        << st.message();
    EXPECT_NE(st.message().find("q4_0r"), std::string::npos) << st.message();
    Sequence ok(model->hparams(), *parse_kv_type("k:q4_0,v:q4_0r"), pol);
    EXPECT_TRUE(feed(engine, ok, toks, &l).ok());
  }
}

}  // namespace
}  // namespace d2o
