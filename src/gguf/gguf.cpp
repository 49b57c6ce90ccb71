#include "gguf/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>

namespace d2o {

namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" read as a little-endian uint32

// Bounds-checked reader over the file's bytes. Every read either succeeds or returns a
// FormatError naming the byte offset and what was being read.
class Cursor {
 public:
  Cursor(const uint8_t* base, size_t size) : base_(base), size_(size) {}
  size_t pos() const { return pos_; }
  size_t remaining() const { return size_ - pos_; }

  template <class T>
  Status read(T* out, const char* what) {
    if (remaining() < sizeof(T)) return truncated(what, sizeof(T));
    std::memcpy(out, base_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return {};
  }

  Status read_string(std::string* out, const char* what) {
    uint64_t len = 0;
    D2O_RETURN_IF_ERROR(read(&len, what));
    if (len > GgufLimits::kMaxStringBytes) {
      return format_error(std::string(what) + ": string length " + std::to_string(len) +
                          " at byte " + std::to_string(pos_ - 8) + " is implausibly large");
    }
    if (remaining() < len) return truncated(what, len);
    out->assign(reinterpret_cast<const char*>(base_ + pos_), len);
    pos_ += len;
    return {};
  }

  // Skips n bytes (already checked to fit) and returns where they start.
  Status take(uint64_t n, const uint8_t** out, const char* what) {
    if (remaining() < n) return truncated(what, n);
    *out = base_ + pos_;
    pos_ += n;
    return {};
  }

 private:
  Status truncated(const char* what, uint64_t need) const {
    return format_error(std::string("file is truncated: reading ") + what + " at byte " +
                        std::to_string(pos_) + " needs " + std::to_string(need) +
                        " bytes but only " + std::to_string(remaining()) + " remain");
  }
  const uint8_t* base_;
  size_t size_;
  size_t pos_ = 0;
};

size_t scalar_size(GgufType t) {
  switch (t) {
    case GgufType::kUint8:
    case GgufType::kInt8:
    case GgufType::kBool:
      return 1;
    case GgufType::kUint16:
    case GgufType::kInt16:
      return 2;
    case GgufType::kUint32:
    case GgufType::kInt32:
    case GgufType::kFloat32:
      return 4;
    case GgufType::kUint64:
    case GgufType::kInt64:
    case GgufType::kFloat64:
      return 8;
    default:
      return 0;  // string, array: not fixed-size
  }
}

bool valid_type(uint32_t t) { return t <= static_cast<uint32_t>(GgufType::kFloat64); }

// Decodes one scalar of type t at p into v.
void decode_scalar(GgufType t, const uint8_t* p, GgufValue* v) {
  switch (t) {
    case GgufType::kUint8: v->u = p[0]; v->i = static_cast<int64_t>(v->u); break;
    case GgufType::kInt8: { int8_t x; std::memcpy(&x, p, 1); v->i = x; break; }
    case GgufType::kBool: v->i = p[0] != 0; v->u = static_cast<uint64_t>(v->i); break;
    case GgufType::kUint16: { uint16_t x; std::memcpy(&x, p, 2); v->u = x; v->i = x; break; }
    case GgufType::kInt16: { int16_t x; std::memcpy(&x, p, 2); v->i = x; break; }
    case GgufType::kUint32: { uint32_t x; std::memcpy(&x, p, 4); v->u = x; v->i = x; break; }
    case GgufType::kInt32: { int32_t x; std::memcpy(&x, p, 4); v->i = x; break; }
    case GgufType::kFloat32: { float x; std::memcpy(&x, p, 4); v->f = x; break; }
    case GgufType::kUint64: {
      uint64_t x; std::memcpy(&x, p, 8); v->u = x;
      v->i = x <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ? static_cast<int64_t>(x) : -1;
      break;
    }
    case GgufType::kInt64: { int64_t x; std::memcpy(&x, p, 8); v->i = x; break; }
    case GgufType::kFloat64: { double x; std::memcpy(&x, p, 8); v->f = x; break; }
    default: break;
  }
}

Status read_value(Cursor& c, GgufType type, GgufValue* v, const std::string& key) {
  v->type = type;
  if (type == GgufType::kString) return c.read_string(&v->str, "a string value");
  if (type == GgufType::kArray) {
    uint32_t at = 0;
    D2O_RETURN_IF_ERROR(c.read(&at, "an array element type"));
    if (!valid_type(at) || at == static_cast<uint32_t>(GgufType::kArray)) {
      return format_error("metadata key '" + key + "': invalid array element type " +
                          std::to_string(at));
    }
    v->array_type = static_cast<GgufType>(at);
    uint64_t n = 0;
    D2O_RETURN_IF_ERROR(c.read(&n, "an array length"));
    if (n > GgufLimits::kMaxArrayElements) {
      return format_error("metadata key '" + key + "': array length " + std::to_string(n) +
                          " is implausibly large");
    }
    v->array_size = n;
    if (v->array_type == GgufType::kString) {
      // Each string takes at least its 8-byte length: reject counts the file cannot hold
      // before reserving memory for them.
      if (n > c.remaining() / 8) {
        return format_error("metadata key '" + key + "': array of " + std::to_string(n) +
                            " strings does not fit in the rest of the file");
      }
      v->strings.resize(n);
      for (uint64_t k = 0; k < n; ++k) D2O_RETURN_IF_ERROR(c.read_string(&v->strings[k], "an array string"));
      return {};
    }
    const size_t es = scalar_size(v->array_type);
    if (n > c.remaining() / es) {
      return format_error("metadata key '" + key + "': array of " + std::to_string(n) +
                          " elements does not fit in the rest of the file");
    }
    return c.take(n * es, &v->array_data, "array data");
  }
  const size_t sz = scalar_size(type);
  const uint8_t* p = nullptr;
  D2O_RETURN_IF_ERROR(c.take(sz, &p, "a scalar value"));
  decode_scalar(type, p, v);
  return {};
}

}  // namespace

const char* gguf_type_name(GgufType type) {
  switch (type) {
    case GgufType::kUint8: return "uint8";
    case GgufType::kInt8: return "int8";
    case GgufType::kUint16: return "uint16";
    case GgufType::kInt16: return "int16";
    case GgufType::kUint32: return "uint32";
    case GgufType::kInt32: return "int32";
    case GgufType::kFloat32: return "float32";
    case GgufType::kBool: return "bool";
    case GgufType::kString: return "string";
    case GgufType::kArray: return "array";
    case GgufType::kUint64: return "uint64";
    case GgufType::kInt64: return "int64";
    case GgufType::kFloat64: return "float64";
  }
  return "unknown";
}

bool GgufValue::is_integer() const {
  switch (type) {
    case GgufType::kUint8: case GgufType::kInt8: case GgufType::kUint16: case GgufType::kInt16:
    case GgufType::kUint32: case GgufType::kInt32: case GgufType::kUint64: case GgufType::kInt64:
      return true;
    default:
      return false;
  }
}

int64_t GgufTensorInfo::n_elements() const {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

std::string GgufTensorInfo::shape_string() const {
  std::string s = "[";
  for (size_t k = 0; k < dims.size(); ++k) s += (k ? ", " : "") + std::to_string(dims[k]);
  return s + "]";
}

Result<std::unique_ptr<GgufFile>> GgufFile::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return io_error("cannot open '" + path + "': " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    return io_error("cannot stat '" + path + "': " + std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return io_error("'" + path + "' is not a regular file");
  }
  std::unique_ptr<GgufFile> f(new GgufFile());
  f->path_ = path;
  f->size_ = static_cast<size_t>(st.st_size);
  if (f->size_ > 0) {
    void* m = ::mmap(nullptr, f->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) {
      const int e = errno;
      ::close(fd);
      return io_error("cannot map '" + path + "': " + std::strerror(e));
    }
    f->base_ = static_cast<const uint8_t*>(m);
    f->owns_mapping_ = true;
  }
  f->fd_ = fd;
  Status s = f->parse();
  if (!s.ok()) return s.with_context(path);
  return f;
}

Result<std::unique_ptr<GgufFile>> GgufFile::from_memory(const uint8_t* data, size_t size,
                                                        std::string name) {
  std::unique_ptr<GgufFile> f(new GgufFile());
  f->path_ = std::move(name);
  f->base_ = data;
  f->size_ = size;
  Status s = f->parse();
  if (!s.ok()) return s.with_context(f->path_);
  return f;
}

Status GgufFile::read_tensor(const GgufTensorInfo& t, uint8_t* dst) const {
  return read_tensor_bytes(t, 0, t.n_bytes, dst);
}

Status GgufFile::read_tensor_bytes(const GgufTensorInfo& t, uint64_t offset, uint64_t n,
                                   uint8_t* dst) const {
  if (offset > t.n_bytes || n > t.n_bytes - offset) {
    return invalid_argument("'" + path_ + "': bytes [" + std::to_string(offset) + ", " +
                            std::to_string(offset + n) + ") are outside tensor '" + t.name +
                            "' (" + std::to_string(t.n_bytes) + " bytes)");
  }
  const uint64_t begin = data_offset_ + t.offset + offset;
  if (fd_ < 0) {
    if (n > 0) std::memcpy(dst, base_ + begin, n);
    return {};
  }
  uint64_t done = 0;
  while (done < n) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(n - done, uint64_t{1} << 30));
    const ssize_t got = ::pread(fd_, dst + done, want, static_cast<off_t>(begin + done));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) {
      return io_error("'" + path_ + "': cannot read tensor '" + t.name +
                      "': " + std::strerror(errno));
    }
    if (got == 0) {
      struct stat st {};
      const long long now = ::fstat(fd_, &st) == 0 ? static_cast<long long>(st.st_size) : -1;
      return io_error("'" + path_ + "' changed while it was being read: tensor '" + t.name +
                      "' ends at byte " + std::to_string(data_offset_ + t.offset + t.n_bytes) +
                      ", but the file now has " + std::to_string(now) + " bytes (it had " +
                      std::to_string(size_) + ")");
    }
    done += static_cast<uint64_t>(got);
  }
  return {};
}

