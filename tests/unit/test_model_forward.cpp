// The model seam on writer-made random models: the layer description the llama family gets, and
// ModelForward::run against a naive forward pass written here (plain loops in double, full causal
// attention per sequence, RoPE from its formula, no code shared with src/model or src/ops), with
// several sequences in one micro-batch, decode steps, every attention split (llama with GQA,
// qwen2's biases, qwen3's QK-norm, Llama 3.1's RoPE frequency factors, qwen3moe's experts), and the
// ForwardHooks contract (which sequences and layers are called back, logits in ascending blocks of
// at most kLogitRows rows, a hook's error failing the pass).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>

#include "common/random_model.h"
#include "gguf/gguf.h"
#include "model/forward.h"
#include "model/model.h"

namespace d2o {
namespace {

struct Loaded {
  std::vector<uint8_t> bytes;
  std::unique_ptr<GgufFile> file;
  std::unique_ptr<Model> model;
};

std::unique_ptr<Loaded> load(const test::RandomModelConfig& c) {
  auto l = std::make_unique<Loaded>();
  l->bytes = test::make_random_model(c).to_bytes();
  auto f = GgufFile::from_memory(l->bytes.data(), l->bytes.size(), "random.gguf");
  EXPECT_TRUE(f.ok()) << f.status().to_string();
  if (!f.ok()) return nullptr;
  l->file = std::move(f).value();
  auto m = Model::load(*l->file);
  EXPECT_TRUE(m.ok()) << m.status().to_string();
  if (!m.ok()) return nullptr;
  l->model = std::move(m).value();
  return l;
}

// A grouped-query llama with F32 matrices and an untied output (exact F32 products).
test::RandomModelConfig gqa_llama_config() {
  test::RandomModelConfig c;
  c.n_layer = 3;
  c.n_head = 4;
  c.n_head_kv = 2;
  c.tied = false;
  c.seed = 7;
  return c;
}

TEST(ModelDesc, LlamaFamilyLayersAreUniformPreNormGlobalSwiGlu) {
  for (const auto& c : {gqa_llama_config(), test::random_qwen2_config()}) {
    auto l = load(c);
    ASSERT_TRUE(l);
    const Model& m = *l->model;
    const ModelHParams& h = m.hparams();
    const ModelDesc& md = m.desc();
    const bool qwen2 = c.arch == "qwen2";
    EXPECT_EQ(md.embd_scale, 1.0f);
    ASSERT_EQ(md.layers.size(), static_cast<size_t>(h.n_layer));
    for (const LayerDesc& d : md.layers) {
      EXPECT_EQ(d.kind, LayerKind::kGlobal);
      EXPECT_EQ(d.window, 0);
      EXPECT_EQ(d.rope.type, qwen2 ? RopeType::kNeox : RopeType::kNorm);
      EXPECT_EQ(d.rope.head_dim, c.n_embd / c.n_head);
      EXPECT_EQ(d.rope.n_rot, c.n_embd / c.n_head);
      EXPECT_EQ(d.rope.freq_base, 10000.0f);
      EXPECT_EQ(d.rope.freq_scale, 1.0f);
      EXPECT_EQ(d.rope.freq_factors, nullptr);
      EXPECT_EQ(d.attn_scale, 1.0f / std::sqrt(static_cast<float>(c.n_embd / c.n_head)));
      EXPECT_TRUE(d.norms.attn_pre && d.norms.ffn_pre);
      EXPECT_FALSE(d.norms.attn_post || d.norms.ffn_post || d.norms.qk);
      EXPECT_EQ(d.qkv_bias, qwen2);
      EXPECT_EQ(d.ffn, FfnKind::kSwiGlu);
    }
    // Field by field: a byte comparison would read the struct's padding, which copies need not
    // keep.
    const RopeParams &pr = md.policy_rope, &lr = md.layers[0].rope;
    EXPECT_TRUE(pr.type == lr.type && pr.head_dim == lr.head_dim && pr.n_rot == lr.n_rot &&
                pr.freq_base == lr.freq_base && pr.freq_scale == lr.freq_scale &&
                pr.freq_factors == lr.freq_factors);
    const KvCacheConfig kc = kv_cache_config(h, KvType::kF16);
    EXPECT_EQ(kc.n_layer, c.n_layer);
    EXPECT_EQ(kc.n_head_kv, c.n_head_kv);
    EXPECT_EQ(kc.head_dim, c.n_embd / c.n_head);
    EXPECT_EQ(kc.type, KvType::kF16);
  }
}

// Qwen 3: the llama family's layer with QK-norm and NeoX RoPE, no biases; its head size (32) is
// not n_embd / n_head.
TEST(ModelDesc, Qwen3IsTheLlamaLayerWithQkNorm) {
  const test::RandomModelConfig c = test::random_qwen3_config();
  auto l = load(c);
  ASSERT_TRUE(l);
  const Model& m = *l->model;
  EXPECT_EQ(m.hparams().arch, ModelArch::kQwen3);
  EXPECT_EQ(m.desc().embd_scale, 1.0f);
  EXPECT_EQ(m.desc().logit_softcap, 0.0f);
  ASSERT_EQ(m.desc().layers.size(), static_cast<size_t>(c.n_layer));
  for (int il = 0; il < c.n_layer; ++il) {
    const LayerDesc& d = m.desc().layers[static_cast<size_t>(il)];
    EXPECT_EQ(d.kind, LayerKind::kGlobal);
    EXPECT_EQ(d.rope.type, RopeType::kNeox);
    EXPECT_EQ(d.rope.head_dim, c.head_dim);
    EXPECT_EQ(d.rope.n_rot, c.head_dim);
    EXPECT_EQ(d.rope.freq_factors, nullptr);
    EXPECT_EQ(d.attn_scale, 1.0f / std::sqrt(static_cast<float>(c.head_dim)));
    EXPECT_TRUE(d.norms.attn_pre && d.norms.ffn_pre && d.norms.qk);
    EXPECT_FALSE(d.norms.attn_post || d.norms.ffn_post);
    EXPECT_FALSE(d.qkv_bias);
    EXPECT_EQ(d.ffn, FfnKind::kSwiGlu);
    EXPECT_EQ(m.layer(il).attn_q_norm.size(), static_cast<size_t>(c.head_dim));
    EXPECT_EQ(m.layer(il).attn_k_norm.size(), static_cast<size_t>(c.head_dim));
  }
}

// Llama 3.1: the rope_freqs tensor is every layer's (and the policies') RoPE frequency factors.
TEST(ModelDesc, Llama31RopeFrequencyFactorsReachEveryLayer) {
  const test::RandomModelConfig c = test::random_llama31_config();
  ASSERT_EQ(c.rope_freqs.size(), 16u);
  // The fixture spans the three cases of the converter's formula.
  EXPECT_EQ(c.rope_freqs.front(), 1.0f);
  EXPECT_GT(c.rope_freqs[1], 1.0f);
  EXPECT_LT(c.rope_freqs[2], 8.0f);
  EXPECT_EQ(c.rope_freqs.back(), 8.0f);
  auto l = load(c);
  ASSERT_TRUE(l);
  const Model& m = *l->model;
  EXPECT_EQ(m.rope_freq_factors(), c.rope_freqs);
  EXPECT_EQ(m.desc().policy_rope.freq_factors, m.rope_freq_factors().data());
  for (const LayerDesc& d : m.desc().layers) {
    EXPECT_EQ(d.rope.freq_factors, m.rope_freq_factors().data());
    EXPECT_EQ(d.rope.type, RopeType::kNorm);
    EXPECT_EQ(d.rope.freq_scale, 1.0f);
    EXPECT_FALSE(d.norms.qk);
  }
}

// ---- naive reference --------------------------------------------------------------------------

using Vec = std::vector<double>;

struct Naive {
  const GgufFile& f;
  test::RandomModelConfig c;
  bool qk_norm = true;  // false: a wrong variant that skips QK-norm (tests the comparison)
  bool renormalise = true;  // false: a mixture of experts whose weights are not renormalised
  // A mixture of experts: the smallest gap seen between the router logits of the last chosen
  // expert and the first one left out (a small gap: rounding could flip the choice).
  mutable double min_margin = 1e300;
  int hd() const { return c.head_dim > 0 ? c.head_dim : c.n_embd / c.n_head; }

