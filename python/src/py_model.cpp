#include "py_model.h"

#include <algorithm>

#include "gguf/gguf.h"
#include "kv/kv_cache.h"
#include "kv/policy.h"
#include "runtime/kv_mem_budget.h"
#include "runtime/kv_pool.h"
#include "runtime/scheduler.h"

namespace d2o::py {

Result<std::unique_ptr<PyModel>> PyModel::load(const ModelConfig& c) {
  if (c.threads < 0 || c.threads > 1024)
    return invalid_argument("threads must be within 0..1024 (0: all cores), got " +
                            std::to_string(c.threads));
  if (c.n_ctx < 0 || c.n_ctx > (1 << 24))
    return invalid_argument(
        "ctx must be within 0..16777216 (0: the model's trained context), got " +
        std::to_string(c.n_ctx));
  if (c.n_ubatch < 1 || c.n_ubatch > (1 << 16))
    return invalid_argument("ubatch must be within 1..65536");
  auto m = std::unique_ptr<PyModel>(new PyModel());
  m->path_ = c.path;
  D2O_ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> file, GgufFile::open(c.path));
  D2O_ASSIGN_OR_RETURN(m->model_, Model::load(*file, ModelLoadOptions{}));
  auto tok = Tokenizer::from_gguf(*file);
  if (!tok.ok()) return tok.status().with_context(c.path);
  m->tok_ = std::move(tok).value();
  if (auto t = ChatTemplate::from_gguf(*file); t.ok()) {
    m->tmpl_ = *t;
  } else {
    m->tmpl_error_ = t.status().message();
  }
  const int trained = m->model_->hparams().n_ctx_train;
  m->n_ctx_ = c.n_ctx > 0 ? c.n_ctx : trained;
  m->pool_ = std::make_unique<ThreadPool>(c.threads);
  EngineOptions eo;
  eo.n_ubatch = c.n_ubatch;
  m->engine_ = std::make_unique<Engine>(*m->model_, *m->pool_, eo);
  return m;
}

Result<std::string> PyModel::chat_text(const std::vector<ChatMessage>& messages) const {
  if (!tmpl_) return invalid_argument("the model has no usable chat template: " + tmpl_error_);
  return tmpl_->apply(messages, /*add_generation_prompt=*/true);
}

std::vector<std::string> PyModel::chat_stops() const {
  return tmpl_ ? tmpl_->stop_strings() : std::vector<std::string>{};
}

Status PyModel::check_ids(std::span<const TokenId> ids, const std::string& what) const {
  for (TokenId t : ids) {
    if (t < 0 || t >= n_vocab()) {
      return invalid_argument(what + " token id " + std::to_string(t) +
                              " is out of range (vocabulary size " + std::to_string(n_vocab()) +
                              ")");
    }
  }
  return {};
}

Result<std::unique_ptr<Sequence>> PyModel::new_sequence(const CacheConfig& c,
                                                        KvMemChoice* mem) const {
  auto type = parse_kv_type(c.kv_type);
  if (!type.ok()) return type.status().with_context("--kv-type");
  if (Status s = check_kv_type(*type, hparams().head_dim); !s.ok())
    return s.with_context("--kv-type");
  std::string spec = c.kv;
  KvMemChoice chosen;
  if (!c.kv_mem_per_seq.empty()) {
    // As `d2o run --kv-mem-per-seq` (tools/d2o/common.cpp, load_all).
    D2O_ASSIGN_OR_RETURN(spec,
                         spec_for_kv_mem(c.kv, c.kv_mem_per_seq, kv_cache_config(hparams(), *type),
                                         hparams().n_ctx_train, &chosen.slots));
    D2O_ASSIGN_OR_RETURN(chosen.bytes, parse_byte_size(c.kv_mem_per_seq));
    chosen.asked = c.kv_mem_per_seq;
  }
  auto pol = parse_kv_policy(spec);
  if (!pol.ok()) return pol.status().with_context("--kv");
  std::shared_ptr<const KvPolicy> policy(std::move(pol).value());
  if (!chosen.asked.empty()) {
    chosen.full_cap = policy->spec() == "full";
    chosen.note = kv_mem_note(chosen.asked, *type, chosen.slots, chosen.full_cap);
  }
  auto seq = std::make_unique<Sequence>(hparams(), *type, policy);
  // No layer holds more slots than the context (nor than a capped full cache's cap), and a
  // reconstructing policy's one pass more.
  int64_t most = n_ctx_;
  if (chosen.full_cap) most = std::min<int64_t>(most, chosen.slots);
  most += policy->reconstruction_chunk(seq->policy_state());
  D2O_RETURN_IF_ERROR(seq->cache().set_slot_limit(static_cast<int>(most)));
  if (mem) *mem = std::move(chosen);
  return seq;
}

