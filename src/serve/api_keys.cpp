#include "serve/api_keys.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>

#include "serve/api.h"

namespace d2o::serve {

namespace {

constexpr size_t kMaxKeyFileBytes = size_t{1} << 20;

bool is_blank(char c) {
  return c == ' ' || c == '\t' || c == '\r';
}

std::string_view trim_key_text(std::string_view s) {
  while (!s.empty() && is_blank(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_blank(s.back())) s.remove_suffix(1);
  return s;
}

// 0 when `given` equals `key`. The loop runs over every byte of `given` whatever they hold, and
// the accumulator is volatile so that the compiler cannot end it at the first difference: the
// time depends on the two lengths only.
unsigned key_difference(std::string_view given, std::string_view key) {
  const size_t n = key.size();
  if (n == 0) return 1;
  volatile unsigned d = given.size() == n ? 0u : 1u;
  for (size_t i = 0, j = 0; i < given.size(); ++i) {
    d = d | (static_cast<unsigned char>(given[i]) ^ static_cast<unsigned char>(key[j]));
    j = j + 1 == n ? 0 : j + 1;
  }
  return d;
}

}  // namespace

bool valid_key_name(std::string_view name) {
  if (name.empty() || name.size() > 64) return false;
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '.' || c == '-';
    if (!ok) return false;
  }
  return true;
}

Result<std::vector<ApiKey>> parse_api_keys(std::string_view text, std::string_view source) {
  std::vector<ApiKey> keys;
  std::map<std::string, size_t, std::less<>> name_line, key_line;
  std::map<std::string, std::string, std::less<>> key_owner;
  size_t line_no = 0;
  while (!text.empty()) {
    ++line_no;
    const size_t eol = text.find('\n');
    std::string_view line = text.substr(0, eol);
    text.remove_prefix(eol == std::string_view::npos ? text.size() : eol + 1);
    line = trim_key_text(line);
    if (line.empty() || line.front() == '#') continue;
    const std::string at = std::string(source) + ":" + std::to_string(line_no) + ": ";
    const size_t colon = line.find(':');
    if (colon == std::string_view::npos) {
      return invalid_argument(at + "expected 'name:key' (no ':' on the line)");
    }
    const std::string_view name = trim_key_text(line.substr(0, colon));
    const std::string_view key = trim_key_text(line.substr(colon + 1));
    // The text before ':' is not quoted: a line written the wrong way round would print its key.
    if (!valid_key_name(name)) {
      return invalid_argument(at +
                              "the name before ':' must be 1-64 characters of letters, "
                              "digits, '_', '.' or '-'");
    }
    const std::string who = "the key of '" + std::string(name) + "'";
    if (key.size() < kMinApiKeyLength) {
      return invalid_argument(at + who + " has " + std::to_string(key.size()) +
                              " characters; a key needs at least " +
                              std::to_string(kMinApiKeyLength));
    }
    if (key.size() > kMaxApiKeyLength) {
      return invalid_argument(at + who + " is longer than " + std::to_string(kMaxApiKeyLength) +
                              " characters");
    }
    for (char c : key) {
      if (c < 0x21 || c > 0x7e) {
        return invalid_argument(at + who +
                                " holds a blank or a character that is not printable ASCII");
      }
    }
    if (auto it = name_line.find(name); it != name_line.end()) {
      return invalid_argument(at + "the name '" + std::string(name) + "' is already on line " +
                              std::to_string(it->second));
    }
    if (auto it = key_line.find(key); it != key_line.end()) {
      return invalid_argument(at + who + " is also the key of '" + key_owner[std::string(key)] +
                              "' (line " + std::to_string(it->second) + ")");
    }
    name_line.emplace(std::string(name), line_no);
    key_line.emplace(std::string(key), line_no);
    key_owner.emplace(std::string(key), std::string(name));
    keys.push_back(ApiKey{std::string(name), std::string(key)});
  }
  if (keys.empty()) return invalid_argument(std::string(source) + ": no 'name:key' line");
  return keys;
}

Result<std::vector<ApiKey>> read_api_key_file(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return io_error(path + ": cannot read it: " + std::strerror(errno));
  std::string text;
  char buf[4096];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0 && text.size() <= kMaxKeyFileBytes) {
    text.append(buf, n);
  }
  const bool failed = std::ferror(f) != 0;
  const int err = errno;
  std::fclose(f);
  if (failed) return io_error(path + ": cannot read it: " + std::strerror(err));
  if (text.size() > kMaxKeyFileBytes) {
    return invalid_argument(path + ": larger than " + std::to_string(kMaxKeyFileBytes) +
                            " bytes: not a key file");
  }
  return parse_api_keys(text, path);
}

const ApiKey* match_api_key(const std::vector<ApiKey>& keys, std::string_view given) {
  const ApiKey* found = nullptr;
  for (const ApiKey& k : keys) {  // every key, also after a match
    const bool same = key_difference(given, k.key) == 0;
    found = same ? &k : found;
  }
  return found;
}

std::string scoped_session_id(std::string_view key_name, std::string_view id) {
  if (key_name.empty() || key_name == kDefaultKeyName) return std::string(id);
  std::string s;
  s.reserve(key_name.size() + 1 + id.size());
  s.append(key_name).append("@").append(id);
  return s;
}

bool valid_scoped_session_id(std::string_view scoped) {
  const size_t at = scoped.find('@');
  if (at == std::string_view::npos) return valid_session_id(scoped);
  const std::string_view name = scoped.substr(0, at);
  return valid_key_name(name) && name != kDefaultKeyName && valid_session_id(scoped.substr(at + 1));
}

}  // namespace d2o::serve
