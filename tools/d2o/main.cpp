// d2o: entry point; dispatches to the subcommands declared in commands.h.
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "commands.h"

#ifndef D2O_DEFAULT_CACHE_DIR
#define D2O_DEFAULT_CACHE_DIR "cache"
#endif

namespace d2o::cli {

int fail(const Status& status) {
  std::fprintf(stderr, "d2o: error: %s\n", status.to_string().c_str());
  return 1;
}

std::string default_model_path() {
  if (const char* m = std::getenv("D2O_MODEL"); m && *m) return m;
  std::string cache = D2O_DEFAULT_CACHE_DIR;
  if (const char* c = std::getenv("D2O_CACHE_DIR"); c && *c) cache = c;
  return cache + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
}

std::string default_text_path() {
  std::string cache = D2O_DEFAULT_CACHE_DIR;
  if (const char* c = std::getenv("D2O_CACHE_DIR"); c && *c) cache = c;
  return cache + "/texts/kjv.txt";
}

}  // namespace d2o::cli

int main(int argc, char** argv) {
  CLI::App app{"d2o: long-context LLM inference with a compressed KV cache"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "d2o 0.1.0");
  std::vector<d2o::cli::Action> actions;
  std::vector<CLI::App*> subs;
  auto add = [&](d2o::cli::Action a) {
    actions.push_back(std::move(a));
    subs.push_back(app.get_subcommands({}).back());
  };
  add(d2o::cli::add_inspect_command(app));
  add(d2o::cli::add_run_command(app));
  add(d2o::cli::add_chat_command(app));
  add(d2o::cli::add_perplexity_command(app));
  add(d2o::cli::add_eval_command(app));
  add(d2o::cli::add_bench_command(app));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  for (size_t k = 0; k < subs.size(); ++k) {
    if (subs[k]->parsed()) return actions[k]();
  }
  return 2;
}
