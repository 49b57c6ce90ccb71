// Shared by the binding files: Status to Python exceptions, token lists, and the generation call
// with its text callback (the GIL released while the engine runs).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <vector>

#include "py_model.h"

namespace d2o::py {

namespace pyb = pybind11;

// Raises the exception a failed Status stands for: ValueError for what a caller gave (arguments,
// specs, token ids, a malformed or unsupported model file), FileNotFoundError for a missing file,
// OSError for what the OS refused, MemoryError for a cap or context exceeded, RuntimeError else.
[[noreturn]] void raise_status(const Status& s);

template <typename T>
T value_or_raise(Result<T> r) {
  if (!r.ok()) raise_status(r.status());
  return std::move(r).value();
}

inline void ok_or_raise(const Status& s) {
  if (!s.ok()) raise_status(s);
}

// The options of one generation, a plain struct the Python side fills (types checked on
// assignment); `stop` strings come on top of the chat template's when the caller adds them.
struct GenOptions {
  int max_tokens = 128;
  float temperature = 0.0f;
  int top_k = 40;
  float top_p = 0.95f;
  float min_p = 0.05f;
  float repeat_penalty = 1.0f;
  int repeat_last_n = 64;
  uint64_t seed = 0;
  std::vector<std::string> stop;
  bool ignore_eos = false;
  int chunk = 512;  // prompt tokens per pass, as `d2o run --chunk`
};

GenerateParams generate_params(const GenOptions& o);

// Runs PyModel::generate with the GIL released; `on_text` (None or a callable taking the new
// text, returning False to stop) is called with the GIL held. A Python exception raised in it
// ends the generation and is raised again. Returns {text, tokens, stop_reason, n_prompt,
// prompt_seconds, decode_seconds}, the tokens also in *tokens when given. `bounded`: the
// sequence's growth is bounded first (PyModel::bound_growth; a sequence of kv_mem_per_seq).
pyb::dict run_generate(PyModel& m, Sequence& seq, const std::vector<TokenId>& ids,
                       const GenOptions& o, const pyb::object& on_text, bool bounded);

// The logits of every row as a float32 array [n, n_vocab] (PyModel::score, GIL released).
pyb::array_t<float> run_logits(PyModel& m, Sequence& seq, const std::vector<TokenId>& ids,
                               int64_t context_end, int chunk, bool bounded);

void bind_session(pyb::module_& mod);

}  // namespace d2o::py
