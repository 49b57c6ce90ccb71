// Memory: aligned buffers for weights, caches and scratch, and process memory figures.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <string>
#include <utility>

namespace d2o {

// Asks for the cache lines of [p, p + bytes), one request per 64 bytes: for data read soon in an
// order the hardware's stride prefetch does not follow.
inline void prefetch_bytes(const void* p, size_t bytes) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (size_t o = 0; o < bytes; o += 64) __builtin_prefetch(b + o);
}

// Memory of AlignedBuffer: 64-byte aligned blocks of `bytes` (a multiple of 64). Blocks of at
// least kMappedBytes are their own anonymous mappings, returned to the system when freed; smaller
// ones come from malloc. A KV cache block (a layer's keys or values: tens of KiB for a compressed
// cache, more for a full one) lives as long as its sequence, and such blocks of many sizes, freed
// in another order than taken, fragmented malloc's heap: under continuous batching, RSS grew by
// about 17 MiB per 32 requests served and was never given back. Null when out of memory.
// Sanitizer builds (ASan, TSan) take every block from malloc, so that the sanitizer sees them all.
inline constexpr size_t kMappedBytes = 16 * 1024;
void* aligned_block_alloc(size_t bytes);
void aligned_block_free(void* p, size_t bytes);

// 64-byte aligned (one cache line, one AVX-512 register) heap buffer of trivially copyable T.
// Contents are uninitialised after allocation unless zero() is called.
template <class T>
class AlignedBuffer {
 public:
  static constexpr size_t kAlign = 64;
  AlignedBuffer() = default;
  explicit AlignedBuffer(size_t n) { resize(n); }
  AlignedBuffer(AlignedBuffer&& o) noexcept { *this = std::move(o); }
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept {
    if (this != &o) {
      release();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer() { release(); }

  // Reallocates (contents are lost) unless the size is unchanged.
  void resize(size_t n) {
    if (n == size_) return;
    release();
    if (n == 0) return;
    data_ = static_cast<T*>(aligned_block_alloc(bytes_of(n)));
    if (!data_) throw std::bad_alloc();
    size_ = n;
  }
  void zero() {
    for (size_t i = 0; i < size_; ++i) data_[i] = T{};
  }
  T* data() { return data_; }
  const T* data() const { return data_; }
  size_t size() const { return size_; }
  size_t bytes() const { return size_ * sizeof(T); }
  T& operator[](size_t i) { return data_[i]; }
  const T& operator[](size_t i) const { return data_[i]; }

 private:
  static size_t bytes_of(size_t n) { return (n * sizeof(T) + kAlign - 1) / kAlign * kAlign; }
  void release() {
    if (data_) aligned_block_free(data_, bytes_of(size_));
    data_ = nullptr;
    size_ = 0;
  }
  T* data_ = nullptr;
  size_t size_ = 0;
};

// Peak resident set size of this process so far (VmHWM), in bytes; 0 if unknown.
size_t peak_rss_bytes();
// Current resident set size (VmRSS), in bytes; 0 if unknown.
size_t current_rss_bytes();
// Resets the peak (writes 5 to /proc/self/clear_refs); returns false where the kernel refuses.
bool reset_peak_rss();

// "1.23 MiB" style.
std::string format_bytes(double bytes);

}  // namespace d2o