  Vec tensor(const std::string& name) const {
    const GgufTensorInfo* t = f.find_tensor(name);
    EXPECT_TRUE(t && t->type == GgmlType::kF32) << name;
    std::vector<float> v(static_cast<size_t>(t->n_elements()));
    EXPECT_TRUE(f.read_tensor(*t, reinterpret_cast<uint8_t*>(v.data())).ok());
    return Vec(v.begin(), v.end());
  }
  bool has(const std::string& name) const { return f.find_tensor(name) != nullptr; }
  // y = W x for W stored [rows, cols] row-major (GGUF dims {cols, rows}).
  static Vec matvec(const Vec& w, const Vec& x, int rows) {
    const size_t cols = x.size();
    Vec y(static_cast<size_t>(rows), 0.0);
    for (int r = 0; r < rows; ++r)
      for (size_t i = 0; i < cols; ++i) y[static_cast<size_t>(r)] += w[r * cols + i] * x[i];
    return y;
  }
  static Vec rmsnorm(const Vec& x, const Vec& w) {
    double ss = 0;
    for (double v : x) ss += v * v;
    const double s = 1.0 / std::sqrt(ss / static_cast<double>(x.size()) + 1e-5);
    Vec y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] * s * w[i];
    return y;
  }
  // Every head of x (size hd()) RMS-normalised with w.
  Vec head_rmsnorm(const Vec& x, const Vec& w) const {
    const size_t d = static_cast<size_t>(hd());
    Vec y;
    for (size_t h = 0; h < x.size() / d; ++h) {
      const Vec yh = rmsnorm(Vec(x.begin() + h * d, x.begin() + (h + 1) * d), w);
      y.insert(y.end(), yh.begin(), yh.end());
    }
    return y;
  }
  // Rotates every head of x for position p: pairs (2i, 2i+1) (llama) or (i, i + d/2) (qwen2,
  // qwen3), angle p * 10000^(-2i/d) divided by the config's frequency factor i (Llama 3.1).
  void rope(Vec& x, int p) const {
    const int d = hd();
    const bool neox = c.arch == "qwen2" || c.arch == "qwen3" || c.arch == "qwen3moe";
    for (size_t h = 0; h < x.size() / static_cast<size_t>(d); ++h) {
      double* v = x.data() + h * static_cast<size_t>(d);
      for (int i = 0; i < d / 2; ++i) {
        const double ff = c.rope_freqs.empty() ? 1.0 : c.rope_freqs[static_cast<size_t>(i)];
        const double th = p * std::pow(10000.0, -2.0 * i / d) / ff;
        const int a = neox ? i : 2 * i, b = neox ? i + d / 2 : 2 * i + 1;
        const double x0 = v[a], x1 = v[b];
        v[a] = x0 * std::cos(th) - x1 * std::sin(th);
        v[b] = x0 * std::sin(th) + x1 * std::cos(th);
      }
    }
  }

