#include "bind_common.h"

#include <cstring>
#include <mutex>

namespace d2o::py {

namespace {

// Thrown from the text callback to end a generation early (a consumer that stopped reading, or
// an exception in the callback, which is left set as Python's error indicator).
struct StopGeneration {};

}  // namespace

void raise_status(const Status& s) {
  const std::string& m = s.message();
  switch (s.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kFormatError:
    case StatusCode::kUnsupported:
      throw pyb::value_error(m);
    case StatusCode::kNotFound:
      PyErr_SetString(PyExc_FileNotFoundError, m.c_str());
      throw pyb::error_already_set();
    case StatusCode::kIoError:
      PyErr_SetString(PyExc_OSError, m.c_str());
      throw pyb::error_already_set();
    case StatusCode::kResourceExhausted:
      PyErr_SetString(PyExc_MemoryError, m.c_str());
      throw pyb::error_already_set();
    default:
      throw std::runtime_error(m);
  }
}

GenerateParams generate_params(const GenOptions& o) {
  GenerateParams gp;
  gp.n_predict = o.max_tokens;
  gp.sampling.temperature = o.temperature;
  gp.sampling.top_k = o.top_k;
  gp.sampling.top_p = o.top_p;
  gp.sampling.min_p = o.min_p;
  gp.sampling.repeat_penalty = o.repeat_penalty;
  gp.sampling.repeat_last_n = o.repeat_last_n;
  gp.sampling.seed = o.seed;
  gp.stop = o.stop;
  gp.stop_at_eog = !o.ignore_eos;
  gp.prefill_chunk = o.chunk;
  return gp;
}

pyb::dict run_generate(PyModel& m, Sequence& seq, const std::vector<TokenId>& ids,
                       const GenOptions& o, const pyb::object& on_text, bool bounded) {
  if (o.chunk < 0) throw pyb::value_error("chunk must be >= 0 (0: one pass)");
  std::function<void(std::string_view)> cb;
  if (!on_text.is_none()) {
    cb = [&on_text](std::string_view text) {
      pyb::gil_scoped_acquire gil;
      try {
        pyb::object r = on_text(pyb::str(text.data(), text.size()));
        if (!r.is_none() && !r.cast<bool>()) throw StopGeneration{};
      } catch (pyb::error_already_set& e) {
        e.restore();
        throw StopGeneration{};
      }
    };
  }
  Result<GenerateResult> res = GenerateResult{};
  bool stopped = false;
  {
    pyb::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(m.mutex());
    try {
      if (bounded) {
        if (Status s = m.bound_growth(seq, std::ssize(ids), o.max_tokens, o.chunk); !s.ok())
          res = s;
      }
      if (res.ok()) res = m.generate(seq, ids, generate_params(o), cb);
    } catch (const StopGeneration&) {
      stopped = true;
    }
  }
  if (PyErr_Occurred()) throw pyb::error_already_set();
  pyb::dict d;
  if (stopped) {
    d["stop_reason"] = "cancelled";
    return d;
  }
  const GenerateResult& r = value_or_raise(std::move(res));
  d["text"] = r.text;
  d["tokens"] = r.tokens;
  d["stop_reason"] = r.stop_reason;
  d["n_prompt"] = r.n_prompt;
  d["prompt_seconds"] = r.prompt_seconds;
  d["decode_seconds"] = r.decode_seconds;
  return d;
}

pyb::array_t<float> run_logits(PyModel& m, Sequence& seq, const std::vector<TokenId>& ids,
                               int64_t context_end, int chunk, bool bounded) {
  const size_t v = static_cast<size_t>(m.n_vocab());
  if (ids.empty()) throw pyb::value_error("no tokens to score");
  pyb::array_t<float> out({static_cast<pyb::ssize_t>(ids.size()), static_cast<pyb::ssize_t>(v)});
  float* data = out.mutable_data();
  Status s;
  {
    pyb::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(m.mutex());
    if (bounded) s = m.bound_growth(seq, std::ssize(ids), 0, chunk);
    if (s.ok())
      s = m.score(seq, ids, context_end, chunk, [&](size_t row, const float* l) {
        std::memcpy(data + row * v, l, v * sizeof(float));
      });
  }
  ok_or_raise(s);
  return out;
}

}  // namespace d2o::py
