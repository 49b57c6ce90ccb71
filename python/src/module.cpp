// d2o._d2o: the engine's Python bindings (the package d2o wraps them; python/d2o/__init__.py).
// Every call that runs the model releases the GIL and holds the model's lock instead; every
// failure is a Python exception (bind_common.h says which).
#include <algorithm>
#include <mutex>

#include "bind_common.h"
#include "eval/perplexity.h"
#include "kv/policy.h"
#include "kv/policy/spec_docs.h"

namespace d2o::py {

namespace {

std::vector<ChatMessage> to_messages(const std::vector<std::pair<std::string, std::string>>& m) {
  std::vector<ChatMessage> out;
  for (const auto& [role, content] : m) out.push_back({role, content});
  return out;
}

std::vector<TokenId> tokenize(const PyModel& m, const std::string& text, bool add_special,
                              bool parse_special) {
  EncodeOptions enc;
  enc.add_special = add_special;
  enc.parse_special = parse_special;
  return value_or_raise(m.tokenizer().encode(text, enc));
}

std::string detokenize(const PyModel& m, const std::vector<TokenId>& ids, bool render_special) {
  ok_or_raise(m.check_ids(ids, "the"));
  return value_or_raise(m.tokenizer().decode(ids, render_special));
}

pyb::dict one_shot_generate(PyModel& m, const std::vector<TokenId>& ids, const std::string& kv,
                            const std::string& kv_type, const std::string& kv_mem,
                            const GenOptions& o, const pyb::object& on_text) {
  std::unique_ptr<Sequence> seq = value_or_raise(m.new_sequence({kv, kv_type, kv_mem}));
  return run_generate(m, *seq, ids, o, on_text, !kv_mem.empty());
}

pyb::array_t<float> one_shot_logits(PyModel& m, const std::vector<TokenId>& ids,
                                    const std::string& kv, const std::string& kv_type,
                                    const std::string& kv_mem, int64_t context_end, int chunk) {
  std::unique_ptr<Sequence> seq = value_or_raise(m.new_sequence({kv, kv_type, kv_mem}));
  return run_logits(m, *seq, ids, context_end, chunk, !kv_mem.empty());
}

// Negative log-likelihood (natural log) of every token from the second on given those before
// it: [i] is token i + 1's; with context_end, those of the tokens from context_end on only.
std::vector<double> one_shot_nll(PyModel& m, const std::vector<TokenId>& ids, const std::string& kv,
                                 const std::string& kv_type, const std::string& kv_mem,
                                 int64_t context_end, int chunk) {
  if (ids.size() < 2) throw pyb::value_error("scoring needs at least 2 tokens");
  std::unique_ptr<Sequence> seq = value_or_raise(m.new_sequence({kv, kv_type, kv_mem}));
  const size_t first = context_end > 0 ? static_cast<size_t>(context_end) - 1 : 0;
  std::vector<double> nll(ids.size() - 1 - std::min(first, ids.size() - 1));
  Status s;
  {
    pyb::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(m.mutex());
    if (!kv_mem.empty()) s = m.bound_growth(*seq, std::ssize(ids), 0, chunk);
    if (s.ok())
      s = m.score(*seq, ids, context_end, chunk, [&](size_t row, const float* l) {
        if (row < first || row + 1 >= ids.size()) return;
        nll[row - first] = -log_prob(l, m.n_vocab(), ids[row + 1]);
      });
  }
  ok_or_raise(s);
  return nll;
}

pyb::list policy_docs() {
  pyb::list out;
  for (const PolicyPresetDoc& p : policy_preset_docs()) {
    pyb::dict d;
    d["name"] = p.name;
    d["doc"] = p.doc;
    d["spec"] = p.spec;
    d["keys"] = p.keys;
    d["parts"] = p.parts;
    out.append(d);
  }
  return out;
}

pyb::list key_docs() {
  pyb::list out;
  for (const PolicyKeyDoc& k : policy_key_docs()) {
    pyb::dict d;
    d["name"] = k.name;
    d["old_name"] = k.old_name;
    d["values"] = k.values;
    d["doc"] = k.doc;
    out.append(d);
  }
  return out;
}

std::string canonical_spec(const std::string& spec) {
  auto p = parse_kv_policy(spec);
  if (!p.ok()) raise_status(p.status().with_context("--kv"));
  return (*p)->spec();
}

void bind_options(pyb::module_& mod) {
  pyb::class_<GenOptions>(mod, "_GenOptions")
      .def(pyb::init<>())
      .def_readwrite("max_tokens", &GenOptions::max_tokens)
      .def_readwrite("temperature", &GenOptions::temperature)
      .def_readwrite("top_k", &GenOptions::top_k)
      .def_readwrite("top_p", &GenOptions::top_p)
      .def_readwrite("min_p", &GenOptions::min_p)
      .def_readwrite("repeat_penalty", &GenOptions::repeat_penalty)
      .def_readwrite("repeat_last_n", &GenOptions::repeat_last_n)
      .def_readwrite("seed", &GenOptions::seed)
      .def_readwrite("stop", &GenOptions::stop)
      .def_readwrite("ignore_eos", &GenOptions::ignore_eos)
      .def_readwrite("chunk", &GenOptions::chunk);
}

void bind_model(pyb::module_& mod) {
  pyb::class_<PyModel, std::shared_ptr<PyModel>>(mod, "_Model")
      .def(pyb::init([](const std::string& path, int threads, int ctx, int ubatch) {
             Result<std::unique_ptr<PyModel>> r = internal_error("not loaded");
             {
               pyb::gil_scoped_release nogil;
               r = PyModel::load({path, threads, ctx, ubatch});
             }
             return std::shared_ptr<PyModel>(value_or_raise(std::move(r)));
           }),
           pyb::arg("path"), pyb::arg("threads"), pyb::arg("ctx"), pyb::arg("ubatch"))
      .def_property_readonly("n_vocab", &PyModel::n_vocab)
      .def_property_readonly("n_ctx", &PyModel::n_ctx)
      .def_property_readonly("path", &PyModel::path)
      .def_property_readonly("eog_tokens",
                             [](const PyModel& m) { return m.tokenizer().eog_tokens(); })
      .def("tokenize", &tokenize, pyb::arg("text"), pyb::arg("add_special"),
           pyb::arg("parse_special"))
      .def("detokenize", &detokenize, pyb::arg("ids"), pyb::arg("render_special"))
      .def("chat_text",
           [](const PyModel& m, const std::vector<std::pair<std::string, std::string>>& msgs) {
             return value_or_raise(m.chat_text(to_messages(msgs)));
           })
      .def("chat_stops", &PyModel::chat_stops)
      .def("generate", &one_shot_generate, pyb::arg("ids"), pyb::arg("kv"), pyb::arg("kv_type"),
           pyb::arg("kv_mem_per_seq"), pyb::arg("options"), pyb::arg("on_text"))
      .def("logits", &one_shot_logits, pyb::arg("ids"), pyb::arg("kv"), pyb::arg("kv_type"),
           pyb::arg("kv_mem_per_seq"), pyb::arg("context_end"), pyb::arg("chunk"))
      .def("nll", &one_shot_nll, pyb::arg("ids"), pyb::arg("kv"), pyb::arg("kv_type"),
           pyb::arg("kv_mem_per_seq"), pyb::arg("context_end"), pyb::arg("chunk"));
}

}  // namespace

}  // namespace d2o::py

PYBIND11_MODULE(_d2o, mod) {
  namespace py = d2o::py;
  mod.doc() = "The d2o engine's bindings; use the package d2o, which wraps them.";
  mod.attr("__version__") = D2O_VERSION;
  py::bind_options(mod);
  py::bind_model(mod);
  py::bind_session(mod);
  mod.def("_presets", &py::policy_docs);
  mod.def("_keys", &py::key_docs);
  mod.def("_canonical_spec", &py::canonical_spec, pybind11::arg("spec"));
}