  // down(silu(gate h) * up h) for matrices stored from offset o of their tensors (an expert of
  // a stack, or the whole tensor).
  static Vec swiglu_ffn(const Vec& wg, const Vec& wu, const Vec& wd, const Vec& h, int n_ff,
                        size_t o_gu, size_t o_d) {
    const size_t E = h.size();
    Vec a(static_cast<size_t>(n_ff), 0.0);
    for (size_t r = 0; r < a.size(); ++r) {
      double g = 0, u = 0;
      for (size_t i = 0; i < E; ++i) {
        g += wg[o_gu + r * E + i] * h[i];
        u += wu[o_gu + r * E + i] * h[i];
      }
      a[r] = g / (1.0 + std::exp(-g)) * u;
    }
    Vec y(E, 0.0);
    for (size_t r = 0; r < E; ++r)
      for (size_t i = 0; i < a.size(); ++i) y[r] += wd[o_d + r * a.size() + i] * a[i];
    return y;
  }

  // The feed-forward block of layer prefix b on h: one SwiGLU, or a mixture of experts (softmax
  // over the router's logits, the n_expert_used most probable, their probabilities renormalised).
  Vec ffn(const std::string& b, const Vec& h) const {
    if (!has(b + "ffn_gate_inp.weight")) {
      return swiglu_ffn(tensor(b + "ffn_gate.weight"), tensor(b + "ffn_up.weight"),
                        tensor(b + "ffn_down.weight"), h, c.n_ff, 0, 0);
    }
    const Vec logit = matvec(tensor(b + "ffn_gate_inp.weight"), h, c.n_expert);
    std::vector<int> order(logit.size());
    for (size_t e = 0; e < order.size(); ++e) order[e] = static_cast<int>(e);
    std::sort(order.begin(), order.end(), [&](int x, int y) { return logit[x] > logit[y]; });
    const size_t k = static_cast<size_t>(c.n_expert_used);
    if (k < order.size()) min_margin = std::min(min_margin, logit[order[k - 1]] - logit[order[k]]);
    double total = 0, chosen = 0;
    for (double l : logit) total += std::exp(l - logit[order[0]]);
    for (size_t j = 0; j < k; ++j) chosen += std::exp(logit[order[j]] - logit[order[0]]) / total;
    const Vec wg = tensor(b + "ffn_gate_exps.weight"), wu = tensor(b + "ffn_up_exps.weight"),
              wd = tensor(b + "ffn_down_exps.weight");
    const size_t per = h.size() * static_cast<size_t>(c.n_ff_exp);  // one expert's matrix
    Vec y(h.size(), 0.0);
    for (size_t j = 0; j < k; ++j) {
      const size_t e = static_cast<size_t>(order[j]);
      const double p = std::exp(logit[e] - logit[order[0]]) / total;
      const double w = renormalise ? p / chosen : p;
      const Vec ye = swiglu_ffn(wg, wu, wd, h, c.n_ff_exp, e * per, e * per);
      for (size_t i = 0; i < y.size(); ++i) y[i] += w * ye[i];
    }
    return y;
  }