GgufFile::~GgufFile() {
  if (owns_mapping_ && base_) ::munmap(const_cast<uint8_t*>(base_), size_);
  if (fd_ >= 0) ::close(fd_);
}

Status GgufFile::parse() {
  Cursor c(base_, size_);
  uint32_t magic = 0;
  if (size_ < 4) return format_error("not a GGUF file: only " + std::to_string(size_) + " bytes");
  D2O_RETURN_IF_ERROR(c.read(&magic, "the magic number"));
  if (magic != kMagic) {
    return format_error("not a GGUF file: bad magic bytes (expected 'GGUF' at the start)");
  }
  D2O_RETURN_IF_ERROR(c.read(&version_, "the version"));
  if (version_ == 1) {
    return unsupported("GGUF version 1 is not supported (re-convert the model to GGUF v3)");
  }
  if (version_ != 2 && version_ != 3) {
    // A big-endian file reads as a byte-swapped version number.
    const bool swapped = version_ == 0x02000000u || version_ == 0x03000000u;
    return unsupported("GGUF version " + std::to_string(version_) + " is not supported" +
                       (swapped ? " (this looks like a big-endian file; only little-endian is read)"
                                : " (supported: 2 and 3)"));
  }
  uint64_t n_tensors = 0, n_kv = 0;
  D2O_RETURN_IF_ERROR(c.read(&n_tensors, "the tensor count"));
  D2O_RETURN_IF_ERROR(c.read(&n_kv, "the metadata count"));
  if (n_tensors > GgufLimits::kMaxTensors) {
    return format_error("tensor count " + std::to_string(n_tensors) + " is implausibly large");
  }
  if (n_kv > GgufLimits::kMaxKv) {
    return format_error("metadata count " + std::to_string(n_kv) + " is implausibly large");
  }

  // Metadata.
  kv_.reserve(std::min<uint64_t>(n_kv, c.remaining() / 12));
  for (uint64_t k = 0; k < n_kv; ++k) {
    std::string key;
    D2O_RETURN_IF_ERROR(c.read_string(&key, "a metadata key"));
    uint32_t t = 0;
    D2O_RETURN_IF_ERROR(c.read(&t, "a metadata value type"));
    if (!valid_type(t)) {
      return format_error("metadata key '" + key + "' has invalid value type " + std::to_string(t));
    }
    GgufValue v;
    D2O_RETURN_IF_ERROR(read_value(c, static_cast<GgufType>(t), &v, key));
    if (kv_index_.count(key)) return format_error("duplicate metadata key '" + key + "'");
    kv_index_.emplace(key, kv_.size());
    kv_.emplace_back(std::move(key), std::move(v));
  }

  if (const GgufValue* a = find("general.alignment")) {
    if (!a->is_integer() || a->i <= 0 || (a->i & (a->i - 1)) != 0 || a->i > (1 << 20)) {
      return format_error("general.alignment must be a positive power of two (got " +
                          std::to_string(a->i) + ")");
    }
    alignment_ = static_cast<uint64_t>(a->i);
  }

  // Tensor infos.
  tensors_.reserve(std::min<uint64_t>(n_tensors, c.remaining() / 24));
  for (uint64_t k = 0; k < n_tensors; ++k) {
    GgufTensorInfo t;
    D2O_RETURN_IF_ERROR(c.read_string(&t.name, "a tensor name"));
    uint32_t n_dims = 0;
    D2O_RETURN_IF_ERROR(c.read(&n_dims, "a tensor's dimension count"));
    if (n_dims == 0 || n_dims > GgufLimits::kMaxDims) {
      return format_error("tensor '" + t.name + "' has " + std::to_string(n_dims) +
                          " dimensions (1 to 4 allowed)");
    }
    int64_t n_elem = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      int64_t ne = 0;
      D2O_RETURN_IF_ERROR(c.read(&ne, "a tensor dimension"));
      if (ne <= 0 || ne > GgufLimits::kMaxDim) {
        return format_error("tensor '" + t.name + "' has an absurd dimension " +
                            std::to_string(ne));
      }
      if (n_elem > std::numeric_limits<int64_t>::max() / ne) {
        return format_error("tensor '" + t.name + "' has an element count that overflows");
      }
      n_elem *= ne;
      t.dims.push_back(ne);
    }
    uint32_t type = 0;
    D2O_RETURN_IF_ERROR(c.read(&type, "a tensor type"));
    auto traits = ggml_type_traits(type);
    if (!traits) {
      return unsupported("tensor '" + t.name + "' has unknown tensor type " + std::to_string(type));
    }
    t.type = static_cast<GgmlType>(type);
    if (t.dims[0] % traits->block_size != 0) {
      return format_error("tensor '" + t.name + "': row length " + std::to_string(t.dims[0]) +
                          " is not a multiple of the " + traits->name + " block size " +
                          std::to_string(traits->block_size));
    }
    const uint64_t n_blocks = static_cast<uint64_t>(n_elem / traits->block_size);
    if (n_blocks > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(traits->type_size)) {
      return format_error("tensor '" + t.name + "' byte size overflows");
    }
    t.n_bytes = n_blocks * static_cast<uint64_t>(traits->type_size);
    D2O_RETURN_IF_ERROR(c.read(&t.offset, "a tensor offset"));
    if (t.offset % alignment_ != 0) {
      return format_error("tensor '" + t.name + "' offset " + std::to_string(t.offset) +
                          " is not a multiple of the alignment " + std::to_string(alignment_));
    }
    if (tensor_index_.count(t.name)) return format_error("duplicate tensor name '" + t.name + "'");
    tensor_index_.emplace(t.name, tensors_.size());
    tensors_.push_back(std::move(t));
  }

  // The data section starts at the next multiple of the alignment.
  const uint64_t pos = c.pos();
  data_offset_ = (pos + alignment_ - 1) / alignment_ * alignment_;
  if (!tensors_.empty() && data_offset_ > size_) {
    return format_error("file is truncated: the tensor data section would start at byte " +
                        std::to_string(data_offset_) + " of a " + std::to_string(size_) +
                        "-byte file");
  }
  const uint64_t data_size = data_offset_ <= size_ ? size_ - data_offset_ : 0;

  // Bounds and overlap of tensor data.
  std::vector<size_t> order(tensors_.size());
  for (size_t k = 0; k < order.size(); ++k) order[k] = k;
  for (const GgufTensorInfo& t : tensors_) {
    if (t.offset > data_size || t.n_bytes > data_size - t.offset) {
      return format_error("tensor '" + t.name + "' data (" + std::to_string(t.n_bytes) +
                          " bytes at data offset " + std::to_string(t.offset) +
                          ") extends past the end of the file (data section holds " +
                          std::to_string(data_size) + " bytes); the file is truncated or corrupt");
    }
  }
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return tensors_[a].offset < tensors_[b].offset; });
  for (size_t k = 1; k < order.size(); ++k) {
    const GgufTensorInfo& prev = tensors_[order[k - 1]];
    const GgufTensorInfo& cur = tensors_[order[k]];
    if (prev.offset + prev.n_bytes > cur.offset) {
      return format_error("tensors '" + prev.name + "' and '" + cur.name +
                          "' overlap in the data section");
    }
  }
  return {};
}

