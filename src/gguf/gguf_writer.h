// GgufWriter: builds GGUF v3 files, for test fixtures and random-weight models.
//
// Deliberately permissive: it writes what it is told (any dims, types and, when asked, explicit
// data offsets), so tests can also produce malformed files for the reader to reject.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "d2o/status.h"
#include "gguf/gguf.h"

namespace d2o {

class GgufWriter {
 public:
  GgufWriter() = default;

  void set_version(uint32_t version) { version_ = version; }
  void set_alignment(uint32_t alignment);  // also written as general.alignment

  void add_string(const std::string& key, const std::string& value);
  void add_u32(const std::string& key, uint32_t value);
  void add_i32(const std::string& key, int32_t value);
  void add_u64(const std::string& key, uint64_t value);
  void add_f32(const std::string& key, float value);
  void add_bool(const std::string& key, bool value);
  void add_string_array(const std::string& key, const std::vector<std::string>& values);
  void add_i32_array(const std::string& key, const std::vector<int32_t>& values);
  void add_f32_array(const std::string& key, const std::vector<float>& values);
  void add_bool_array(const std::string& key, const std::vector<bool>& values);

  // Adds a tensor. `data` holds its bytes (for a well-formed file: exactly the size the type
  // and dims imply). `offset`, when given, is written instead of the next aligned offset.
  void add_tensor(const std::string& name, GgmlType type, const std::vector<int64_t>& dims,
                  std::vector<uint8_t> data, std::optional<uint64_t> offset = std::nullopt);
  // Same, raw type number (to write types the reader does not know).
  void add_tensor_raw(const std::string& name, uint32_t type, const std::vector<int64_t>& dims,
                      std::vector<uint8_t> data, std::optional<uint64_t> offset = std::nullopt);

  std::vector<uint8_t> to_bytes() const;
  Status write(const std::string& path) const;

 private:
  struct Tensor {
    std::string name;
    uint32_t type;
    std::vector<int64_t> dims;
    std::vector<uint8_t> data;
    std::optional<uint64_t> offset;
  };
  void put_key(const std::string& key, GgufType type);

  uint32_t version_ = 3;
  uint32_t alignment_ = 32;
  uint64_t n_kv_ = 0;
  std::vector<uint8_t> kv_bytes_;
  std::vector<Tensor> tensors_;
};

}  // namespace d2o
