// The d2o command-line tool: one binary, one file per subcommand.
//
// Each subcommand file defines an add_*_command() that registers its options on a CLI11
// subcommand and returns the action to run when that subcommand is chosen. Actions return the
// process exit code: 0 on success, 1 for a failure (bad model file, bad input), 2 for usage errors.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <string>

#include "d2o/status.h"

namespace d2o::cli {

using Action = std::function<int()>;

Action add_inspect_command(CLI::App& app);
Action add_run_command(CLI::App& app);
Action add_chat_command(CLI::App& app);
Action add_perplexity_command(CLI::App& app);
Action add_eval_command(CLI::App& app);
Action add_bench_command(CLI::App& app);
// `throughput`, a subcommand of `bench` (registered by add_bench_command).
Action add_bench_throughput_command(CLI::App& bench);

// Prints "d2o: error: <status>" to stderr and returns 1.
int fail(const Status& status);

// The model used when -m is not given: $D2O_MODEL, else the file the setup step fetched
// ($D2O_CACHE_DIR/models/..., default <source>/cache/models/...).
std::string default_model_path();

// The text used when -f is not given: $D2O_CACHE_DIR/texts/kjv.txt (default <source>/cache/...).
std::string default_text_path();

}  // namespace d2o::cli
