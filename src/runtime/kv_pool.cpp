#include "runtime/kv_pool.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "core/assert.h"
#include "core/mem.h"

namespace d2o {

bool KvMemoryPool::try_reserve(size_t bytes) {
  if (bytes > cap_ - reserved_) return false;
  reserved_ += bytes;
  peak_reserved_ = std::max(peak_reserved_, reserved_);
  return true;
}

void KvMemoryPool::release(size_t bytes) {
  D2O_ASSERT(bytes <= reserved_);
  reserved_ -= bytes;
}

Status AdmissionQueue::push(uint64_t id, size_t bytes, size_t held) {
  D2O_ASSERT(held <= bytes);
  if (bytes > pool_.cap()) {
    return resource_exhausted(
        "needs " + format_bytes(static_cast<double>(bytes)) +
        " of KV memory at its peak, more than the whole cap of " +
        format_bytes(static_cast<double>(pool_.cap())) +
        "; it can never run (raise --kv-mem, or shorten the request, or use a "
        "compressing KV policy)");
  }
  waiting_.push_back({id, bytes, held});
  return {};
}

void AdmissionQueue::admit(int max_admit, std::vector<uint64_t>& out) {
  int n = 0;
  while (!waiting_.empty() && n < max_admit &&
         pool_.try_reserve(waiting_.front().bytes - waiting_.front().held)) {
    admitted_.push_back(waiting_.front());
    out.push_back(waiting_.front().id);
    waiting_.pop_front();
    ++n;
  }
}

bool AdmissionQueue::admit_first_fitting(std::vector<uint64_t>& out) {
  for (auto it = waiting_.begin(); it != waiting_.end(); ++it) {
    if (!pool_.try_reserve(it->bytes - it->held)) continue;
    admitted_.push_back(*it);
    out.push_back(it->id);
    waiting_.erase(it);
    return true;
  }
  return false;
}

void AdmissionQueue::give_back(uint64_t id, size_t bytes) {
  auto it =
      std::find_if(waiting_.begin(), waiting_.end(), [&](const Entry& e) { return e.id == id; });
  D2O_ASSERT(it != waiting_.end() && bytes <= it->held);
  it->held -= bytes;
  pool_.release(bytes);
}

std::vector<uint64_t> AdmissionQueue::waiting_ids() const {
  std::vector<uint64_t> ids;
  ids.reserve(waiting_.size());
  for (const Entry& e : waiting_) ids.push_back(e.id);
  return ids;
}

void AdmissionQueue::release(uint64_t id) {
  auto it =
      std::find_if(admitted_.begin(), admitted_.end(), [&](const Entry& e) { return e.id == id; });
  D2O_ASSERT(it != admitted_.end());
  pool_.release(it->bytes);
  admitted_.erase(it);
}

bool AdmissionQueue::remove(uint64_t id) {
  auto it =
      std::find_if(waiting_.begin(), waiting_.end(), [&](const Entry& e) { return e.id == id; });
  if (it == waiting_.end()) return false;
  if (it->held > 0) pool_.release(it->held);
  waiting_.erase(it);
  return true;
}

size_t AdmissionQueue::reserved_for(uint64_t id) const {
  for (const Entry& e : admitted_) {
    if (e.id == id) return e.bytes;
  }
  return 0;
}

Result<size_t> parse_byte_size(std::string_view text) {
  const std::string s(text);
  const std::string what = "'" + s + "' is not a byte size (examples: 512M, 2G, 1048576)";
  if (s.empty()) return invalid_argument("empty byte size (examples: 512M, 2G, 1048576)");
  size_t i = 0;
  while (i < s.size() && (std::isdigit(static_cast<unsigned char>(s[i])) || s[i] == '.')) ++i;
  if (i == 0) return invalid_argument(what);
  const std::string num = s.substr(0, i);
  if (std::count(num.begin(), num.end(), '.') > 1) return invalid_argument(what);
  std::string unit = s.substr(i);
  for (char& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  double mult = 1;
  if (!unit.empty() && unit != "B") {
    const char* units = "KMGT";
    const char* p = std::strchr(units, unit[0]);
    if (!p) return invalid_argument(what);
    mult = std::pow(1024.0, static_cast<double>(p - units + 1));
    const std::string tail = unit.substr(1);
    if (!tail.empty() && tail != "B" && tail != "IB") return invalid_argument(what);
  }
  const double v = std::strtod(num.c_str(), nullptr) * mult;
  if (!(v >= 1.0)) return invalid_argument("byte size '" + s + "' must be at least 1 byte");
  if (v > std::ldexp(1.0, 60)) return invalid_argument("byte size '" + s + "' is too large");
  return static_cast<size_t>(v);
}

}  // namespace d2o
