// Rotated KV storage (KvType::rot_k / rot_v, "--kv-type q4_0r"): rows are stored multiplied by a
// normalised Walsh-Hadamard matrix (ops/hadamard.h) over blocks of the head, so that a channel
// much larger than the others (common in keys) is spread over its block instead of setting the
// quantisation scale of its whole 32-element block alone.
//
// The model applies it (model/kv_attention.cpp): keys and queries (after RoPE) by the same
// rotation R_k, so q.k = (R q).(R k) is unchanged; values by R_v before they are stored, and the
// attention output by R_v again (R_v is its own inverse), since the output is a weighted sum of
// value rows. Attention weights, scores and statistics are therefore those of plain storage up to
// rounding. Policies see rotated rows: dot products, norms and cosine similarities are invariant
// and merges are weighted sums (linear), so they work unchanged; applying RoPE to a stored key
// (StreamingLLM's positions=shifted, D2O's merge_keys=unrotated) does not commute with the rotation
// and is refused.
//
// Block sizes: keys use the largest power of two dividing the head size (64 for 64, 128 for 128,
// 256 for 256), values 64, as llama.cpp does for its quantised caches; the head size must be a
// multiple of 64 (check_kv_type).
#pragma once

namespace d2o {

inline constexpr int kKvRotBlock = 64;  // the smallest block, and the value block

// The key block of a head of `head_dim` elements (a multiple of kKvRotBlock).
inline int kv_rot_block_k(int head_dim) {
  int n = kKvRotBlock;
  while (head_dim % (2 * n) == 0) n *= 2;
  return n;
}
inline int kv_rot_block_v(int /*head_dim*/) { return kKvRotBlock; }

}  // namespace d2o
