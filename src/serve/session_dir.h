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
#pragma once

#include <optional>
#include <string>

#include "d2o/status.h"
#include "serve/session_file.h"

namespace d2o::serve {

class SessionDir {
 public:
  // Creates DIR when absent. Errors: it cannot be created, or is not a writable directory.
  static Result<SessionDir> open(const std::string& dir, const SessionFileContext& ctx);

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

 private:
  SessionDir(std::string dir, const SessionFileContext& ctx) : dir_(std::move(dir)), ctx_(ctx) {}
  std::string dir_;
  SessionFileContext ctx_;
  // The bytes of the last session written, kept so that the next write reuses the pages (as
  // large as the largest session written; SessionDir is used by one thread).
  mutable std::string buf_;
};

}  // namespace d2o::serve
