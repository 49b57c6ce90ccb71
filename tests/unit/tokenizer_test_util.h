// Helpers shared by the tokenizer tests: locating reference data, reading files, printing ids.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "runtime/tokenizer.h"

namespace d2o::test {

inline std::string read_file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Folders that may hold the llama.cpp vocab test files, in order: $D2O_VOCAB_DIR, else
// shared/data/vocab next to the repository (the layout of CI and of the main checkout), else
// cache/vocab (where scripts/setup.sh --test-data puts them).
inline std::vector<std::string> vocab_dir_candidates() {
  std::vector<std::string> candidates;
  if (const char* e = std::getenv("D2O_VOCAB_DIR"); e && *e) candidates.emplace_back(e);
  candidates.push_back(std::string(D2O_TEST_DATA_DIR) + "/../../../shared/data/vocab");
  candidates.push_back(std::string(D2O_TEST_DATA_DIR) + "/../../cache/vocab");
#ifdef D2O_SHARED_DIR
  candidates.push_back(std::string(D2O_SHARED_DIR) + "/data/vocab");
#endif
  return candidates;
}

// The first candidate folder that holds the vocab test files. Empty when not found.
inline std::string vocab_dir() {
  for (const std::string& c : vocab_dir_candidates()) {
    if (std::filesystem::exists(c + "/ggml-vocab-gpt-2.gguf")) return c;
  }
  return "";
}

// ggml-vocab-NAME.gguf (with its .inp / .out) from the first candidate folder that holds it: a
// shared folder may hold fewer vocabularies than the cache that scripts/setup.sh --test-data
// fills. Empty when no folder has it.
inline std::string vocab_file(const std::string& name) {
  for (const std::string& c : vocab_dir_candidates()) {
    const std::string path = c + "/ggml-vocab-" + name + ".gguf";
    if (std::filesystem::exists(path)) return path;
  }
  return "";
}

// The SmolLM2 model: $D2O_MODEL, else the file the setup step caches. Empty when not found.
inline std::string smollm_path() {
  std::vector<std::string> candidates;
  if (const char* e = std::getenv("D2O_MODEL"); e && *e) candidates.emplace_back(e);
  candidates.push_back(std::string(D2O_TEST_DATA_DIR) +
                       "/../../cache/models/SmolLM2-135M-Instruct.Q4_1.gguf");
  for (const std::string& c : candidates) {
    if (std::filesystem::exists(c)) return c;
  }
  return "";
}

// Gemma 3 270M (scripts/setup.sh --gemma3): $D2O_GEMMA_MODEL, else
// $D2O_CACHE_DIR/models/gemma-3-270m-q4_k_m.gguf, else the same in <source>/cache.
inline std::string gemma_path() {
  std::vector<std::string> candidates;
  if (const char* e = std::getenv("D2O_GEMMA_MODEL"); e && *e) candidates.emplace_back(e);
  if (const char* e = std::getenv("D2O_CACHE_DIR"); e && *e) {
    candidates.push_back(std::string(e) + "/models/gemma-3-270m-q4_k_m.gguf");
  }
  candidates.push_back(std::string(D2O_TEST_DATA_DIR) +
                       "/../../cache/models/gemma-3-270m-q4_k_m.gguf");
  for (const std::string& c : candidates) {
    if (std::filesystem::exists(c)) return c;
  }
  return "";
}

inline std::string ids_to_string(const std::vector<TokenId>& ids) {
  std::string s;
  for (TokenId id : ids) s += (s.empty() ? "" : " ") + std::to_string(id);
  return s;
}

inline std::vector<TokenId> parse_ids(const std::string& line) {
  std::vector<TokenId> ids;
  std::istringstream in(line);
  long v;
  while (in >> v) ids.push_back(static_cast<TokenId>(v));
  return ids;
}

// A string shown with C escapes, for failure messages.
inline std::string escaped(const std::string& s, size_t max_len = 200) {
  std::string out;
  for (size_t i = 0; i < s.size() && i < max_len; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c < 0x20 || c == 0x7F) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out += buf;
    } else {
      out.push_back(static_cast<char>(c));
    }
  }
  if (s.size() > max_len) out += "...";
  return out;
}

}  // namespace d2o::test