const GgufValue* GgufFile::find(std::string_view key) const {
  auto it = kv_index_.find(key);
  return it == kv_index_.end() ? nullptr : &kv_[it->second].second;
}

const GgufTensorInfo* GgufFile::find_tensor(std::string_view name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

namespace {
Status missing(std::string_view key) {
  return not_found("metadata key '" + std::string(key) + "' is missing");
}
Status wrong_type(std::string_view key, const GgufValue& v, const char* want) {
  return format_error("metadata key '" + std::string(key) + "' is a " + gguf_type_name(v.type) +
                      ", expected " + want);
}
}  // namespace

Result<std::string> GgufFile::get_string(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) return missing(key);
  if (v->type != GgufType::kString) return wrong_type(key, *v, "a string");
  return v->str;
}

Result<int64_t> GgufFile::get_int(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) return missing(key);
  if (!v->is_integer()) return wrong_type(key, *v, "an integer");
  if (v->type == GgufType::kUint64 && v->i < 0) {
    return format_error("metadata key '" + std::string(key) + "' is out of range");
  }
  return v->i;
}

Result<double> GgufFile::get_float(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) return missing(key);
  if (v->is_float()) return v->f;
  if (v->is_integer()) return static_cast<double>(v->i);
  return wrong_type(key, *v, "a number");
}