  // Logits [n, n_vocab] of the tokens as one sequence from position 0.
  std::vector<Vec> logits(const std::vector<int32_t>& toks) const {
    const int E = c.n_embd, d = hd(), G = c.n_head / c.n_head_kv;
    const Vec embd = tensor("token_embd.weight");
    std::vector<Vec> x(toks.size());
    for (size_t t = 0; t < toks.size(); ++t)
      x[t] = Vec(embd.begin() + toks[t] * E, embd.begin() + (toks[t] + 1) * E);
    for (int il = 0; il < c.n_layer; ++il) {
      const std::string b = "blk." + std::to_string(il) + ".";
      const Vec an = tensor(b + "attn_norm.weight"), wq = tensor(b + "attn_q.weight"),
                wk = tensor(b + "attn_k.weight"), wv = tensor(b + "attn_v.weight"),
                wo = tensor(b + "attn_output.weight"), fn = tensor(b + "ffn_norm.weight");
      std::vector<Vec> q(toks.size()), k(toks.size()), v(toks.size());
      for (size_t t = 0; t < toks.size(); ++t) {
        const Vec h = rmsnorm(x[t], an);
        q[t] = matvec(wq, h, c.n_head * d);
        k[t] = matvec(wk, h, c.n_head_kv * d);
        v[t] = matvec(wv, h, c.n_head_kv * d);
        if (has(b + "attn_q.bias")) {
          const Vec bq = tensor(b + "attn_q.bias"), bk = tensor(b + "attn_k.bias"),
                    bv = tensor(b + "attn_v.bias");
          for (size_t i = 0; i < q[t].size(); ++i) q[t][i] += bq[i];
          for (size_t i = 0; i < k[t].size(); ++i) k[t][i] += bk[i], v[t][i] += bv[i];
        }
        if (qk_norm && has(b + "attn_q_norm.weight")) {
          q[t] = head_rmsnorm(q[t], tensor(b + "attn_q_norm.weight"));
          k[t] = head_rmsnorm(k[t], tensor(b + "attn_k_norm.weight"));
        }
        rope(q[t], static_cast<int>(t));
        rope(k[t], static_cast<int>(t));
      }
      for (size_t t = 0; t < toks.size(); ++t) {
        Vec att(static_cast<size_t>(c.n_head * d), 0.0);
        for (int hq = 0; hq < c.n_head; ++hq) {
          const size_t qo = static_cast<size_t>(hq * d), ko = static_cast<size_t>(hq / G * d);
          Vec s(t + 1);
          double mx = -1e300, sum = 0;
          for (size_t j = 0; j <= t; ++j) {
            s[j] = 0;
            for (int i = 0; i < d; ++i) s[j] += q[t][qo + i] * k[j][ko + i];
            s[j] /= std::sqrt(static_cast<double>(d));
            mx = std::max(mx, s[j]);
          }
          for (double& e : s) sum += (e = std::exp(e - mx));
          for (size_t j = 0; j <= t; ++j)
            for (int i = 0; i < d; ++i) att[qo + i] += s[j] / sum * v[j][ko + i];
        }
        const Vec o = matvec(wo, att, E);
        for (int i = 0; i < E; ++i) x[t][i] += o[i];
        const Vec down = ffn(b, rmsnorm(x[t], fn));
        for (int i = 0; i < E; ++i) x[t][i] += down[i];
      }
    }
    const Vec on = tensor("output_norm.weight");
    const Vec out = has("output.weight") ? tensor("output.weight") : embd;
    std::vector<Vec> res;
    for (const Vec& xt : x) res.push_back(matvec(out, rmsnorm(xt, on), c.n_vocab));
    return res;
  }
};

// The comparison below (1e-4 of the largest logit) can fail: the naive pass without QK-norm, or
// without the frequency factors, is far from the right one.
TEST(ModelForward, NaiveVariantsWithoutQkNormOrFrequencyFactorsDiffer) {
  auto max_rel_diff = [](const std::vector<Vec>& a, const std::vector<Vec>& b) {
    double err = 0, ref = 0;
    for (size_t t = 0; t < a.size(); ++t)
      for (size_t i = 0; i < a[t].size(); ++i) {
        err = std::max(err, std::fabs(a[t][i] - b[t][i]));
        ref = std::max(ref, std::fabs(a[t][i]));
      }
    return err / ref;
  };
  const test::RandomModelConfig q3 = test::random_qwen3_config();
  auto lq = load(q3);
  ASSERT_TRUE(lq);
  const auto tq = test::random_model_tokens(48, q3.n_vocab);
  EXPECT_GT(max_rel_diff(Naive{*lq->file, q3}.logits(tq), Naive{*lq->file, q3, false}.logits(tq)),
            1e-2);

  const test::RandomModelConfig l31 = test::random_llama31_config();
  test::RandomModelConfig no_ff = l31;
  no_ff.rope_freqs.clear();
  auto ll = load(l31);
  ASSERT_TRUE(ll);
  const auto tl = test::random_model_tokens(48, l31.n_vocab);
  EXPECT_GT(max_rel_diff(Naive{*ll->file, l31}.logits(tl), Naive{*ll->file, no_ff}.logits(tl)),
            1e-2);
}

// ---- ModelForward::run ------------------------------------------------------------------------

struct Hooks final : ForwardHooks {
  int n_vocab = 0;
  std::mutex mu;
  std::map<std::pair<int, int>, int> calls;  // (sequence, layer) -> after_attention calls
  std::map<int, std::vector<float>> rows;    // row -> logits
  int max_block = 0;
  int last_row = -1;
  bool ascending = true;
  Status fail;  // returned by after_attention

