// d2o: entry point; dispatches to the subcommands declared in commands.h.
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
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

namespace {

std::string cache_dir() {
  if (const char* c = std::getenv("D2O_CACHE_DIR"); c && *c) return c;
  return D2O_DEFAULT_CACHE_DIR;
}

}  // namespace

const std::vector<KnownModel>& known_models() {
  static const std::vector<KnownModel> models = {
      {"smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "scripts/setup.sh"},
      {"gemma3", "gemma-3-270m-q4_k_m.gguf", "scripts/setup.sh --gemma3"},
  };
  return models;
}

std::string default_model_path() {
  if (const char* m = std::getenv("D2O_MODEL"); m && *m) return m;
  return cache_dir() + "/models/" + known_models().front().file;
}

Result<std::string> resolve_model_path(const std::string& spec) {
  const std::string s = spec.empty() ? default_model_path() : spec;
  std::error_code ec;
  if (std::filesystem::exists(s, ec)) return s;  // a file (or anything else) by that path
  std::string names;
  for (const KnownModel& m : known_models()) {
    const std::string path = cache_dir() + "/models/" + m.file;
    if (s == m.name) {
      if (!std::filesystem::exists(path, ec)) {
        return not_found("model '" + s + "' is not in the cache (" + path + "): run " + m.setup +
                         " to fetch it");
      }
      return path;
    }
    names += std::string(names.empty() ? "" : ", ") + m.name + " (" + path + ")";
  }
  // A path (it names a folder or a .gguf file): GgufFile::open reports it.
  if (s.find('/') != std::string::npos ||
      (s.size() > 5 && s.compare(s.size() - 5, 5, ".gguf") == 0)) {
    return s;
  }
  return not_found("'" + s + "' is neither a file nor a model name; model names: " + names);
}

std::string default_text_path() {
  return cache_dir() + "/texts/kjv.txt";
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
  add(d2o::cli::add_policies_command(app));
  add(d2o::cli::add_run_command(app));
  add(d2o::cli::add_chat_command(app));
  add(d2o::cli::add_perplexity_command(app));
  add(d2o::cli::add_eval_command(app));
  add(d2o::cli::add_bench_command(app));
#ifdef D2O_HAVE_SERVER
  add(d2o::cli::add_serve_command(app));
#endif
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
