// llama_ppl: llama.cpp's perplexity of a text file, computed by llama.cpp's library (libllama)
// with the protocol and defaults of its `llama-perplexity` tool, for the test references
// (scripts/gen_reference_fixtures.py, scripts/gen_gemma3_reference.py). Set-up compiles it against
// the llama.cpp build from the llama-cpp-python source archive, so that it need not build the
// tool itself (the tool's shared libraries take longer to build than libllama and ggml together).
//
//   llama_ppl MODEL TEXT_FILE N_CTX N_THREADS
//
// Protocol: the text is tokenized with the model's special tokens (BOS) added; chunks of N_CTX
// tokens, each evaluated from an empty cache in one batch of N_CTX (micro-batches of 512), its
// first token replaced by BOS when the vocabulary adds one; the negative log-likelihood of the
// chunk's second half (positions N_CTX/2 .. N_CTX-2 predicting the next token). Context defaults
// as the tool's: F16 K/V cache, flash attention chosen automatically. Prints the tool's lines:
//   calculating perplexity over N chunks
//   Final estimate: PPL = X +/- E
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "llama.h"

namespace {

int fail(const std::string& msg) {
  std::fprintf(stderr, "llama_ppl: %s\n", msg.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) return fail("usage: llama_ppl MODEL TEXT_FILE N_CTX N_THREADS");
  const int n_ctx = std::atoi(argv[3]);
  const int n_threads = std::atoi(argv[4]);
  if (n_ctx < 8 || n_threads < 1) return fail("N_CTX must be >= 8 and N_THREADS >= 1");
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
  cp.n_batch = static_cast<uint32_t>(n_ctx);
  cp.n_ubatch = 512;
  cp.n_seq_max = 1;
  cp.n_threads = cp.n_threads_batch = n_threads;
  cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_AUTO;
  cp.type_k = cp.type_v = GGML_TYPE_F16;
  llama_context* ctx = llama_init_from_model(model, cp);
  if (!ctx) return fail("cannot create a llama.cpp context");

  std::vector<llama_token> tokens(text.size() + 16);
  const int n_tok = llama_tokenize(vocab, text.data(), static_cast<int32_t>(text.size()),
                                   tokens.data(), static_cast<int32_t>(tokens.size()), true, false);
  if (n_tok < 0) return fail("tokenization failed");
  tokens.resize(static_cast<size_t>(n_tok));
  const int n_chunk = n_tok / n_ctx;
  if (n_chunk < 1) return fail("the text is shorter than one context");
  std::printf("calculating perplexity over %d chunks, n_ctx=%d\n", n_chunk, n_ctx);

  const int n_vocab = llama_vocab_n_tokens(vocab);
  const int first = n_ctx / 2;
  const bool add_bos = llama_vocab_get_add_bos(vocab);
  llama_batch batch = llama_batch_init(n_ctx, 0, 1);
  double nll = 0.0, nll2 = 0.0;
  long count = 0;
  for (int c = 0; c < n_chunk; ++c) {
    llama_memory_clear(llama_get_memory(ctx), true);
    batch.n_tokens = 0;
    for (int k = 0; k < n_ctx; ++k) {
      const int i = batch.n_tokens++;
      llama_token t = tokens[static_cast<size_t>(c) * n_ctx + k];
      if (k == 0 && add_bos) t = llama_vocab_bos(vocab);
      batch.token[i] = t;
      batch.pos[i] = k;
      batch.n_seq_id[i] = 1;
      batch.seq_id[i][0] = 0;
      batch.logits[i] = k >= first;
    }
    if (llama_decode(ctx, batch) != 0) return fail("llama_decode failed");
    for (int k = first; k < n_ctx - 1; ++k) {
      const float* lg = llama_get_logits_ith(ctx, k);
      if (!lg) return fail("no logits");
      // As the tool: float maximum, double sum of expf.
      float mx = lg[0];
      for (int v = 1; v < n_vocab; ++v) mx = lg[v] > mx ? lg[v] : mx;
      double sum = 0.0;
      for (int v = 0; v < n_vocab; ++v) sum += std::exp(lg[v] - mx);
      const llama_token next = tokens[static_cast<size_t>(c) * n_ctx + k + 1];
      const double v = -(lg[next] - mx - std::log(sum));
      nll += v;
      nll2 += v * v;
      ++count;
    }
    std::printf("[%d]%.4f,", c + 1, std::exp(nll / static_cast<double>(count)));
    std::fflush(stdout);
  }
  std::printf("\n");
  nll /= static_cast<double>(count);
  nll2 = nll2 / static_cast<double>(count) - nll * nll;
  const double ppl = std::exp(nll);
  const double err = nll2 > 0 ? std::sqrt(nll2 / static_cast<double>(count - 1)) * ppl : 0.0;
  std::printf("Final estimate: PPL = %.4f +/- %.5f\n", ppl, err);
  llama_batch_free(batch);
  llama_free(ctx);
  llama_model_free(model);
  llama_backend_free();
  return 0;
}
