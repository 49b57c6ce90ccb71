// Helpers shared by the test suites: running the d2o binary, locating real models and texts.
#pragma once

#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <gtest/gtest.h>

namespace d2o::test {

struct CommandResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

// Runs a shell command line, capturing stdout+stderr.
inline CommandResult run_command(const std::string& cmd) {
  CommandResult r;
  std::FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  const int status = ::pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

#ifdef D2O_CLI_PATH
inline CommandResult run_d2o(const std::string& args) {
  return run_command(std::string(D2O_CLI_PATH) + " " + args);
}
#endif

// A directory of this test process's own under ::testing::TempDir(), made on first use and removed
// when the process ends. ctest runs every test case as its own process, several at once, so a
// fixed file name in the shared temporary directory would be written by one case while another
// has it mapped (SIGBUS) or is reading it.
inline const std::string& scratch_dir() {
  struct Dir {
    std::string path;
    Dir() {
      std::string tmpl = ::testing::TempDir();
      if (tmpl.empty() || tmpl.back() != '/') tmpl += '/';
      tmpl += "d2o_test_" + std::to_string(::getpid()) + "_XXXXXX";
      if (::mkdtemp(tmpl.data()) == nullptr) {
        std::fprintf(stderr, "cannot create a scratch directory from '%s'\n", tmpl.c_str());
        std::abort();
      }
      path = tmpl;
    }
    ~Dir() {
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    }
  };
  static const Dir dir;
  return dir.path;
}

// A path named `name` inside scratch_dir().
inline std::string scratch_path(const std::string& name) { return scratch_dir() + "/" + name; }

inline std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::string(v) : fallback;
}

inline bool file_exists(const std::string& path) {
  std::ifstream f(path);
  return f.good();
}

inline std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// The set-up cache ($D2O_CACHE_DIR, else <repo>/cache).
inline std::string cache_dir() {
#ifdef D2O_SOURCE_DIR
  return env_or("D2O_CACHE_DIR", D2O_SOURCE_DIR "/cache");
#else
  return env_or("D2O_CACHE_DIR", "");
#endif
}

// The real model fetched by scripts/setup.sh ($D2O_MODEL, else <cache>/models/...).
inline std::string default_model_path() {
  return env_or("D2O_MODEL", cache_dir() + "/models/SmolLM2-135M-Instruct.Q4_1.gguf");
}

// Gemma 3 270M, fetched by scripts/setup.sh --gemma3 ($D2O_GEMMA_MODEL, else <cache>/models/...).
inline std::string gemma3_model_path() {
  return env_or("D2O_GEMMA_MODEL", cache_dir() + "/models/gemma-3-270m-q4_k_m.gguf");
}

// A folder of references that `scripts/setup.sh --test-data` makes: $<env_name> if set, else
// <cache>/test-data/<sub>.
inline std::string test_data_dir(const char* env_name, const std::string& sub) {
  return env_or(env_name, cache_dir() + "/test-data/" + sub);
}

inline std::string text_dir() {
#ifdef D2O_SOURCE_DIR
  return env_or("D2O_TEXT_DIR", D2O_SOURCE_DIR "/cache/texts");
#else
  return env_or("D2O_TEXT_DIR", "");
#endif
}

// Whether `needle` occurs in `s`.
inline bool has(const std::string& s, const std::string& needle) {
  return s.find(needle) != std::string::npos;
}

// The number that follows `key` in `text` (e.g. "Final estimate: PPL =" in a tool's output, or
// "\"ppl\":" in a JSON file); NaN when `key` is absent.
inline double number_after(const std::string& text, const std::string& key) {
  const size_t at = text.find(key);
  if (at == std::string::npos) return std::nan("");
  return std::strtod(text.c_str() + at + key.size(), nullptr);
}

}  // namespace d2o::test

// Skips a real-model test when the model is absent (scripts/test.sh always fetches it first).
#define D2O_REQUIRE_MODEL(path_var)                                                      \
  const std::string path_var = ::d2o::test::default_model_path();                       \
  if (!::d2o::test::file_exists(path_var)) {                                             \
    GTEST_SKIP() << "real model not found at '" << path_var                            \
                 << "': run scripts/setup.sh (or set D2O_MODEL)";                        \
  }
