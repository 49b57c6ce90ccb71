#include "core/mem.h"

#include "core/sanitizer.h"

#include <sys/mman.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

namespace d2o {

namespace {
size_t read_status_kb(const char* key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const size_t klen = std::strlen(key);
  while (std::getline(in, line)) {
    if (line.compare(0, klen, key) == 0) {
      return static_cast<size_t>(std::strtoull(line.c_str() + klen + 1, nullptr, 10)) * 1024;
    }
  }
  return 0;
}
}  // namespace

// Under a sanitizer every block comes from malloc, which the sanitizer replaces: ASan's redzones
// and leak check then cover the large blocks too (mapped ones would escape both), and the test
// binaries' allocation counter sees them without wrapping mmap.
constexpr bool kMapLargeBlocks = !D2O_SANITIZED;

void* aligned_block_alloc(size_t bytes) {
  if (!kMapLargeBlocks || bytes < kMappedBytes) return std::aligned_alloc(64, bytes);
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return p == MAP_FAILED ? nullptr : p;  // page-aligned
}

void aligned_block_free(void* p, size_t bytes) {
  if (!kMapLargeBlocks || bytes < kMappedBytes) {
    std::free(p);
  } else {
    munmap(p, bytes);
  }
}

size_t peak_rss_bytes() {
  return read_status_kb("VmHWM");
}
size_t current_rss_bytes() {
  return read_status_kb("VmRSS");
}

bool reset_peak_rss() {
  std::FILE* f = std::fopen("/proc/self/clear_refs", "w");
  if (!f) return false;
  const bool ok = std::fputs("5", f) >= 0;
  return std::fclose(f) == 0 && ok;
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", bytes, units[u]);
  return buf;
}

}  // namespace d2o