  Status after_attention(int s, int il, const LayerDesc& layer, int thread) override {
    EXPECT_EQ(layer.kind, LayerKind::kGlobal);
    EXPECT_GE(thread, -1);  // -1: a sequence that attended on the whole pool
    std::lock_guard<std::mutex> lk(mu);
    ++calls[{s, il}];
    return fail;
  }
  void logits(std::span<const int> r, const float* l) override {
    max_block = std::max(max_block, static_cast<int>(r.size()));
    for (size_t i = 0; i < r.size(); ++i) {
      ascending = ascending && r[i] > last_row;
      last_row = r[i];
      rows[r[i]].assign(l + i * n_vocab, l + (i + 1) * n_vocab);
    }
  }
};

void expect_close(const std::vector<float>& got, const Vec& want, const char* what) {
  double max_err = 0, max_ref = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    max_err = std::max(max_err, std::fabs(got[i] - want[i]));
    max_ref = std::max(max_ref, std::fabs(want[i]));
  }
  EXPECT_LE(max_err, 1e-4 * max_ref) << what;
}

// Gemma 3: five sliding-window layers (window 8, RoPE base 1e4) then a global one (the file's
// base), sandwich norms, QK-norm, GeGLU, scaled embeddings; the cache marks the windows and the
// policies' RoPE is the global layers'.
TEST(ModelDesc, Gemma3AlternatesSlidingAndGlobalLayers) {
  const test::RandomModelConfig c = test::random_gemma3_config();
  auto l = load(c);
  ASSERT_TRUE(l);
  const Model& m = *l->model;
  const ModelDesc& md = m.desc();
  EXPECT_EQ(md.embd_scale, std::sqrt(static_cast<float>(c.n_embd)));
  EXPECT_EQ(md.logit_softcap, 0.0f);
  ASSERT_EQ(md.layers.size(), static_cast<size_t>(c.n_layer));
  const KvCacheConfig kc = kv_cache_config(m.hparams(), KvType::kF16);
  ASSERT_EQ(kc.layer_window.size(), static_cast<size_t>(c.n_layer));
  for (int il = 0; il < c.n_layer; ++il) {
    const LayerDesc& d = md.layers[static_cast<size_t>(il)];
    const bool global = il == 5;
    EXPECT_EQ(d.kind, global ? LayerKind::kGlobal : LayerKind::kSliding) << il;
    EXPECT_EQ(d.window, global ? 0 : c.sliding_window) << il;
    EXPECT_EQ(kc.window(il), d.window) << il;
    EXPECT_EQ(kc.layer_compressible(il), global) << il;
    EXPECT_EQ(d.rope.type, RopeType::kNeox);
    EXPECT_EQ(d.rope.head_dim, c.head_dim);
    EXPECT_EQ(d.rope.freq_base, 10000.0f);  // the random file's global base is 1e4 too
    EXPECT_EQ(d.attn_scale, 1.0f / std::sqrt(static_cast<float>(c.head_dim)));
    EXPECT_TRUE(d.norms.attn_pre && d.norms.attn_post && d.norms.ffn_pre && d.norms.ffn_post &&
                d.norms.qk);
    EXPECT_EQ(d.ffn, FfnKind::kGeGluTanh);
    EXPECT_FALSE(d.qkv_bias);
    EXPECT_EQ(m.layer(il).attn_q_norm.size(), static_cast<size_t>(c.head_dim));
    EXPECT_EQ(m.layer(il).ffn_post_norm.size(), static_cast<size_t>(c.n_embd));
  }
  EXPECT_EQ(kc.n_compressible(), 1);
}

