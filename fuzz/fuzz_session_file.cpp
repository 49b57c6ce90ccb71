// Fuzz target: session files of `d2o serve --session-dir` (serve::decode_session), read from a
// directory that outlives the process.
//
// The input is a file. It is decoded as is, and again with its trailing checksum recomputed so
// that the checks behind the checksum are reached. A file that decodes must encode back to the
// same bytes (a file written under d2o's earlier defaults or in an older version of the format,
// as the checked-in seeds of version 1 are: to bytes that do so from then on), and
// its conversation must go on: one more token through its policy's compaction,
// as the server's next turn would do (fuzz_session.h's model-free pass).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "fuzz_session.h"

namespace {

void check(const uint8_t* data, size_t size) {
  using namespace d2o;
  static const serve::SessionFileContext ctx = fuzz::session_context();
  auto d = serve::decode_session(ctx, data, size);
  if (!d.ok()) return;
  std::string again;
  const Status s = serve::encode_session(ctx, d->id, d->kv_spec, d->tokens, d->n_past, *d->cache,
                                         d->state, again);
  if (!s.ok()) std::abort();
  if (again.size() != size || std::memcmp(again.data(), data, size) != 0) {
    // A file written under the old key names, or while d2o's defaults were the paper's, is read
    // with today's spelling of its spec (recorded_spec_today), and one of an older version is
    // written in today's: it encodes to a file that decodes to the same session and encodes
    // back to itself.
    auto d2 =
        serve::decode_session(ctx, reinterpret_cast<const uint8_t*>(again.data()), again.size());
    std::string third;
    if (!d2.ok() || d2->kv_spec != d->kv_spec || d2->n_past != d->n_past ||
        d2->tokens != d->tokens ||
        !serve::encode_session(ctx, d2->id, d2->kv_spec, d2->tokens, d2->n_past, *d2->cache,
                               d2->state, third)
             .ok() ||
        third != again) {
      std::fprintf(stderr, "a decoded session file does not encode back to the same bytes\n");
      std::abort();
    }
  }
  auto policy = parse_kv_policy(d->kv_spec);
  if (!policy.ok()) std::abort();  // decode_session checked it
  int64_t n_past = d->n_past;
  if (n_past < ctx.max_positions)
    (void)fuzz::feed_token(**policy, *d->cache, d->state, n_past, 0.5f);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  check(data, size);
  if (size >= 8) {
    std::string b(reinterpret_cast<const char*>(data), size);
    const uint64_t sum = d2o::serve::fnv1a64(data, size - 8);
    std::memcpy(b.data() + size - 8, &sum, 8);
    check(reinterpret_cast<const uint8_t*>(b.data()), size);
  }
  return 0;
}
