// GGUF reader: memory-maps a GGUF v2/v3 file and validates all of it before anything is used.
//
// Every count, length, offset and size read from the file is checked against the file's size and
// against sane limits, so a truncated, corrupted or hostile file yields a Status that says what is
// wrong (and where) rather than a crash. After open() succeeds, metadata lookups and tensor data
// pointers are safe: each tensor's bytes lie inside the file's data section and no two overlap.
//
// The mapping is read-only and private. Model loading copies tensor data into process memory
// (see src/model/), because pages of a mapped file can be reclaimed and re-read from disk under
// memory pressure, which would make decoding speed depend on the page cache.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "d2o/status.h"
#include "ops/ggml_type.h"

namespace d2o {

// Value types of GGUF metadata (numbering of the file format).
enum class GgufType : uint32_t {
  kUint8 = 0,
  kInt8 = 1,
  kUint16 = 2,
  kInt16 = 3,
  kUint32 = 4,
  kInt32 = 5,
  kFloat32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kUint64 = 10,
  kInt64 = 11,
  kFloat64 = 12,
};
const char* gguf_type_name(GgufType type);

// One metadata value. Scalars are widened (integers to int64/uint64, floats to double); arrays
// of strings are copied; arrays of numbers point into the mapping (little-endian, unaligned).
struct GgufValue {
  GgufType type = GgufType::kUint8;
  GgufType array_type = GgufType::kUint8;  // element type when type == kArray
  int64_t i = 0;          // signed integers and bool
  uint64_t u = 0;         // unsigned integers (also mirrored in i when it fits)
  double f = 0.0;         // floats
  std::string str;        // kString
  std::vector<std::string> strings;  // kArray of kString
  const uint8_t* array_data = nullptr;  // kArray of a numeric type
  uint64_t array_size = 0;              // element count of any array

  bool is_integer() const;
  bool is_float() const { return type == GgufType::kFloat32 || type == GgufType::kFloat64; }
};

struct GgufTensorInfo {
  std::string name;
  GgmlType type = GgmlType::kF32;
  std::vector<int64_t> dims;  // ne[0] is the innermost (contiguous) dimension, as in GGUF
  uint64_t offset = 0;        // relative to the data section
  uint64_t n_bytes = 0;
  int64_t n_elements() const;
  std::string shape_string() const;  // "[576, 49152]"
};

class GgufFile {
 public:
  // Opens and validates `path`. Errors: kIoError (cannot open/map), kFormatError (malformed),
  // kUnsupported (version or tensor type this build does not handle).
  static Result<std::unique_ptr<GgufFile>> open(const std::string& path);
  // Same validation over a caller-owned buffer (used by tests and fuzzing). The buffer must
  // outlive the returned object.
  static Result<std::unique_ptr<GgufFile>> from_memory(const uint8_t* data, size_t size,
                                                       std::string name);
  ~GgufFile();
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  size_t file_size() const { return size_; }
  uint64_t alignment() const { return alignment_; }
  uint64_t data_offset() const { return data_offset_; }

  // Metadata in file order.
  const std::vector<std::pair<std::string, GgufValue>>& metadata() const { return kv_; }
  const GgufValue* find(std::string_view key) const;

  // Typed getters: NotFound when absent, FormatError when the value has another type.
  Result<std::string> get_string(std::string_view key) const;
  Result<int64_t> get_int(std::string_view key) const;      // any integer type
  Result<double> get_float(std::string_view key) const;     // float or integer
  Result<bool> get_bool(std::string_view key) const;
  Result<std::vector<std::string>> get_string_array(std::string_view key) const;
  Result<std::vector<int64_t>> get_int_array(std::string_view key) const;
  Result<std::vector<float>> get_float_array(std::string_view key) const;
  // With a default when the key is absent (still an error when present with a wrong type).
  Result<int64_t> get_int_or(std::string_view key, int64_t fallback) const;
  Result<double> get_float_or(std::string_view key, double fallback) const;
  Result<bool> get_bool_or(std::string_view key, bool fallback) const;

  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  const GgufTensorInfo* find_tensor(std::string_view name) const;
  // Pointer to a tensor's bytes inside the mapping (valid while this object lives). Reading it
  // raises SIGBUS if the file is truncated meanwhile: loaders use read_tensor instead.
  const uint8_t* tensor_data(const GgufTensorInfo& t) const { return base_ + data_offset_ + t.offset; }
  // Copies a tensor's t.n_bytes bytes into dst. A file is read with pread, not through the
  // mapping, so a file truncated or rewritten by another process while a model loads gives an
  // error (kIoError) instead of a crash; a memory buffer is copied.
  Status read_tensor(const GgufTensorInfo& t, uint8_t* dst) const;
  // The same for bytes [offset, offset + n) of the tensor's data (a slice of its rows); errors
  // when the range is not inside the tensor.
  Status read_tensor_bytes(const GgufTensorInfo& t, uint64_t offset, uint64_t n,
                           uint8_t* dst) const;

 private:
  GgufFile() = default;
  Status parse();

  std::string path_;
  const uint8_t* base_ = nullptr;
  size_t size_ = 0;
  bool owns_mapping_ = false;
  int fd_ = -1;  // open while a file-backed object lives (read_tensor)
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  std::vector<std::pair<std::string, GgufValue>> kv_;
  std::map<std::string, size_t, std::less<>> kv_index_;
  std::vector<GgufTensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> tensor_index_;
};

// Limits applied while parsing (exposed for tests).
struct GgufLimits {
  static constexpr uint64_t kMaxTensors = 1u << 20;
  static constexpr uint64_t kMaxKv = 1u << 20;
  static constexpr uint64_t kMaxStringBytes = 1u << 26;  // 64 MiB: templates can be large
  static constexpr uint64_t kMaxArrayElements = 1u << 28;
  static constexpr uint32_t kMaxDims = 4;
  static constexpr int64_t kMaxDim = int64_t{1} << 40;
};

}  // namespace d2o
