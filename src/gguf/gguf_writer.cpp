#include "gguf/gguf_writer.h"

#include <cstdio>
#include <cstring>

namespace d2o {

namespace {
template <class T>
void put(std::vector<uint8_t>& out, T v) {
  const size_t n = out.size();
  out.resize(n + sizeof(T));
  std::memcpy(out.data() + n, &v, sizeof(T));
}
void put_str(std::vector<uint8_t>& out, const std::string& s) {
  put<uint64_t>(out, s.size());
  out.insert(out.end(), s.begin(), s.end());
}
}  // namespace

void GgufWriter::put_key(const std::string& key, GgufType type) {
  put_str(kv_bytes_, key);
  put<uint32_t>(kv_bytes_, static_cast<uint32_t>(type));
  ++n_kv_;
}

void GgufWriter::set_alignment(uint32_t alignment) {
  alignment_ = alignment;
  add_u32("general.alignment", alignment);
}

void GgufWriter::add_string(const std::string& key, const std::string& value) {
  put_key(key, GgufType::kString);
  put_str(kv_bytes_, value);
}
void GgufWriter::add_u32(const std::string& key, uint32_t value) {
  put_key(key, GgufType::kUint32);
  put(kv_bytes_, value);
}
void GgufWriter::add_i32(const std::string& key, int32_t value) {
  put_key(key, GgufType::kInt32);
  put(kv_bytes_, value);
}
void GgufWriter::add_u64(const std::string& key, uint64_t value) {
  put_key(key, GgufType::kUint64);
  put(kv_bytes_, value);
}
void GgufWriter::add_f32(const std::string& key, float value) {
  put_key(key, GgufType::kFloat32);
  put(kv_bytes_, value);
}
void GgufWriter::add_bool(const std::string& key, bool value) {
  put_key(key, GgufType::kBool);
  put<uint8_t>(kv_bytes_, value ? 1 : 0);
}
void GgufWriter::add_string_array(const std::string& key, const std::vector<std::string>& values) {
  put_key(key, GgufType::kArray);
  put<uint32_t>(kv_bytes_, static_cast<uint32_t>(GgufType::kString));
  put<uint64_t>(kv_bytes_, values.size());
  for (const auto& s : values) put_str(kv_bytes_, s);
}
void GgufWriter::add_i32_array(const std::string& key, const std::vector<int32_t>& values) {
  put_key(key, GgufType::kArray);
  put<uint32_t>(kv_bytes_, static_cast<uint32_t>(GgufType::kInt32));
  put<uint64_t>(kv_bytes_, values.size());
  for (int32_t v : values) put(kv_bytes_, v);
}
void GgufWriter::add_bool_array(const std::string& key, const std::vector<bool>& values) {
  put_key(key, GgufType::kArray);
  put<uint32_t>(kv_bytes_, static_cast<uint32_t>(GgufType::kBool));
  put<uint64_t>(kv_bytes_, values.size());
  for (bool v : values) put<uint8_t>(kv_bytes_, v ? 1 : 0);
}
void GgufWriter::add_f32_array(const std::string& key, const std::vector<float>& values) {
  put_key(key, GgufType::kArray);
  put<uint32_t>(kv_bytes_, static_cast<uint32_t>(GgufType::kFloat32));
  put<uint64_t>(kv_bytes_, values.size());
  for (float v : values) put(kv_bytes_, v);
}

void GgufWriter::add_tensor(const std::string& name, GgmlType type,
                            const std::vector<int64_t>& dims, std::vector<uint8_t> data,
                            std::optional<uint64_t> offset) {
  add_tensor_raw(name, static_cast<uint32_t>(type), dims, std::move(data), offset);
}

void GgufWriter::add_tensor_raw(const std::string& name, uint32_t type,
                                const std::vector<int64_t>& dims, std::vector<uint8_t> data,
                                std::optional<uint64_t> offset) {
  tensors_.push_back({name, type, dims, std::move(data), offset});
}

std::vector<uint8_t> GgufWriter::to_bytes() const {
  std::vector<uint8_t> out;
  put<uint32_t>(out, 0x46554747);
  put<uint32_t>(out, version_);
  put<uint64_t>(out, tensors_.size());
  put<uint64_t>(out, n_kv_);
  out.insert(out.end(), kv_bytes_.begin(), kv_bytes_.end());

  // Lay the data out in order, each tensor at the next aligned offset (unless overridden).
  std::vector<uint64_t> offsets;
  uint64_t next = 0;
  for (const Tensor& t : tensors_) {
    const uint64_t off = t.offset ? *t.offset : next;
    offsets.push_back(off);
    const uint64_t end = off + t.data.size();
    next = (end + alignment_ - 1) / alignment_ * alignment_;
  }
  for (size_t k = 0; k < tensors_.size(); ++k) {
    const Tensor& t = tensors_[k];
    put_str(out, t.name);
    put<uint32_t>(out, static_cast<uint32_t>(t.dims.size()));
    for (int64_t d : t.dims) put<int64_t>(out, d);
    put<uint32_t>(out, t.type);
    put<uint64_t>(out, offsets[k]);
  }
  const size_t data_start = (out.size() + alignment_ - 1) / alignment_ * alignment_;
  out.resize(data_start, 0);
  for (size_t k = 0; k < tensors_.size(); ++k) {
    const size_t at = data_start + offsets[k];
    if (out.size() < at + tensors_[k].data.size()) out.resize(at + tensors_[k].data.size(), 0);
    std::memcpy(out.data() + at, tensors_[k].data.data(), tensors_[k].data.size());
  }
  return out;
}

Status GgufWriter::write(const std::string& path) const {
  const std::vector<uint8_t> bytes = to_bytes();
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return io_error("cannot create '" + path + "'");
  const size_t n = std::fwrite(bytes.data(), 1, bytes.size(), f);
  const bool closed = std::fclose(f) == 0;
  if (n != bytes.size() || !closed) return io_error("cannot write '" + path + "'");
  return {};
}

}  // namespace d2o