Result<bool> GgufFile::get_bool(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) return missing(key);
  if (v->type != GgufType::kBool) return wrong_type(key, *v, "a bool");
  return v->i != 0;
}

Result<std::vector<std::string>> GgufFile::get_string_array(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) return missing(key);
  if (v->type != GgufType::kArray || v->array_type != GgufType::kString) {
    return wrong_type(key, *v, "an array of strings");
  }
  return v->strings;
}

Result<std::vector<int64_t>> GgufFile::get_int_array(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) return missing(key);
  GgufValue probe;
  probe.type = v->array_type;
  if (v->type != GgufType::kArray || !probe.is_integer()) {
    return wrong_type(key, *v, "an array of integers");
  }
  std::vector<int64_t> out(v->array_size);
  const size_t es = scalar_size(v->array_type);
  for (uint64_t k = 0; k < v->array_size; ++k) {
    GgufValue e;
    decode_scalar(v->array_type, v->array_data + k * es, &e);
    out[k] = e.i;
  }
  return out;
}

Result<std::vector<float>> GgufFile::get_float_array(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) return missing(key);
  if (v->type != GgufType::kArray ||
      (v->array_type != GgufType::kFloat32 && v->array_type != GgufType::kFloat64)) {
    return wrong_type(key, *v, "an array of floats");
  }
  std::vector<float> out(v->array_size);
  const size_t es = scalar_size(v->array_type);
  for (uint64_t k = 0; k < v->array_size; ++k) {
    GgufValue e;
    decode_scalar(v->array_type, v->array_data + k * es, &e);
    out[k] = static_cast<float>(e.f);
  }
  return out;
}

Result<int64_t> GgufFile::get_int_or(std::string_view key, int64_t fallback) const {
  if (!find(key)) return fallback;
  return get_int(key);
}

Result<double> GgufFile::get_float_or(std::string_view key, double fallback) const {
  if (!find(key)) return fallback;
  return get_float(key);
}

Result<bool> GgufFile::get_bool_or(std::string_view key, bool fallback) const {
  if (!find(key)) return fallback;
  return get_bool(key);
}

}  // namespace d2o
