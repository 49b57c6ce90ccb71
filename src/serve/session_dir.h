// `d2o serve --session-dir DIR`: kept conversations written to files and read back, so that they
// survive a restart and idle ones can leave memory without being lost.
//
// One file per session, DIR/<id>.d2os (serve/session_file.h holds the format), where <id> is
// the id the session is kept under (serve/api_keys.h: the client's id in the default namespace,
// `<key name>@<id>` in a key's). The name is derived from an id that passed
// valid_scoped_session_id() (letters, digits, '.', '_', ':', '-', one '@' after a key name; no
// '/', and never "." or ".." with the suffix), so it cannot leave DIR. A write goes to
// DIR/<id>.d2os.tmp and is renamed over the old file: a reader, or a crash of the process, sees
// the old file or the new one, never half of one. Writes are not flushed to the disk
// (fdatasync): after a crash of the machine a file may be damaged, which its checksum shows when
// it is read (the session is then rebuilt). A read refuses anything but a regular file no larger
// than the largest session the context allows, then decodes it with every field checked.
//
// Opening the directory removes the temporary files a killed process left (one server owns a
// directory). With a bound on the directory's size (--session-dir-max), a write that takes the
// session files past it removes the least recently used other files (written or read) until
// they fit again; their sessions are rebuilt if they come back.
#pragma once

#include <cerrno>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "d2o/status.h"
#include "serve/session_file.h"

namespace d2o::serve {

class SessionDir {
 public:
  // Creates DIR when absent. max_bytes: the most the session files may hold together (0: no
  // bound). Errors: it cannot be created, or is not a writable directory.
  static Result<SessionDir> open(const std::string& dir, const SessionFileContext& ctx,
                                 uint64_t max_bytes = 0);

  const std::string& dir() const { return dir_; }
  const SessionFileContext& context() const { return ctx_; }
  // DIR/<id>.d2os; an error for an id valid_scoped_session_id() refuses.
  Result<std::string> path_for(const std::string& id) const;

  // Writes a session's file atomically; returns its size in bytes.
  Result<size_t> save(const std::string& id, const std::string& kv_spec,
                      const std::vector<TokenId>& tokens, int64_t n_past, const KvCache& cache,
                      const PolicyState& state) const;
  // The session saved under `id`; nullopt when there is no file. Errors: the file cannot be
  // read, is malformed, or was written for another model, cache layout or session id.
  Result<std::optional<SessionData>> load(const std::string& id) const;
  // Deletes the file of `id` if there is one.
  void remove(const std::string& id) const;

  // Test hook for a full disk or a read-only directory: the `nth` write from now (1: the next
  // one) and the `count - 1` after it fail with `err`. ENOSPC, EIO, ...: the temporary file is
  // created and half of the bytes reach it before the write fails; EROFS, EACCES: the temporary
  // file cannot be created. nth 0: no write fails. Safe from any thread.
  void set_write_fault(int nth, int count = 1, int err = ENOSPC) const;

  // Bytes the session files hold, files removed to keep the bound, stray temporary files removed
  // when the directory was opened.
  uint64_t bytes_held() const { return held_; }
  int64_t files_removed() const { return removed_; }
  int64_t strays_removed() const { return strays_; }

 private:
  SessionDir(std::string dir, const SessionFileContext& ctx)
      : dir_(std::move(dir)), ctx_(ctx), fault_(std::make_unique<WriteFault>()) {}
  // The errno this write is to fail with (set_write_fault), or 0.
  int take_write_fault() const;
  // Writes `bytes` to `tmp` (failing with `fault` when it is not 0); "" or why it failed.
  static std::string write_file(const std::string& tmp, const std::string& bytes, int fault);
  // Notes a use of `id`'s file of `bytes` bytes (the most recent use).
  void touch(const std::string& id, uint64_t bytes) const;
  // Removes least recently used files other than `keep` while the files exceed the bound.
  void keep_bound(const std::string& keep) const;
  std::string dir_;
  SessionFileContext ctx_;
  uint64_t max_bytes_ = 0;
  // The session files: id -> (bytes, last use), and their total.
  struct FileUse {
    uint64_t bytes = 0;
    uint64_t used = 0;
  };
  mutable std::map<std::string, FileUse> files_;
  mutable uint64_t held_ = 0, clock_ = 0;
  mutable int64_t removed_ = 0;
  int64_t strays_ = 0;
  // The bytes of the last session written, kept so that the next write reuses the pages (as
  // large as the largest session written; SessionDir is used by one thread).
  mutable std::string buf_;
  struct WriteFault {
    std::mutex mu;
    int in = 0, count = 0, err = 0;  // in: writes until the first that fails (1: the next)
  };
  std::unique_ptr<WriteFault> fault_;
};

}  // namespace d2o::serve
