// Fuzz target: the GGUF reader (header, metadata, tensor table) over an in-memory file.
//
// After a successful open every accessor must be safe: all metadata is read through the typed
// getters, and every tensor's bytes are copied out with read_tensor (its size is bounded by the
// file's, so a file that declares absurd sizes is refused by open() before anything allocates).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "gguf/gguf.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto opened = d2o::GgufFile::from_memory(data, size, "fuzz.gguf");
  if (!opened.ok()) return 0;
  const d2o::GgufFile& f = **opened;
  for (const auto& [key, v] : f.metadata()) {
    if (f.find(key) == nullptr) std::abort();
    (void)f.get_string(key);
    (void)f.get_int(key);
    (void)f.get_float(key);
    (void)f.get_bool(key);
    (void)f.get_string_array(key);
    (void)f.get_int_array(key);
    (void)f.get_float_array(key);
  }
  std::vector<uint8_t> buf;
  for (const d2o::GgufTensorInfo& t : f.tensors()) {
    if (f.find_tensor(t.name) == nullptr) std::abort();
    if (t.n_bytes > size || f.data_offset() + t.offset + t.n_bytes > size) std::abort();
    (void)t.shape_string();
    buf.resize(t.n_bytes);
    if (!f.read_tensor(t, buf.data()).ok()) std::abort();  // memory-backed: cannot fail
  }
  return 0;
}