Status PyModel::check_cap(const Sequence& seq, int64_t n) const {
  const int limit = seq.cache().slot_limit();
  if (!seq.policy().is_full() || limit <= 0 || limit >= n_ctx_ || seq.n_past() + n <= limit)
    return {};
  return resource_exhausted(
      std::to_string(n) + " tokens" +
      (seq.n_past() > 0 ? " after " + std::to_string(seq.n_past()) : "") +
      " do not fit in the full cache's " + std::to_string(limit) +
      " slots per KV head and layer, its cap from kv_mem_per_seq; give it more memory or use a "
      "compressing policy");
}

Status PyModel::bound_growth(Sequence& seq, int64_t n_new, int64_t n_gen, int chunk) const {
  if (seq.policy().is_full()) return {};  // capped at its slots already
  FeedPlan plan;
  plan.n_prompt = seq.n_past() + n_new;  // (a continued sequence: as if all of it were the prompt)
  plan.n_total = plan.n_prompt + std::max<int64_t>(n_gen, 0);
  plan.prompt_chunk =
      static_cast<int>(chunk > 0 ? std::min<int64_t>(chunk, std::max<int64_t>(n_new, 1))
                                 : std::clamp<int64_t>(n_new, 1, n_ctx_));
  plan.decode_chunk = 1;
  plan.n_head_kv = seq.cache().config().n_head_kv;
  int64_t most = std::min<int64_t>(n_ctx_, seq.policy().peak_slots_for(plan));
  most += seq.policy().reconstruction_chunk(seq.policy_state());
  // Never below what a layer has allocated already (set_slot_limit refuses that).
  const KvCache& c = seq.cache();
  for (int il = 0; il < c.n_layer(); ++il) {
    if (c.config().window(il) == 0) most = std::max<int64_t>(most, c.layer(il).capacity());
  }
  return seq.cache().set_slot_limit(static_cast<int>(std::max<int64_t>(most, 1)));
}

Result<GenerateResult> PyModel::generate(Sequence& seq, std::span<const TokenId> ids,
                                         GenerateParams gp,
                                         const std::function<void(std::string_view)>& on_text) {
  D2O_RETURN_IF_ERROR(check_ids(ids, "prompt"));
  D2O_RETURN_IF_ERROR(check_cap(seq, std::ssize(ids)));
  gp.max_positions = n_ctx_;
  return d2o::generate(*engine_, *tok_, seq, ids, gp, on_text);
}

Status PyModel::score(Sequence& seq, std::span<const TokenId> ids, int64_t context_end, int chunk,
                      const RowFn& fn) {
  const int64_t n = std::ssize(ids);
  if (n == 0) return invalid_argument("no tokens to score");
  D2O_RETURN_IF_ERROR(check_ids(ids, "input"));
  if (context_end < 0 || (context_end > 0 && context_end >= n)) {
    return invalid_argument("context_end is " + std::to_string(context_end) + " but there are " +
                            std::to_string(n) +
                            " tokens; the context must end before the tokens do");
  }
  if (seq.n_past() + n > n_ctx_) {
    return invalid_argument(std::to_string(n) + " tokens" +
                            (seq.n_past() > 0 ? " after " + std::to_string(seq.n_past()) : "") +
                            " do not fit in the context of " + std::to_string(n_ctx_) +
                            " tokens; load the model with a larger ctx");
  }
  if (chunk < 0) return invalid_argument("chunk must be >= 0 (0: one pass)");
  D2O_RETURN_IF_ERROR(check_cap(seq, n));
  if (context_end == 0) return feed(seq, ids, 0, chunk, fn);
  const size_t ce = static_cast<size_t>(context_end);
  D2O_RETURN_IF_ERROR(feed(seq, ids.first(ce), 0, chunk, fn));
  return feed(seq, ids.subspan(ce), ce, chunk, fn);
}

// One prompt: its passes announce the rest (BatchEntry::prompt_rest), so a ratio policy compacts
// after the last, and every pass gives the logits of all its tokens. The passes are cut as the
// server's scheduler cuts a prompt (Scheduler::split_prompt), so that with the same chunk the
// logits are the server's bit for bit.
Status PyModel::feed(Sequence& seq, std::span<const TokenId> ids, size_t first_row, int chunk,
                     const RowFn& fn) {
  const int window = seq.policy().is_full() ? 0 : seq.policy().needs().window;
  BatchEntry be;
  be.seq = &seq;
  be.logits_from = fn ? 0 : BatchEntry::kNoLogits;
  size_t at = 0;
  const LogitsSink sink = [&](int, int token, const float* l) {
    if (fn) fn(first_row + at + static_cast<size_t>(token), l);
  };
  const int64_t n = std::ssize(ids);
  for (const int c : Scheduler::split_prompt(n, chunk > 0 ? chunk : static_cast<int>(n), window)) {
    be.tokens = ids.subspan(at, static_cast<size_t>(c));
    be.prompt_rest = static_cast<int64_t>(ids.size() - at - static_cast<size_t>(c));
    D2O_RETURN_IF_ERROR(engine_->forward({&be, 1}, sink));
    at += static_cast<size_t>(c);
  }
  return {};
}

}  // namespace d2o::py
