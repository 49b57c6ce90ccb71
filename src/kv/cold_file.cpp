#include "kv/cold_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace d2o {

ColdFile::ColdFile() {
  const char* env = std::getenv("TMPDIR");
  const std::string dir = env && *env ? env : "/tmp";
#ifdef O_TMPFILE
  fd_ = ::open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
#endif
  if (fd_ < 0) {  // a file system without O_TMPFILE: a named file, unlinked at once
    std::string path = dir + "/d2o-cold-XXXXXX";
    fd_ = ::mkostemp(path.data(), O_CLOEXEC);
    if (fd_ >= 0) ::unlink(path.c_str());
  }
  if (fd_ < 0) error_ = "cannot create a cold tier file in " + dir + ": " + std::strerror(errno);
}

ColdFile::~ColdFile() {
  if (fd_ >= 0) ::close(fd_);
}

int64_t ColdFile::append(const void* data, size_t n) {
  if (fd_ < 0) return -1;
  const int64_t off = end_.fetch_add(static_cast<int64_t>(n));
  const char* p = static_cast<const char*>(data);
  size_t done = 0;
  while (done < n) {
    const ssize_t w = ::pwrite(fd_, p + done, n - done, static_cast<off_t>(off + done));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return -1;
    done += static_cast<size_t>(w);
  }
  return off;
}

bool ColdFile::read(int64_t offset, void* out, size_t n) const {
  if (fd_ < 0) return false;
  char* p = static_cast<char*>(out);
  size_t done = 0;
  while (done < n) {
    const ssize_t r = ::pread(fd_, p + done, n - done, static_cast<off_t>(offset + done));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    done += static_cast<size_t>(r);
  }
  return true;
}

void ColdFile::clear() {
  if (fd_ >= 0 && ::ftruncate(fd_, 0) == 0) end_.store(0);
}

}  // namespace d2o
