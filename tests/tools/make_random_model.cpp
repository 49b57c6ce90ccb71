// Writes the random-weight fixture models (see tests/common/random_model.h):
//   d2o_make_random_model qwen2|llama-mha OUT.gguf
// Used by scripts/gen_reference_fixtures.py to compute reference logits on the same files.
#include <cstdio>
#include <string>

#include "common/random_model.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s qwen2|llama-mha OUT.gguf\n", argv[0]);
    return 2;
  }
  const std::string which = argv[1];
  d2o::test::RandomModelConfig c;
  if (which == "qwen2") c = d2o::test::random_qwen2_config();
  else if (which == "llama-mha") c = d2o::test::random_llama_mha_config();
  else {
    std::fprintf(stderr, "unknown model '%s' (qwen2 or llama-mha)\n", argv[1]);
    return 2;
  }
  d2o::Status s = d2o::test::make_random_model(c).write(argv[2]);
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.to_string().c_str());
    return 1;
  }
  return 0;
}
