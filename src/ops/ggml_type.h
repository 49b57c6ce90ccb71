// Tensor element types as numbered in the GGUF file format, with their block geometry.
//
// Quantised types store `block_size` elements in `type_size` bytes; a row's element count must
// be a multiple of the block size. The numbering is the file format's and must not change.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace d2o {

enum class GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ8_1 = 9,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kQ8_K = 15,
  kIQ2_XXS = 16,
  kIQ2_XS = 17,
  kIQ3_XXS = 18,
  kIQ1_S = 19,
  kIQ4_NL = 20,
  kIQ3_S = 21,
  kIQ2_S = 22,
  kIQ4_XS = 23,
  kI8 = 24,
  kI16 = 25,
  kI32 = 26,
  kI64 = 27,
  kF64 = 28,
  kIQ1_M = 29,
  kBF16 = 30,
  kTQ1_0 = 34,
  kTQ2_0 = 35,
  kMXFP4 = 39,
};

struct GgmlTypeTraits {
  const char* name;
  int64_t block_size;  // elements per block
  int64_t type_size;   // bytes per block
};

// Traits of a known type number, or nullopt for a number this build does not know.
std::optional<GgmlTypeTraits> ggml_type_traits(uint32_t type);
// "Q4_1", or "type#N" for an unknown number.
std::string ggml_type_name(uint32_t type);
inline std::string ggml_type_name(GgmlType type) {
  return ggml_type_name(static_cast<uint32_t>(type));
}

// Bytes of a row of n elements (n must be a multiple of the block size).
int64_t ggml_row_bytes(GgmlType type, int64_t n);
int64_t ggml_block_size(GgmlType type);

// Which types d2o can compute with: dequantize_supported() in ops/quant.h.

}  // namespace d2o
