// API keys of `d2o serve` (docs/SERVING.md): `--api-key-file FILE`, one `name:key` per line, or
// `--api-key KEY` (one key named `default`). A key's name is who the request is: sessions are
// looked up in the name's namespace (scoped_session_id), /metrics counts requests and tokens per
// name, and with several keys only the admin key (--admin-key-name) may read /metrics.
//
// File format: one `name:key` per line; blank lines and lines whose first non-blank character
// is '#' are skipped; blanks around a line (and a CR before its LF) are ignored. Names are 1-64
// of [A-Za-z0-9_.-]; keys 16-4096 printable ASCII characters without blanks (what an
// `Authorization: Bearer` header carries). Duplicate names or keys, malformed lines and a file
// with no key are errors naming the line; no message ever quotes a key.
// Keys are read once, at start-up: rotating keys means restarting the server.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "d2o/status.h"

namespace d2o::serve {

struct ApiKey {
  std::string name;
  std::string key;
};

// The name of the key given with --api-key, and the namespace of sessions from before keys had
// names (a session directory written by a single-key or open server).
inline constexpr char kDefaultKeyName[] = "default";
inline constexpr size_t kMinApiKeyLength = 16;
inline constexpr size_t kMaxApiKeyLength = 4096;

// 1-64 characters of [A-Za-z0-9_.-].
bool valid_key_name(std::string_view name);

// Parses a key file's text; `source` names it in the messages ("FILE:LINE: ...").
Result<std::vector<ApiKey>> parse_api_keys(std::string_view text, std::string_view source);
// Reads and parses FILE. Errors: it cannot be read, or parse_api_keys's.
Result<std::vector<ApiKey>> read_api_key_file(const std::string& path);

// The key that `given` (the token after "Bearer ") is, or null. Compares against every key in
// time that depends on the lengths only, never on where the bytes first differ.
const ApiKey* match_api_key(const std::vector<ApiKey>& keys, std::string_view given);

// The id under which a session of key `key_name` is kept, in memory and in its file's name:
// `id` itself for the default namespace (no key, or the key named `default`), else
// `<key_name>@<id>`. '@' is in neither alphabet, so two names never share a scoped id, and no
// id of the default namespace looks like another name's.
std::string scoped_session_id(std::string_view key_name, std::string_view id);
// True for what scoped_session_id makes of a valid name and id (a valid id, or `name@id` with a
// valid name other than `default`).
bool valid_scoped_session_id(std::string_view scoped);

}  // namespace d2o::serve
