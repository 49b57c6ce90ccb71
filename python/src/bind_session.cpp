// d2o._d2o.Session: one sequence whose compressed cache persists across calls, as a server
// session's does between turns.
#include <mutex>

#include "bind_common.h"
#include "eval/kv_bytes.h"
#include "kv/policy.h"

namespace d2o::py {

namespace {

class PySession {
 public:
  PySession(std::shared_ptr<PyModel> model, const CacheConfig& c)
      : model_(std::move(model)), seq_(value_or_raise(model_->new_sequence(c, &mem_))) {}

  // Generation goes on from everything fed so far. The last token generate() samples is not fed
  // (nor an end-of-generation token that ended it): it goes before the next call's tokens.
  pyb::dict generate(const std::vector<TokenId>& ids, const GenOptions& o,
                     const pyb::object& on_text) {
    ok_or_raise(model_->check_ids(ids, "prompt"));
    std::vector<TokenId> in = take_unfed(ids);
    pyb::dict d = guarded([&] { return run_generate(*model_, *seq_, in, o, on_text, bounded()); });
    if (!d.contains("tokens")) {  // cancelled: what was fed is not known token by token
      broken_ = true;
      return d;
    }
    unfed_.clear();
    history_.insert(history_.end(), ids.begin(), ids.end());  // (unfed_ is in it already)
    const auto toks = d["tokens"].cast<std::vector<TokenId>>();
    history_.insert(history_.end(), toks.begin(), toks.end());
    const std::string reason = d["stop_reason"].cast<std::string>();
    if (!toks.empty() && reason != "eog") unfed_.push_back(toks.back());
    return d;
  }

  pyb::array_t<float> logits(const std::vector<TokenId>& ids, int64_t context_end, int chunk) {
    ok_or_raise(model_->check_ids(ids, "input"));
    const size_t skip = unfed_.size();
    std::vector<TokenId> in = take_unfed(ids);
    const int64_t ce = context_end > 0 ? context_end + static_cast<int64_t>(skip) : 0;
    pyb::array_t<float> all =
        guarded([&] { return run_logits(*model_, *seq_, in, ce, chunk, bounded()); });
    unfed_.clear();
    history_.insert(history_.end(), ids.begin(), ids.end());  // (unfed_ is in it already)
    if (skip == 0) return all;
    pyb::module_ np = pyb::module_::import("numpy");
    const pyb::slice rows(static_cast<pyb::ssize_t>(skip), static_cast<pyb::ssize_t>(in.size()), 1);
    return np.attr("ascontiguousarray")(all[rows]);
  }

  // As logits(), without computing any.
  void feed(const std::vector<TokenId>& ids, int64_t context_end, int chunk) {
    ok_or_raise(model_->check_ids(ids, "input"));
    const int64_t skip = static_cast<int64_t>(unfed_.size());
    std::vector<TokenId> in = take_unfed(ids);
    if (in.empty()) throw pyb::value_error("no tokens to feed");
    guarded([&] {
      Status s;
      {
        pyb::gil_scoped_release nogil;
        std::lock_guard<std::mutex> lock(model_->mutex());
        if (bounded()) s = model_->bound_growth(*seq_, std::ssize(in), 0, chunk);
        if (s.ok())
          s = model_->score(*seq_, in, context_end > 0 ? context_end + skip : 0, chunk, {});
      }
      ok_or_raise(s);
      return 0;
    });
    unfed_.clear();
    history_.insert(history_.end(), ids.begin(), ids.end());  // (unfed_ is in it already)
  }

  pyb::dict kv_report() const;
  int64_t n_past() const { return seq_->n_past(); }
  const std::vector<TokenId>& history() const { return history_; }
  std::string spec() const { return seq_->policy().spec(); }

 private:
  // The tokens a call feeds: those still unfed, then `ids` (unfed_ is cleared once they went in).
  std::vector<TokenId> take_unfed(const std::vector<TokenId>& ids) const {
    if (broken_)
      throw pyb::value_error(
          "this session's last generation was stopped early or failed partway (what it fed is "
          "not known token by token); start a new one");
    std::vector<TokenId> in = unfed_;
    in.insert(in.end(), ids.begin(), ids.end());
    return in;
  }

