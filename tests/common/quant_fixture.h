// The D2OQ fixture files of scripts/gen_quant_fixtures.py (dequant_*.bin, quantize_*.bin): a
// 4-byte magic, a uint32 version (1), the GGML type and two counts, then the payload.
#pragma once

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>

#include "common/test_util.h"

namespace d2o::test {

// Folder of the fixtures: $D2O_QUANT_DIR, else the setup step's cache.
inline std::string quant_dir() { return test_data_dir("D2O_QUANT_DIR", "quant"); }

// Opens `path` and reads its header into type, count_a and count_b; leaves `in` at the payload.
inline bool open_quant_fixture(const std::string& path, std::ifstream* in, uint32_t* type,
                               uint32_t* count_a, uint32_t* count_b, std::string* error) {
  in->open(path, std::ios::binary);
  if (!*in) {
    *error = "cannot open " + path + " (run scripts/setup.sh --test-data)";
    return false;
  }
  char magic[4];
  uint32_t header[4];
  in->read(magic, 4);
  in->read(reinterpret_cast<char*>(header), sizeof(header));
  if (!*in || std::memcmp(magic, "D2OQ", 4) != 0 || header[0] != 1) {
    *error = path + ": bad header";
    return false;
  }
  *type = header[1];
  *count_a = header[2];
  *count_b = header[3];
  return true;
}

}  // namespace d2o::test
