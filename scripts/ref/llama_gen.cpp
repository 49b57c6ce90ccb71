// llama_gen: greedy generation from a prompt file with llama.cpp's library (libllama), with the
// context settings of its `llama-cli` / `llama-completion` tools, for memory and speed
// comparisons with `d2o run` on the same prompt (docs/results.md, "Bounded prefill"). Built like
// llama_ppl against the llama.cpp build that scripts/setup.sh makes:
//
//   c++ -O2 -std=c++17 -I$L/source/include -I$L/source/ggml/include scripts/ref/llama_gen.cpp \
//     -L$L/build/bin -lllama -lggml -lggml-base -Wl,-rpath,$L/build/bin -o build/llama_gen
//   llama_gen MODEL PROMPT_FILE N_CTX N_THREADS N_PREDICT
//
// The prompt is tokenized with the model's special tokens (BOS) added, decoded in batches of
// 2048 tokens (micro-batches of 512), then N_PREDICT tokens are chosen greedily, one pass each.
// Context as the tools set it: F16 K/V cache, flash attention chosen automatically, the
// sliding-window layers' cache sized to their window (swa_full off). Prints the text, then the
// prompt and generation speeds on stderr.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "llama.h"

namespace {

int fail(const std::string& msg) {
  std::fprintf(stderr, "llama_gen: %s\n", msg.c_str());
  return 1;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) return fail("usage: llama_gen MODEL PROMPT_FILE N_CTX N_THREADS N_PREDICT");
  const int n_ctx = std::atoi(argv[3]);
  const int n_threads = std::atoi(argv[4]);
  const int n_predict = std::atoi(argv[5]);
  if (n_ctx < 8 || n_threads < 1 || n_predict < 1)
    return fail("N_CTX must be >= 8, N_THREADS and N_PREDICT >= 1");
  std::ifstream in(argv[2], std::ios::binary);
  if (!in) return fail(std::string("cannot read ") + argv[2]);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();

  llama_backend_init();
  llama_log_set([](ggml_log_level, const char*, void*) {}, nullptr);
  llama_model_params mp = llama_model_default_params();
  llama_model* model = llama_model_load_from_file(argv[1], mp);
  if (!model) return fail(std::string("cannot load ") + argv[1]);
  const llama_vocab* vocab = llama_model_get_vocab(model);
  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = static_cast<uint32_t>(n_ctx);
  cp.n_batch = 2048;
  cp.n_ubatch = 512;
  cp.n_seq_max = 1;
  cp.n_threads = cp.n_threads_batch = n_threads;
  cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_AUTO;
  cp.type_k = cp.type_v = GGML_TYPE_F16;
  cp.swa_full = false;
  llama_context* ctx = llama_init_from_model(model, cp);
  if (!ctx) return fail("cannot create a llama.cpp context");

  std::vector<llama_token> tokens(text.size() + 16);
  const int n_tok = llama_tokenize(vocab, text.data(), static_cast<int32_t>(text.size()),
                                   tokens.data(), static_cast<int32_t>(tokens.size()), true, false);
  if (n_tok < 0) return fail("tokenization failed");
  tokens.resize(static_cast<size_t>(n_tok));
  if (n_tok + n_predict > n_ctx) return fail("the prompt and the generation exceed N_CTX");

  const auto t0 = std::chrono::steady_clock::now();
  for (int at = 0; at < n_tok; at += static_cast<int>(cp.n_batch)) {
    const int n = std::min(static_cast<int>(cp.n_batch), n_tok - at);
    if (llama_decode(ctx, llama_batch_get_one(tokens.data() + at, n)) != 0)
      return fail("llama_decode failed on the prompt");
  }
  const double t_prompt = seconds_since(t0);

  llama_sampler* greedy = llama_sampler_init_greedy();
  std::string out;
  int n_gen = 0;
  const auto t1 = std::chrono::steady_clock::now();
  for (; n_gen < n_predict; ++n_gen) {
    llama_token next = llama_sampler_sample(greedy, ctx, -1);
    if (llama_vocab_is_eog(vocab, next)) break;
    char piece[256];
    const int len = llama_token_to_piece(vocab, next, piece, sizeof piece, 0, false);
    if (len > 0) out.append(piece, static_cast<size_t>(len));
    if (n_gen + 1 == n_predict) {
      ++n_gen;
      break;
    }
    if (llama_decode(ctx, llama_batch_get_one(&next, 1)) != 0)
      return fail("llama_decode failed while generating");
  }
  const double t_gen = seconds_since(t1);
  std::printf("%s\n", out.c_str());
  std::fprintf(stderr, "prompt: %d tokens in %.2f s (%.1f tok/s); generation: %d tokens in %.2f s\n",
               n_tok, t_prompt, n_tok / t_prompt, n_gen, t_gen);
  llama_sampler_free(greedy);
  llama_free(ctx);
  llama_model_free(model);
  llama_backend_free();
  return 0;
}
