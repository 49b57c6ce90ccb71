// A kept conversation as bytes (`d2o serve --session-dir`): everything a sequence needs to go on
// exactly where it stopped, so that the turn after a restart gives the answer it would have
// given without one.
//
// Layout (little-endian, no padding):
//   magic "D2OSESS\0", u32 version, u32 flags (below)
//   model: u64 GGUF file size, u64 hash of the GGUF bytes before the tensor data
//   cache: u32 n_layer, n_head_kv, head_dim; u8 key type, value type, rot_k, rot_v
//   u32 + bytes: session id as kept (scoped_session_id: `name@id`, or the id alone in the
//     default namespace); u32 + bytes: canonical KV policy spec
//   i64 n_past; u32 n; i32 tokens[n] (the history, n == n_past)
//   policy state: u8 budgets_set, u8 has_ext; u32 n + i32 budgets[n]; u32 n + i64 evicted[n];
//     u32 n + i64 merged[n]; i64 n_compactions; i64 pos_shift;
//     has_ext: u32 n + f32 tau[n] + u8 tau_ready[n]; u32 n + f64 layer_variance[n];
//       version 2 on: u32 n + i32 pressure_floor[n] (the budgets compression under memory
//       pressure stops at, ComposedPolicyState::pressure_floor; n == 0 before its first step),
//       i64 prompt_end (ComposedPolicyState::prompt_end)
//   per layer: u32 n_slot; key rows [n_head_kv][n_slot], value rows [n_head_kv][n_slot],
//     i32 pos, f32 score, f32 window, i32 merged, each [n_head_kv][n_slot]
//   flags & 1: the cold tier (per layer and KV head: u32 n, i32 pos[n], f32 score[n],
//     i32 merged[n], key rows, value rows)
//   flags & 2 (a model with recurrent layers): i64 tokens the state holds (== n_past); per
//     recurrent layer f32 conv[(d_conv - 1) * conv_dim], f32 delta[n_v_head * head_dim^2]
//   u64 checksum of every byte before it (fnv1a64 below)
//
// Version 1 files (written before the pressure floor was kept) read as they always did: their
// sequence has no floor yet, and its next compression step takes the budgets it holds as one
// (a session compressed under pressure before it was written goes no lower than that).
//
// Reading is reading outside input: decode_session() checks every field (magic, version, model,
// cache layout, counts against the context, token ids, positions ascending and in range, finite
// floats, the policy state's shapes, the checksum, the exact length) and answers an error naming
// the problem; it never trusts a count before checking it against the bytes that remain.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "d2o/status.h"
#include "kv/kv_cache.h"
#include "kv/policy.h"
#include "runtime/tokenizer.h"

namespace d2o::serve {

inline constexpr uint32_t kSessionFileVersion = 2;
// The oldest version decode_session() reads.
inline constexpr uint32_t kSessionFileOldestVersion = 1;
inline constexpr char kSessionFileSuffix[] = ".d2os";

// Which model a file was written for: a file of another model (or another quantisation of it)
// is refused. The hash covers the GGUF header, metadata and tensor table, not the weights.
struct ModelIdentity {
  uint64_t file_size = 0;
  uint64_t header_hash = 0;
  bool operator==(const ModelIdentity&) const = default;
};
Result<ModelIdentity> model_identity(const std::string& gguf_path);

// What a file must agree with, and the limits it is read under.
struct SessionFileContext {
  ModelIdentity model;
  KvCacheConfig cache;        // the server's cache layout and storage type
  int32_t n_vocab = 0;        // token ids must be below it
  int64_t max_positions = 0;  // the context: no conversation is longer
};

// The largest well-formed file for a context (what a reader allocates at most).
size_t max_session_file_bytes(const SessionFileContext& ctx);

// A decoded session: what Sequence holds (cache, policy state, position) and the conversation.
struct SessionData {
  std::string id;
  std::string kv_spec;  // canonical
  std::vector<TokenId> tokens;
  int64_t n_past = 0;
  std::optional<KvCache> cache;
  PolicyState state;
};

// The file's bytes, into `out` (replaced; its capacity is reused, so a caller writing many
// sessions does not fault in fresh pages each time). Errors: a policy state of a kind this
// format does not know, a cache of another layout than ctx's.
Status encode_session(const SessionFileContext& ctx, const std::string& id,
                      const std::string& kv_spec, const std::vector<TokenId>& tokens,
                      int64_t n_past, const KvCache& cache, const PolicyState& state,
                      std::string& out);

// Reads bytes written by encode_session. Errors (format_error, or invalid_argument when the file
// is well formed but for another model / cache layout / a longer context) say what is wrong.
Result<SessionData> decode_session(const SessionFileContext& ctx, const uint8_t* data,
                                   size_t size);

// FNV-1a 64 over little-endian 64-bit words, then the remaining bytes one by one (the file's
// checksum and the model header's hash).
uint64_t fnv1a64(const uint8_t* data, size_t size, uint64_t h = 0xcbf29ce484222325ull);

}  // namespace d2o::serve