// Qwen 3 MoE: Qwen 3's layer (QK-norm, NeoX RoPE, global attention, so KV policies see an
// ordinary model) with a mixture of experts as its feed-forward, each expert's matrices split out
// of the stacked tensors.
TEST(ModelDesc, Qwen3MoeIsTheQwen3LayerWithExperts) {
  const test::RandomModelConfig c = test::random_qwen3moe_config();
  auto l = load(c);
  ASSERT_TRUE(l);
  const Model& m = *l->model;
  EXPECT_EQ(m.hparams().arch, ModelArch::kQwen3Moe);
  EXPECT_EQ(m.hparams().n_expert, c.n_expert);
  EXPECT_EQ(m.hparams().n_expert_used, c.n_expert_used);
  EXPECT_EQ(m.hparams().n_ff_exp, c.n_ff_exp);
  const KvCacheConfig kc = kv_cache_config(m.hparams(), KvType::kF16);
  EXPECT_EQ(kc.n_compressible(), c.n_layer);
  for (int il = 0; il < c.n_layer; ++il) {
    const LayerDesc& d = m.desc().layers[static_cast<size_t>(il)];
    EXPECT_EQ(d.kind, LayerKind::kGlobal);
    EXPECT_EQ(d.rope.type, RopeType::kNeox);
    EXPECT_TRUE(d.norms.qk && d.norms.attn_pre && d.norms.ffn_pre);
    EXPECT_FALSE(d.norms.attn_post || d.norms.ffn_post || d.qkv_bias);
    EXPECT_EQ(d.ffn, FfnKind::kMoeSwiGlu);
    const MoeWeights& moe = m.layer(il).moe;
    EXPECT_EQ(moe.router.n_rows(), c.n_expert);
    ASSERT_EQ(moe.experts.size(), static_cast<size_t>(c.n_expert));
    for (const ExpertWeights& x : moe.experts) {
      EXPECT_EQ(x.gate.n_rows(), c.n_ff_exp);
      EXPECT_EQ(x.up.n_cols(), c.n_embd);
      EXPECT_EQ(x.down.n_rows(), c.n_embd);
      EXPECT_EQ(x.down.n_cols(), c.n_ff_exp);
    }
    EXPECT_EQ(m.layer(il).w_gate.n_rows(), 0);  // no dense feed-forward
  }
  // Expert 5's up matrix is rows [5 * n_ff_exp, 6 * n_ff_exp) of the stack.
  const GgufTensorInfo* t = l->file->find_tensor("blk.1.ffn_up_exps.weight");
  ASSERT_TRUE(t);
  std::vector<float> stack(static_cast<size_t>(t->n_elements())), row(c.n_embd);
  ASSERT_TRUE(l->file->read_tensor(*t, reinterpret_cast<uint8_t*>(stack.data())).ok());
  m.layer(1).moe.experts[5].up.get_row(3, row.data());
  const size_t at = (5 * static_cast<size_t>(c.n_ff_exp) + 3) * c.n_embd;
  EXPECT_TRUE(std::equal(row.begin(), row.end(), stack.begin() + static_cast<ptrdiff_t>(at)));
}

