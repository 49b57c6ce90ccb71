// ColdFile: the file a cold tier on disk (cold=disk, kv/cold_tier.h) keeps its slots in. An
// unlinked temporary file in $TMPDIR (else /tmp): it holds nothing once the process ends, and no
// name that another user could open. Writers append extents at the end (several threads at once:
// each reserves its range first); extents that are no longer used are garbage until clear().
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "d2o/status.h"

namespace d2o {

class ColdFile {
 public:
  ColdFile();
  ~ColdFile();
  ColdFile(const ColdFile&) = delete;
  ColdFile& operator=(const ColdFile&) = delete;

  // Whether the file could be created (else error() says why, and writes fail).
  bool ok() const { return fd_ >= 0; }
  const std::string& error() const { return error_; }
  // Writes n bytes at a fresh offset at the end; returns the offset, or -1 on an I/O error.
  int64_t append(const void* data, size_t n);
  // Reads n bytes at `offset`; false on an I/O error.
  bool read(int64_t offset, void* out, size_t n) const;
  // Bytes written so far (live and garbage).
  int64_t size() const { return end_.load(); }
  // Empties the file (every extent becomes invalid).
  void clear();

 private:
  int fd_ = -1;
  std::string error_;
  std::atomic<int64_t> end_{0};
};

}  // namespace d2o
