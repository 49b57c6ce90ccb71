#include "runtime/generator.h"

#include <algorithm>

#include "core/timer.h"

namespace d2o {

size_t stop_string_holdback(std::string_view text, const std::vector<std::string>& stops) {
  size_t hold = 0;
  for (const std::string& s : stops) {
    for (size_t len = std::min(s.size() - 1, text.size()); len > hold; --len) {
      if (text.substr(text.size() - len) == std::string_view(s).substr(0, len)) {
        hold = len;
        break;
      }
    }
  }
  return hold;
}

std::vector<int> prefill_chunks(int64_t n, int chunk, int min_last) {
  if (chunk <= 0 || n <= chunk) return {static_cast<int>(n)};
  chunk = std::max(16, chunk - chunk % 16);
  std::vector<int> out;
  for (int64_t at = 0; at < n; at += chunk)
    out.push_back(static_cast<int>(std::min<int64_t>(chunk, n - at)));
  if (out.size() > 1 && out.back() < min_last) {
    out[out.size() - 2] += out.back();
    out.pop_back();
  }
  return out;
}

Result<GenerateResult> generate(Engine& engine, const Tokenizer& tok, Sequence& seq,
                                std::span<const TokenId> prompt, const GenerateParams& params,
                                const std::function<void(std::string_view)>& on_text) {
  if (params.n_predict < 1)
    return invalid_argument("the number of tokens to generate must be at least 1");
  if (prompt.empty()) return invalid_argument("the prompt is empty (no tokens to start from)");
  D2O_RETURN_IF_ERROR(params.sampling.validate());
  for (const std::string& s : params.stop) {
    if (s.empty()) return invalid_argument("stop strings must not be empty");
  }
  if (params.max_positions > 0 &&
      seq.n_past() + static_cast<int64_t>(prompt.size()) > params.max_positions) {
    return invalid_argument(
        "the prompt (" + std::to_string(prompt.size()) +
        " tokens) does not fit in the context of " + std::to_string(params.max_positions) +
        " tokens" +
        (seq.n_past() > 0 ? " (with " + std::to_string(seq.n_past()) + " tokens already in it)"
                          : "") +
        "; use a larger -c or a shorter prompt");
  }

  GenerateResult res;
  res.n_prompt = static_cast<int>(prompt.size());
  const int n_vocab = engine.model().hparams().n_vocab;
  std::vector<float> logits(static_cast<size_t>(n_vocab));
  std::vector<TokenId> history(prompt.begin(), prompt.end());
  history.reserve(history.size() + static_cast<size_t>(params.n_predict));
  Sampler sampler(params.sampling, n_vocab);
  const LogitsSink sink = [&](int, int, const float* l) {
    std::copy(l, l + n_vocab, logits.begin());
  };

  Stopwatch sw;
  BatchEntry be;
  be.seq = &seq;
  // The prompt's passes (GenerateParams::prefill_chunk): logits only from the last.
  const int window = seq.policy().is_full() ? 0 : seq.policy().needs().window;
  const std::vector<int> chunks =
      prefill_chunks(static_cast<int64_t>(prompt.size()), params.prefill_chunk, window);
  size_t at = 0;
  for (const int c : chunks) {
    be.tokens = prompt.subspan(at, static_cast<size_t>(c));
    at += static_cast<size_t>(c);
    be.prompt_rest = static_cast<int64_t>(prompt.size() - at);
    be.logits_from = be.prompt_rest > 0 ? BatchEntry::kNoLogits : -1;
    D2O_RETURN_IF_ERROR(engine.forward({&be, 1}, sink));
  }
  be.prompt_rest = 0;
  be.logits_from = -1;
  res.prompt_seconds = sw.seconds();

  StreamDecoder dec(tok);
  std::string pending;  // decoded text not yet handed to on_text
  sw.reset();
  for (int i = 0; i < params.n_predict; ++i) {
    const TokenId next = sampler.sample(logits.data(), history);
    if (params.stop_at_eog && tok.is_eog(next)) {
      res.stop_reason = "eog";
      break;
    }
    res.tokens.push_back(next);
    history.push_back(next);
    pending += dec.push(next);
    // Stop strings.
    bool stopped = false;
    for (const std::string& s : params.stop) {
      const size_t at = pending.find(s);
      if (at != std::string::npos) {
        pending.resize(at);
        stopped = true;
      }
    }
    const size_t hold = stopped ? 0 : stop_string_holdback(pending, params.stop);
    if (pending.size() > hold) {
      const std::string_view out(pending.data(), pending.size() - hold);
      res.text += out;
      if (on_text) on_text(out);
      pending.erase(0, pending.size() - hold);
    }
    if (stopped) {
      res.stop_reason = "stop";
      break;
    }
    if (i + 1 == params.n_predict) {
      res.stop_reason = "length";
      break;
    }
    if (params.max_positions > 0 && seq.n_past() + 1 > params.max_positions) {
      res.stop_reason = "context";
      break;
    }
    TokenId one[1] = {next};
    be.tokens = std::span<const TokenId>(one, 1);
    D2O_RETURN_IF_ERROR(engine.forward({&be, 1}, sink));
    ++res.n_decoded;
  }
  res.decode_seconds = sw.seconds();
  if (res.stop_reason != "stop") {
    pending += dec.flush();
    res.text += pending;
    if (on_text && !pending.empty()) on_text(pending);
  }
  return res;
}

}  // namespace d2o