// The random MoE with a router of small weights: no clear winners, so the experts left out hold
// much of the probability and every pair of experts gets chosen somewhere (the fixture of the
// parity tests leaves little to the experts left out: see below).
test::RandomModelConfig qwen3moe_soft_router_config() {
  test::RandomModelConfig c = test::random_qwen3moe_config();
  c.router_scale = 0.1f;
  return c;
}

// The parity fixture's router leaves a clear gap between the last chosen expert and the first
// one left out on every test token and layer, so rounding, here or in llama.cpp, cannot change
// the choice (LlamaParity.RandomQwen3MoeMatchesLlamaCpp relies on it).
TEST(ModelForward, Qwen3MoeParityFixtureRoutesWithClearMargins) {
  const test::RandomModelConfig c = test::random_qwen3moe_config();
  auto l = load(c);
  ASSERT_TRUE(l);
  const Naive naive{*l->file, c};
  naive.logits(test::random_model_tokens(64, c.n_vocab));
  std::printf("smallest router logit gap, chosen vs not: %.3f\n", naive.min_margin);
  EXPECT_GT(naive.min_margin, 0.5);
}

// The comparison with the naive pass can fail: without renormalising the chosen experts' weights
// it is far from the right one.
TEST(ModelForward, NaiveMoeWithoutRenormalisedWeightsDiffers) {
  const test::RandomModelConfig c = qwen3moe_soft_router_config();
  auto l = load(c);
  ASSERT_TRUE(l);
  const auto toks = test::random_model_tokens(48, c.n_vocab);
  const std::vector<Vec> want = Naive{*l->file, c}.logits(toks);
  Naive plain{*l->file, c};
  plain.renormalise = false;
  const std::vector<Vec> got = plain.logits(toks);
  double err = 0, ref = 0;
  for (size_t t = 0; t < want.size(); ++t)
    for (size_t i = 0; i < want[t].size(); ++i) {
      err = std::max(err, std::fabs(want[t][i] - got[t][i]));
      ref = std::max(ref, std::fabs(want[t][i]));
    }
  EXPECT_GT(err / ref, 1e-2);
}

