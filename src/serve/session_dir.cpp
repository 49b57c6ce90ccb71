#include "serve/session_dir.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <utility>
#include <vector>

#include "serve/api_keys.h"

namespace d2o::serve {

namespace {

std::string errno_text() {
  return std::strerror(errno);
}

// Writes all of `data` to fd (retrying short writes and EINTR).
bool write_all(int fd, const char* data, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, data, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    data += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

}  // namespace

Result<SessionDir> SessionDir::open(const std::string& dir, const SessionFileContext& ctx,
                                    uint64_t max_bytes) {
  if (dir.empty()) return invalid_argument("--session-dir: an empty path");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return io_error("--session-dir " + dir + ": cannot create it: " + ec.message());
  if (!std::filesystem::is_directory(dir, ec))
    return invalid_argument("--session-dir " + dir + ": not a directory");
  if (::access(dir.c_str(), W_OK | X_OK) != 0)
    return io_error("--session-dir " + dir + ": not writable: " + errno_text());
  SessionDir d(dir, ctx);
  d.max_bytes_ = max_bytes;
  // The files there: temporary ones a killed process left are removed; session files are
  // indexed, their last use taken from their modification times (oldest first).
  const std::string suffix = kSessionFileSuffix;
  const std::string tmp_suffix = suffix + ".tmp";
  auto ends_with = [](const std::string& s, const std::string& e) {
    return s.size() > e.size() && s.compare(s.size() - e.size(), e.size(), e) == 0;
  };
  std::vector<std::pair<std::filesystem::file_time_type, std::pair<std::string, uint64_t>>> found;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    if (!e.is_regular_file(ec)) continue;
    const std::string name = e.path().filename().string();
    if (ends_with(name, tmp_suffix)) {
      if (std::filesystem::remove(e.path(), ec)) ++d.strays_;
      continue;
    }
    if (!ends_with(name, suffix)) continue;
    const std::string id = name.substr(0, name.size() - suffix.size());
    if (!valid_scoped_session_id(id)) continue;
    found.push_back({e.last_write_time(ec), {id, static_cast<uint64_t>(e.file_size(ec))}});
  }
  std::sort(found.begin(), found.end());
  for (const auto& [t, f] : found) d.touch(f.first, f.second);
  return d;
}

void SessionDir::touch(const std::string& id, uint64_t bytes) const {
  FileUse& u = files_[id];
  held_ = held_ - u.bytes + bytes;
  u.bytes = bytes;
  u.used = ++clock_;
}

void SessionDir::keep_bound(const std::string& keep) const {
  while (max_bytes_ > 0 && held_ > max_bytes_) {
    auto lru = files_.end();
    for (auto it = files_.begin(); it != files_.end(); ++it) {
      if (it->first != keep && (lru == files_.end() || it->second.used < lru->second.used)) lru = it;
    }
    if (lru == files_.end()) return;  // only `keep` is left
    const std::string id = lru->first;
    remove(id);
    ++removed_;
  }
}

Result<std::string> SessionDir::path_for(const std::string& id) const {
  if (!valid_scoped_session_id(id)) return invalid_argument("not a valid session id: '" + id + "'");
  return dir_ + "/" + id + kSessionFileSuffix;
}

Result<size_t> SessionDir::save(const std::string& id, const std::string& kv_spec,
                                const std::vector<TokenId>& tokens, int64_t n_past,
                                const KvCache& cache, const PolicyState& state) const {
  D2O_ASSIGN_OR_RETURN(std::string path, path_for(id));
  D2O_RETURN_IF_ERROR(encode_session(ctx_, id, kv_spec, tokens, n_past, cache, state, buf_));
  const std::string& bytes = buf_;
  const std::string tmp = path + ".tmp";
  const std::string failed = write_file(tmp, bytes, take_write_fault());
  if (!failed.empty()) return io_error(failed);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string e = errno_text();
    ::unlink(tmp.c_str());
    return io_error("cannot rename " + tmp + " to " + path + ": " + e);
  }
  touch(id, bytes.size());
  keep_bound(id);
  return bytes.size();
}

std::string SessionDir::write_file(const std::string& tmp, const std::string& bytes, int fault) {
  if (fault == EROFS || fault == EACCES) {
    return "cannot create " + tmp + ": " + std::strerror(fault);
  }
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) return "cannot create " + tmp + ": " + errno_text();
  // Not flushed to the disk (fdatasync took 4-23 ms per 6 MB file here, on the engine thread):
  // a crash of the process loses nothing, and a file damaged by a crash of the machine fails
  // its checksum when read, so its session is rebuilt, never continued wrongly.
  bool ok;
  if (fault != 0) {  // as a full disk fails: part of the bytes written, then the error
    (void)write_all(fd, bytes.data(), bytes.size() / 2);
    errno = fault;
    ok = false;
  } else {
    ok = write_all(fd, bytes.data(), bytes.size());
  }
  const std::string why = ok ? "" : errno_text();
  ::close(fd);
  if (ok) return "";
  ::unlink(tmp.c_str());  // never renamed: the old file, if any, stays as it was
  return "cannot write " + tmp + ": " + why;
}

void SessionDir::set_write_fault(int nth, int count, int err) const {
  std::lock_guard<std::mutex> lock(fault_->mu);
  fault_->in = nth;
  fault_->count = nth > 0 ? count : 0;
  fault_->err = err;
}

int SessionDir::take_write_fault() const {
  std::lock_guard<std::mutex> lock(fault_->mu);
  WriteFault& f = *fault_;
  if (f.count <= 0) return 0;
  if (f.in > 1) {
    --f.in;
    return 0;
  }
  --f.count;
  return f.err;
}

Result<std::optional<SessionData>> SessionDir::load(const std::string& id) const {
  D2O_ASSIGN_OR_RETURN(std::string path, path_for(id));
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    if (errno == ENOENT) return std::optional<SessionData>();
    return io_error("cannot open " + path + ": " + errno_text());
  }
  struct stat st {};
  std::string bytes;
  Status s;
  if (::fstat(fd, &st) != 0) {
    s = io_error("cannot stat " + path + ": " + errno_text());
  } else if (!S_ISREG(st.st_mode)) {
    s = invalid_argument(path + " is not a regular file");
  } else if (static_cast<uint64_t>(st.st_size) > max_session_file_bytes(ctx_)) {
    s = format_error(path + " is larger (" + std::to_string(st.st_size) +
                     " bytes) than any session of this context");
  } else {
    bytes.resize(static_cast<size_t>(st.st_size));
    size_t got = 0;
    while (got < bytes.size()) {
      const ssize_t r = ::read(fd, bytes.data() + got, bytes.size() - got);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) break;
      got += static_cast<size_t>(r);
    }
    if (got != bytes.size()) s = io_error("cannot read " + path + ": " + errno_text());
  }
  ::close(fd);
  if (!s.ok()) return s;
  auto d = decode_session(ctx_, reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  if (!d.ok()) return d.status().with_context(path);
  if (d->id != id) return format_error(path + " holds session '" + d->id + "'");
  touch(id, bytes.size());
  return std::optional<SessionData>(std::move(d).value());
}

void SessionDir::remove(const std::string& id) const {
  auto path = path_for(id);
  if (path.ok()) ::unlink(path->c_str());
  const auto it = files_.find(id);
  if (it == files_.end()) return;
  held_ -= it->second.bytes;
  files_.erase(it);
}

}  // namespace d2o::serve
