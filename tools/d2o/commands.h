// The d2o command-line tool: one binary, one file per subcommand.
//
// Each subcommand file defines an add_*_command() that registers its options on a CLI11
// subcommand and returns the action to run when that subcommand is chosen. Actions return the
// process exit code: 0 on success, 1 for a failure (bad model file, bad input), 2 for usage errors.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <string>
#include <vector>

#include "d2o/status.h"

namespace d2o::cli {

using Action = std::function<int()>;

Action add_inspect_command(CLI::App& app);
Action add_policies_command(CLI::App& app);
Action add_run_command(CLI::App& app);
Action add_chat_command(CLI::App& app);
Action add_perplexity_command(CLI::App& app);
Action add_eval_command(CLI::App& app);
Action add_bench_command(CLI::App& app);
Action add_serve_command(CLI::App& app);  // built with D2O_BUILD_SERVER
// `throughput`, a subcommand of `bench` (registered by add_bench_command).
Action add_bench_throughput_command(CLI::App& bench);

// Prints "d2o: error: <status>" to stderr and returns 1.
int fail(const Status& status);

// Models the setup step fetches, by name: -m smollm2, -m gemma3 (also as $D2O_MODEL).
struct KnownModel {
  const char* name;   // "smollm2"
  const char* file;   // its file in $D2O_CACHE_DIR/models
  const char* setup;  // the command that fetches it
};
const std::vector<KnownModel>& known_models();

// The model used when -m is not given: $D2O_MODEL, else the default model the setup step fetched
// ($D2O_CACHE_DIR/models/..., default <source>/cache/models/...).
std::string default_model_path();

// A model given by -m (empty: the default) as a file path: an existing path as is, a model name
// as its file in the cache, anything else that looks like a path (has a '/' or ends in .gguf)
// as is, so that opening it reports the error. Errors: kNotFound for a named model that is not
// fetched (the message says how to fetch it) and for a word that is neither a file nor a model
// name (the message lists the names).
Result<std::string> resolve_model_path(const std::string& spec);

// The text used when -f is not given: $D2O_CACHE_DIR/texts/kjv.txt (default <source>/cache/...).
std::string default_text_path();

}  // namespace d2o::cli