TEST(ModelForward, MicroBatchesOfSeveralSequencesMatchANaiveForwardPass) {
  for (const auto& c : {gqa_llama_config(), test::random_qwen2_config(),
                        test::random_qwen3_config(), test::random_llama31_config(),
                        test::random_qwen3moe_config(), qwen3moe_soft_router_config()}) {
    SCOPED_TRACE(c.arch + (c.rope_freqs.empty() ? "" : " with RoPE frequency factors"));
    auto l = load(c);
    ASSERT_TRUE(l);
    const Model& m = *l->model;
    const Naive naive{*l->file, c};
    // Three sequences: prompts of 40, 5 and 1 tokens (40 logits rows: two logits blocks), then
    // three decode steps of one token each, all in the same micro-batches.
    const std::vector<int> prompt_len = {40, 5, 1};
    constexpr int kSteps = 3;
    std::vector<std::vector<int32_t>> toks;
    for (size_t s = 0; s < prompt_len.size(); ++s) {
      toks.push_back(
          test::random_model_tokens(prompt_len[s] + kSteps + 11 * static_cast<int>(s), c.n_vocab));
      toks.back().erase(toks.back().begin(), toks.back().begin() + 11 * static_cast<long>(s));
    }
    std::vector<std::vector<Vec>> want;
    for (const auto& t : toks) want.push_back(naive.logits(t));

    for (AttnSplit split :
         {AttnSplit::kAuto, AttnSplit::kWithinSequence, AttnSplit::kAcrossSequences}) {
      SCOPED_TRACE(attn_split_name(split));
      ThreadPool pool(2);
      auto fwd = ModelForward::create(m, pool, ForwardOptions{64, split});
      std::vector<std::unique_ptr<KvCache>> caches;
      for (size_t s = 0; s < toks.size(); ++s)
        caches.push_back(std::make_unique<KvCache>(kv_cache_config(m.hparams(), KvType::kF32)));
      for (int step = 0; step <= kSteps; ++step) {
        std::vector<int32_t> tokens, pos;
        std::vector<SeqRows> seqs;
        std::vector<int> logit_rows;
        for (size_t s = 0; s < toks.size(); ++s) {
          const int from = step == 0 ? 0 : prompt_len[s] + step - 1;
          const int to = prompt_len[s] + step;
          SeqRows sr;
          sr.cache = caches[s].get();
          sr.r0 = static_cast<int>(tokens.size());
          for (int t = from; t < to; ++t) {
            logit_rows.push_back(static_cast<int>(tokens.size()));
            tokens.push_back(toks[s][static_cast<size_t>(t)]);
            pos.push_back(t);
          }
          sr.r1 = static_cast<int>(tokens.size());
          sr.layer_hook = to - from == 1 && s != 1;  // the second sequence never asks
          seqs.push_back(sr);
        }
        Hooks hooks;
        hooks.n_vocab = c.n_vocab;
        ForwardTimings ft;
        const UbatchInput in{tokens, pos, seqs, logit_rows};
        ASSERT_TRUE(fwd->run(in, hooks, ft).ok());
        EXPECT_TRUE(hooks.ascending);
        EXPECT_LE(hooks.max_block, ForwardHooks::kLogitRows);
        ASSERT_EQ(hooks.rows.size(), logit_rows.size());
        for (size_t s = 0; s < seqs.size(); ++s) {
          for (int r = seqs[s].r0; r < seqs[s].r1; ++r) {
            expect_close(hooks.rows[r], want[s][static_cast<size_t>(pos[static_cast<size_t>(r)])],
                         c.arch.c_str());
          }
          for (int il = 0; il < c.n_layer; ++il)
            EXPECT_EQ(caches[s]->layer(il).n_slot(), prompt_len[s] + step);
          // Called back exactly for the decode rows that asked, whether they ran one sequence
          // per task or on the whole pool: each of the sequence's layers once.
          const bool called = seqs[s].layer_hook;
          for (int il = 0; il < c.n_layer; ++il) {
            const int n_calls = hooks.calls[std::make_pair(static_cast<int>(s), il)];
            EXPECT_EQ(n_calls, called ? 1 : 0)
                << "step " << step << " sequence " << s << " layer " << il;
          }
        }
        EXPECT_GE(ft.matmul_s, 0.0);
        EXPECT_GE(ft.attention_s, 0.0);
      }
    }
  }
}

TEST(ModelForward, AnAfterAttentionErrorFailsThePass) {
  auto l = load(gqa_llama_config());
  ASSERT_TRUE(l);
  ThreadPool pool(2);
  auto fwd = ModelForward::create(*l->model, pool, ForwardOptions{8, AttnSplit::kAuto});
  KvCache a(kv_cache_config(l->model->hparams(), KvType::kF16));
  KvCache b(kv_cache_config(l->model->hparams(), KvType::kF16));
  const std::vector<int32_t> tokens = {5, 6}, pos = {0, 0};
  std::vector<SeqRows> seqs(2);
  seqs[0].cache = &a;
  seqs[0].r0 = 0;
  seqs[0].r1 = 1;
  seqs[0].layer_hook = true;
  seqs[1].cache = &b;
  seqs[1].r0 = 1;
  seqs[1].r1 = 2;
  Hooks hooks;
  hooks.n_vocab = l->model->hparams().n_vocab;
  hooks.fail = invalid_argument("refused");
  ForwardTimings ft;
  const Status st = fwd->run(UbatchInput{tokens, pos, seqs, {}}, hooks, ft);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.to_string().find("refused"), std::string::npos);
  EXPECT_EQ(hooks.calls.size(), 1u);  // layer 0 of sequence 0, then the pass stops
  EXPECT_TRUE(hooks.rows.empty());
}

}  // namespace
}  // namespace d2o
