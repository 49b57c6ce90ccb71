#include "model/blocks.h"

#include <algorithm>
#include <cmath>

#include "core/assert.h"
#include "core/timer.h"
#include "ops/ops.h"

namespace d2o {

void Activations::ensure(const ModelHParams& h, int n_rows) {
  if (n_rows <= rows_cap) return;
  const size_t n = static_cast<size_t>(n_rows);
  const size_t hd = static_cast<size_t>(std::max(h.head_dim, h.head_dim_swa));
  const size_t q_dim = static_cast<size_t>(h.n_head) * hd;
  const size_t kv_dim = static_cast<size_t>(h.n_head_kv) * hd;
  x.resize(n * h.n_embd);
  xn.resize(n * std::max<size_t>(h.n_embd, q_dim));
  q.resize(n * q_dim);
  k.resize(n * kv_dim);
  v.resize(n * kv_dim);
  attn_out.resize(n * q_dim);
  const size_t n_ff = h.n_expert > 0 ? 0 : static_cast<size_t>(h.n_ff);
  gate.resize(n * n_ff);
  up.resize(n * n_ff);
  if (h.arch == ModelArch::kQwen35) {
    q_gate.resize(n * 2 * q_dim);
    gate_attn.resize(n * q_dim);
  }
  rows_cap = n_rows;
}

BlockPass::BlockPass(const ModelHParams& h, ThreadPool& pool, Activations& a, int n_rows,
                     ForwardTimings& t)
    : h_(h), pool_(pool), a_(a), n_(n_rows), t_(t) {}

void BlockPass::mm(const QMatrix& w, const float* in, float* out) {
  Stopwatch s;
  matmul(w, in, n_, out, pool_);
  t_.matmul_s += s.seconds();
}

// Products that read the same input run as one parallel region, quantising it once.
void BlockPass::mm_many(std::initializer_list<MatmulCall> calls) {
  Stopwatch s;
  matmul_many(std::span<const MatmulCall>(calls.begin(), calls.size()), n_, pool_);
  t_.matmul_s += s.seconds();
}

void BlockPass::embed(const QMatrix& table, std::span<const int32_t> tokens, float scale) {
  const int n_embd = h_.n_embd;
  float* x = a_.x.data();
  pool_.parallel_for(n_, 16, [&](int64_t b, int64_t end, int) {
    for (int64_t r = b; r < end; ++r) {
      float* row = x + r * n_embd;
      table.get_row(tokens[static_cast<size_t>(r)], row);
      if (scale != 1.0f)
        for (int i = 0; i < n_embd; ++i) row[i] *= scale;
    }
  });
}

void BlockPass::post_norm(const std::vector<float>& w) {
  const int n_embd = h_.n_embd;
  float* xn = a_.xn.data();
  pool_.parallel_for(n_, 16, [&](int64_t b, int64_t end, int) {
    for (int64_t r = b; r < end; ++r)
      rmsnorm(xn + r * n_embd, w.data(), h_.rms_eps, n_embd, xn + r * n_embd);
  });
}

void BlockPass::norm(const std::vector<float>& w) {
  const int n_embd = h_.n_embd;
  const bool pending = residual_pending_;
  float* x = a_.x.data();
  float* xn = a_.xn.data();
  pool_.parallel_for(n_, 16, [&](int64_t b, int64_t end, int) {
    for (int64_t r = b; r < end; ++r) {
      if (pending) add_inplace(x + r * n_embd, xn + r * n_embd, n_embd);
      rmsnorm(x + r * n_embd, w.data(), h_.rms_eps, n_embd, xn + r * n_embd);
    }
  });
  residual_pending_ = false;
}

void BlockPass::add_residual() {
  const int n_embd = h_.n_embd;
  const bool pending = residual_pending_;
  float* x = a_.x.data();
  const float* xn = a_.xn.data();
  pool_.parallel_for(n_, 16, [&](int64_t b, int64_t end, int) {
    for (int64_t r = b; r < end; ++r) {
      if (pending) add_inplace(x + r * n_embd, xn + r * n_embd, n_embd);
    }
  });
  residual_pending_ = false;
}

void BlockPass::qkv_rope(const LayerWeights& L, const LayerDesc& d, std::span<const int32_t> pos) {
  mm_many({{&L.wq, a_.xn.data(), a_.q.data()},
           {&L.wk, a_.xn.data(), a_.k.data()},
           {&L.wv, a_.xn.data(), a_.v.data()}});
  bias_norm_rope(L, d, pos);
}

void BlockPass::gated_qkv_rope(const LayerWeights& L, const LayerDesc& d,
                               std::span<const int32_t> pos) {
  D2O_ASSERT(d.attn_gate && !d.qkv_bias);
  const int hd = h_.head_dim, q_dim = h_.n_head * hd;
  mm_many({{&L.wq, a_.xn.data(), a_.q_gate.data()},
           {&L.wk, a_.xn.data(), a_.k.data()},
           {&L.wv, a_.xn.data(), a_.v.data()}});
  pool_.parallel_for(n_, 16, [&](int64_t b, int64_t end, int) {
    for (int64_t r = b; r < end; ++r) {
      const float* qg = a_.q_gate.data() + r * 2 * q_dim;  // [n_head, 2, head_dim]
      for (int h = 0; h < h_.n_head; ++h) {
        std::copy_n(qg + 2 * h * hd, hd, a_.q.data() + r * q_dim + h * hd);
        std::copy_n(qg + (2 * h + 1) * hd, hd, a_.gate_attn.data() + r * q_dim + h * hd);
      }
    }
  });
  bias_norm_rope(L, d, pos);
}

void BlockPass::gate_attention() {
  const int q_dim = h_.n_head * h_.head_dim;
  pool_.parallel_for(n_, 16, [&](int64_t b, int64_t end, int) {
    for (int64_t r = b; r < end; ++r) {
      float* o = a_.attn_out.data() + r * q_dim;
      const float* g = a_.gate_attn.data() + r * q_dim;
      for (int i = 0; i < q_dim; ++i) o[i] *= 1.0f / (1.0f + std::exp(-g[i]));
    }
  });
}

void BlockPass::bias_norm_rope(const LayerWeights& L, const LayerDesc& d,
                               std::span<const int32_t> pos) {
  const int q_dim = h_.n_head * h_.head_dim;
  const int kv_dim = h_.n_head_kv * h_.head_dim;
  const RopeParams& rope = d.rope;
  pool_.parallel_for(n_, 16, [&](int64_t b, int64_t end, int) {
    for (int64_t r = b; r < end; ++r) {
      float* q = a_.q.data() + r * q_dim;
      float* k = a_.k.data() + r * kv_dim;
      if (d.qkv_bias) {
        add_inplace(q, L.bq.data(), q_dim);
        add_inplace(k, L.bk.data(), kv_dim);
        add_inplace(a_.v.data() + r * kv_dim, L.bv.data(), kv_dim);
      }
      if (d.norms.qk) {
        const int hd = h_.head_dim;
        for (int h = 0; h < h_.n_head; ++h)
          rmsnorm(q + h * hd, L.attn_q_norm.data(), h_.rms_eps, hd, q + h * hd);
        for (int h = 0; h < h_.n_head_kv; ++h)
          rmsnorm(k + h * hd, L.attn_k_norm.data(), h_.rms_eps, hd, k + h * hd);
      }
      float cos_t[kRopeMaxPairs], sin_t[kRopeMaxPairs];
      rope_tables(rope, static_cast<float>(pos[static_cast<size_t>(r)]), cos_t, sin_t);
      rope_apply_tables(rope, cos_t, sin_t, h_.n_head, q);
      rope_apply_tables(rope, cos_t, sin_t, h_.n_head_kv, k);
    }
  });
}

Status BlockPass::attention(KvAttention& attn, int il, const LayerDesc& d, const UbatchInput& in,
                            ForwardHooks& hooks) {
  Stopwatch s;
  Status st = attn.run(il, d, in, a_.q.data(), a_.k.data(), a_.v.data(), a_.attn_out.data(), hooks);
  t_.attention_s += s.seconds();
  return st;
}

void BlockPass::attn_output(const QMatrix& wo) {
  mm(wo, a_.attn_out.data(), a_.xn.data());
  residual_pending_ = true;
}

void BlockPass::ffn(const LayerWeights& L, FfnKind kind) {
  D2O_ASSERT(kind == FfnKind::kSwiGlu || kind == FfnKind::kGeGluTanh);
  const int n_ff = h_.n_ff;
  mm_many({{&L.w_gate, a_.xn.data(), a_.gate.data()}, {&L.w_up, a_.xn.data(), a_.up.data()}});
  float* gate = a_.gate.data();
  const float* up = a_.up.data();
  const auto act = kind == FfnKind::kGeGluTanh ? geglu_tanh : swiglu;
  pool_.parallel_for(n_, 16, [&](int64_t b, int64_t end, int) {
    for (int64_t r = b; r < end; ++r) act(gate + r * n_ff, up + r * n_ff, n_ff, gate + r * n_ff);
  });
  mm(L.w_down, a_.gate.data(), a_.xn.data());
  residual_pending_ = true;
}

void BlockPass::moe_ffn(const MoeWeights& w, MoeFfn& moe) {
  moe.run(h_, w, a_.xn.data(), n_, pool_, t_);
  residual_pending_ = true;
}

void BlockPass::delta_net(const DeltaNetWeights& w, DeltaNet& dn, int il, const UbatchInput& in) {
  dn.run(h_, w, il, in, a_.xn.data(), pool_, t_);
  residual_pending_ = true;
}

void BlockPass::logits(const std::vector<float>& norm_w, const QMatrix& output,
                       std::span<const int> rows, ForwardHooks& hooks, float softcap) {
  if (rows.empty()) return;
  const int n_embd = h_.n_embd;
  constexpr int kRows = ForwardHooks::kLogitRows;
  if (a_.logits.size() < static_cast<size_t>(kRows) * h_.n_vocab) {
    a_.logits.resize(static_cast<size_t>(kRows) * h_.n_vocab);
  }
  for (size_t w0 = 0; w0 < rows.size(); w0 += kRows) {
    const size_t cnt = std::min<size_t>(kRows, rows.size() - w0);
    for (size_t i = 0; i < cnt; ++i) {
      const size_t r = static_cast<size_t>(rows[w0 + i]);
      rmsnorm(a_.x.data() + r * n_embd, norm_w.data(), h_.rms_eps, n_embd,
              a_.xn.data() + i * n_embd);
    }
    Stopwatch s;
    matmul(output, a_.xn.data(), static_cast<int64_t>(cnt), a_.logits.data(), pool_);
    t_.matmul_s += s.seconds();
    if (softcap > 0.0f) {
      float* l = a_.logits.data();
      const int64_t n = static_cast<int64_t>(cnt) * h_.n_vocab;
      pool_.parallel_for(n, 4096, [&](int64_t b, int64_t end, int) {
        for (int64_t i = b; i < end; ++i) l[i] = softcap * std::tanh(l[i] / softcap);
      });
    }
    hooks.logits(rows.subspan(w0, cnt), a_.logits.data());
  }
}

}  // namespace d2o
