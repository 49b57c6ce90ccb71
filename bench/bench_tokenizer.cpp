// Tokenizer throughput: encode and decode speed on text files, optionally next to llama.cpp.
//
//   bench_tokenizer MODEL.gguf FILE... [--repeat N]
// Encodes each file whole (best of N runs), then decodes the ids. With LLAMA_TOKENIZE set to a
// llama-tokenize binary, also times it on the same files; its time is measured as the run on the
// file minus a run on a one-byte file (model loading), best of N.
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "core/timer.h"
#include "gguf/gguf.h"
#include "runtime/tokenizer.h"

namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Wall time of a shell command, in seconds (-1 when it fails).
double time_command(const std::string& cmd) {
  d2o::Stopwatch sw;
  const int rc = std::system((cmd + " >/dev/null 2>&1").c_str());
  return rc == 0 ? sw.seconds() : -1.0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s MODEL.gguf FILE... [--repeat N]\n", argv[0]);
    return 2;
  }
  int repeat = 5;
  std::vector<std::string> files;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--repeat" && i + 1 < argc) {
      repeat = std::max(1, std::atoi(argv[++i]));
    } else {
      files.push_back(a);
    }
  }
  d2o::Stopwatch load_sw;
  auto file = d2o::GgufFile::open(argv[1]);
  if (!file.ok()) {
    std::fprintf(stderr, "error: %s\n", file.status().to_string().c_str());
    return 1;
  }
  auto tok = d2o::Tokenizer::from_gguf(**file);
  if (!tok.ok()) {
    std::fprintf(stderr, "error: %s\n", tok.status().to_string().c_str());
    return 1;
  }
  const double load_s = load_sw.seconds();
  std::printf("tokenizer load: %.3f s (%d tokens, %s / %s)\n", load_s, (*tok)->n_vocab(),
              (*tok)->model().c_str(), (*tok)->pre_tokenizer().c_str());

  const char* llama = std::getenv("LLAMA_TOKENIZE");
  std::string empty_file = "/tmp/d2o_bench_tokenizer_empty.txt";
  if (llama) std::ofstream(empty_file) << "x";
  for (const std::string& path : files) {
    const std::string text = read_file(path);
    std::vector<d2o::TokenId> ids;
    double enc = 1e30, dec = 1e30;
    for (int r = 0; r < repeat; ++r) {
      d2o::Stopwatch sw;
      auto res = (*tok)->encode(text, d2o::EncodeOptions{});
      enc = std::min(enc, sw.seconds());
      if (!res.ok()) {
        std::fprintf(stderr, "error: %s\n", res.status().to_string().c_str());
        return 1;
      }
      ids = std::move(res).value();
      d2o::Stopwatch sw2;
      auto out = (*tok)->decode(ids, false);
      dec = std::min(dec, sw2.seconds());
    }
    const double mb = static_cast<double>(text.size()) / 1e6;
    std::printf(
        "%s: %.3f MB, %zu tokens; encode %.1f ms = %.0f tokens/s (%.2f MB/s); decode "
        "%.1f ms\n",
        path.c_str(), mb, ids.size(), enc * 1e3, ids.size() / enc, mb / enc, dec * 1e3);
    double llama_s = -1;
    if (llama) {
      const std::string base = std::string(llama) + " -m " + argv[1] +
                               " --ids --no-escape --no-parse-special --log-disable -f ";
      double t_full = 1e30, t_empty = 1e30;
      for (int r = 0; r < repeat; ++r) {
        t_full = std::min(t_full, time_command(base + path));
        t_empty = std::min(t_empty, time_command(base + empty_file));
      }
      llama_s = t_full - t_empty;
      std::printf(
          "  llama-tokenize: %.1f ms run, %.1f ms load -> %.1f ms tokenizing = %.0f "
          "tokens/s (d2o / llama.cpp speed: %.2fx)\n",
          t_full * 1e3, t_empty * 1e3, llama_s * 1e3, ids.size() / llama_s, llama_s / enc);
    }
    std::printf(
        "{\"bench\":\"tokenizer\",\"file\":\"%s\",\"bytes\":%zu,\"tokens\":%zu,"
        "\"encode_s\":%.6f,\"decode_s\":%.6f,\"llama_tokenize_s\":%.6f}\n",
        path.c_str(), text.size(), ids.size(), enc, dec, llama_s);
  }
  return 0;
}
