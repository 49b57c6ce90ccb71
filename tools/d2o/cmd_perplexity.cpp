// d2o perplexity: perplexity of a text file with llama.cpp's chunked protocol (see
// src/eval/perplexity.h), so the figure compares directly with its perplexity tool.
#include <cstdio>
#include <fstream>
#include <sstream>

#include "commands.h"
#include "common.h"
#include "core/timer.h"
#include "eval/perplexity.h"

namespace d2o::cli {

namespace {

struct PplOptions {
  ModelOptions model;
  std::string file;
  int max_chunks = 0;
};

int run_perplexity(PplOptions& o) {
  if (o.file.empty()) return fail(invalid_argument("give the text with -f FILE"));
  std::ifstream in(o.file, std::ios::binary);
  if (!in) return fail(io_error("cannot read '" + o.file + "'"));
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  if (o.model.n_ctx == 0) o.model.n_ctx = 2048;
  auto loaded = load_all(o.model);
  if (!loaded.ok()) return fail(loaded.status());
  Loaded& l = *loaded;
  if (l.n_ctx > l.model->hparams().n_ctx_train) {
    return fail(invalid_argument("-c " + std::to_string(l.n_ctx) + " exceeds the model's trained context of " +
                                 std::to_string(l.model->hparams().n_ctx_train)));
  }
  Stopwatch sw;
  EncodeOptions enc;
  enc.add_special = true;
  auto ids = l.tokenizer->encode(text, enc);
  if (!ids.ok()) return fail(ids.status());
  std::fprintf(stderr, "tokenized %zu bytes into %zu tokens in %.2f s\n", text.size(), ids->size(), sw.seconds());
  PerplexityParams p;
  p.n_ctx = l.n_ctx;
  p.max_chunks = o.max_chunks;
  p.add_bos = l.tokenizer->add_bos();
  p.bos = l.tokenizer->bos();
  p.kv_type = l.kv_type;
  sw.reset();
  auto res = perplexity(*l.engine, *ids, p, [&](int c, double ppl) {
    std::printf("[%d]%.4f,", c + 1, ppl);
    std::fflush(stdout);
  });
  std::printf("\n");
  if (!res.ok()) return fail(res.status());
  const double secs = sw.seconds();
  std::printf("Final estimate: PPL = %.4f +/- %.5f (%d chunks of %d, %lld scored tokens, %.1f s, %.1f tok/s)\n",
              res->ppl(), res->ppl() * res->stderr_nll, res->n_chunks, p.n_ctx,
              static_cast<long long>(res->n_scored), secs, res->n_chunks * p.n_ctx / std::max(secs, 1e-9));
  return 0;
}

}  // namespace

Action add_perplexity_command(CLI::App& app) {
  auto o = std::make_shared<PplOptions>();
  CLI::App* sub = app.add_subcommand("perplexity", "Perplexity of a text file (llama.cpp's chunked protocol)");
  add_model_options(sub, o->model, /*with_kv=*/false);
  sub->add_option("-f,--file", o->file, "Text file")->required();
  sub->add_option("--chunks", o->max_chunks, "Score at most this many chunks (0 = all)");
  return [o] { return run_perplexity(*o); };
}

}  // namespace d2o::cli