  // A sequence of kv_mem_per_seq: its growth is bounded before each call (PyModel::bound_growth).
  bool bounded() const { return !mem_.asked.empty(); }

  // Runs a call that feeds the sequence; when it raises after the sequence took some of its
  // tokens (a pass that failed midway: a capped full cache reached in decoding), what was fed is
  // not known token by token and the session is marked unusable, as a stopped generation is.
  template <class F>
  auto guarded(F&& f) -> decltype(f()) {
    const int64_t before = seq_->n_past();
    try {
      return f();
    } catch (...) {
      if (seq_->n_past() != before) broken_ = true;
      throw;
    }
  }

  std::shared_ptr<PyModel> model_;
  KvMemChoice mem_;  // what kv_mem_per_seq chose (empty without it)
  std::unique_ptr<Sequence> seq_;
  std::vector<TokenId> history_;  // every token given or generated, fed or not
  std::vector<TokenId> unfed_;
  bool broken_ = false;
};

pyb::dict PySession::kv_report() const {
  const KvCache& c = seq_->cache();
  const PolicyState& st = seq_->policy_state();
  pyb::list layers;
  int64_t held = 0;
  for (int il = 0; il < c.n_layer(); ++il) {
    const KvLayer& L = c.layer(il);
    const size_t i = static_cast<size_t>(il);
    pyb::dict l;
    l["layer"] = il;
    l["slots"] = L.n_slot();
    l["window"] = c.config().window(il);
    const bool has_budget =
        st.budgets_set && i < st.budgets.size() && st.budgets[i] != PolicyState::kNoBudget;
    l["budget"] = has_budget ? pyb::object(pyb::int_(st.budgets[i])) : pyb::none();
    l["evicted"] = i < st.evicted.size() ? st.evicted[i] : 0;
    l["merged"] = i < st.merged.size() ? st.merged[i] : 0;
    layers.append(l);
    held += L.held_slots() / L.n_head_kv();
  }
  pyb::dict d;
  d["spec"] = seq_->policy().spec();
  d["kv_type"] = kv_type_name(c.config().type);
  d["n_past"] = seq_->n_past();
  d["slots"] = held;
  d["kv_bytes"] = held * static_cast<int64_t>(eval::kv_slot_bytes(c.config()));
  d["kv_bytes_allocated"] = c.kv_bytes_allocated();
  d["kv_bytes_peak"] = c.peak_bytes_allocated();
  d["full_kv_bytes"] = eval::full_kv_bytes(c.config(), seq_->n_past());
  d["full_f16_kv_bytes"] = eval::full_kv_bytes(eval::f16_config(c.config()), seq_->n_past());
  d["layers"] = layers;
  if (mem_.asked.empty()) {
    d["kv_mem_per_seq"] = pyb::none();
  } else {
    pyb::dict m;
    m["asked"] = mem_.asked;
    m["bytes"] = mem_.bytes;
    m["slots"] = mem_.slots;
    m["full_cap"] = mem_.full_cap;
    m["note"] = mem_.note;
    d["kv_mem_per_seq"] = m;
  }
  return d;
}

}  // namespace

void bind_session(pyb::module_& mod) {
  pyb::class_<PySession>(mod, "_Session")
      .def(pyb::init([](std::shared_ptr<PyModel> m, const std::string& kv,
                        const std::string& kv_type, const std::string& kv_mem) {
             return std::make_unique<PySession>(std::move(m), CacheConfig{kv, kv_type, kv_mem});
           }),
           pyb::arg("model"), pyb::arg("kv"), pyb::arg("kv_type"), pyb::arg("kv_mem_per_seq"))
      .def("generate", &PySession::generate, pyb::arg("ids"), pyb::arg("options"),
           pyb::arg("on_text"))
      .def("logits", &PySession::logits, pyb::arg("ids"), pyb::arg("context_end"),
           pyb::arg("chunk"))
      .def("feed", &PySession::feed, pyb::arg("ids"), pyb::arg("context_end"), pyb::arg("chunk"))
      .def("kv_report", &PySession::kv_report)
      .def_property_readonly("n_past", &PySession::n_past)
      .def_property_readonly("tokens", &PySession::history)
      .def_property_readonly("spec", &PySession::spec);
}

}  // namespace d2o::py
