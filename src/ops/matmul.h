// Weight matrices held for compute (QMatrix) and the product y = x W^T (matmul).
//
// Q4_0, Q4_1, Q5_0, Q8_0, Q2_K .. Q6_K, IQ4_NL and IQ4_XS weights are repacked at load time
// (src/ops/matmul_pack.h) and multiplied with integer dot products: each token's activations are
// quantised to 8 bits exactly as llama.cpp does it (Q8_0 / Q8_1 blocks of 32 with fp16 scales;
// Q8_K blocks of 256 for the K formats and IQ4_XS; see matmul_kernels.h), and the kernels use
// AVX-512 VNNI (vpdpbusd) or AVX2 (vpmaddubsw) on a 16-row x up-to-4-token micro-tile that
// reuses each weight block for several tokens. BF16 weights (rows of even length) are repacked
// too and multiplied by activations rounded to bf16, with fp32 multiply-adds in a fixed order.
// Every other supported type (F32, F16, Q5_1) is kept as GGUF rows and multiplied by
// dequantising 4 rows at a time to fp32 and using fp32 dot products.
//
// Numerics: the integer kernels of all levels (scalar, AVX2, AVX-512) perform the same integer
// sums and the same float operations in the same order, so they agree bit for bit; results do
// not depend on the thread count or on how tokens are grouped. They equal llama.cpp's
// ggml_mul_mat up to float summation order (tests/unit/test_matmul.cpp checks fixtures made with
// ggml); against the exact product (matmul_ref) the error is that of the 8-bit activations.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>

#include "core/mem.h"
#include "core/thread_pool.h"
#include "d2o/status.h"
#include "ops/ggml_type.h"
#include "ops/kernel_isa.h"
#include "ops/matmul_pack.h"

namespace d2o {

// A weight matrix [n_rows, n_cols] (GGUF dims: ne0 = n_cols contiguous, ne1 = n_rows) held in
// process memory (never a pointer into a file mapping), possibly repacked for the kernels.
class QMatrix {
 public:
  QMatrix() = default;
  QMatrix(QMatrix&&) noexcept = default;
  QMatrix& operator=(QMatrix&&) noexcept = default;

  // Copies (and may repack) rows from GGUF-layout bytes; errors for unsupported types or
  // n_cols not a multiple of the block size, or src_bytes not the matrix's exact size.
  static Result<QMatrix> from_gguf_bytes(GgmlType type, int64_t n_rows, int64_t n_cols,
                                         const uint8_t* src, size_t src_bytes);
  // Fills dst with bytes [offset, offset + n) of the matrix's GGUF-layout data (whole rows).
  using RowReader = std::function<Status(uint64_t offset, uint64_t n, uint8_t* dst)>;
  // The same matrix, its rows read `slice_rows` at a time: a repacked matrix then holds one
  // slice of file bytes beside itself while it loads, not a second copy of the whole matrix (a
  // model's largest tensor, Gemma 3's 170 MiB embedding table, would double the load's peak).
  // Errors: as from_gguf_bytes, and the reader's.
  static Result<QMatrix> from_gguf_rows(GgmlType type, int64_t n_rows, int64_t n_cols,
                                        int64_t slice_rows, const RowReader& read);

  GgmlType type() const { return type_; }
  int64_t n_rows() const { return n_rows_; }
  int64_t n_cols() const { return n_cols_; }
  size_t bytes() const { return data_.bytes(); }  // memory held
  // Dequantised row (embedding lookup); bit-identical to dequantize_row of the GGUF row.
  void get_row(int64_t row, float* dst) const;
  // True when the integer kernels apply (the weights are in a packed layout).
  bool packed() const { return layout_.kind != mm::PackKind::kRaw; }

  // For the kernels.
  const mm::PackedLayout& layout() const { return layout_; }
  const uint8_t* data() const { return data_.data(); }
  int64_t raw_row_bytes() const { return raw_row_bytes_; }  // GGUF bytes per row

 private:
  GgmlType type_ = GgmlType::kF32;
  int64_t n_rows_ = 0;
  int64_t n_cols_ = 0;
  int64_t raw_row_bytes_ = 0;
  mm::PackedLayout layout_;
  AlignedBuffer<uint8_t> data_;
};

// y[t * n_rows + r] = sum_c W[r, c] * x[t * n_cols + c], for t in [0, n_tok).
// Multi-threaded over rows (and tokens for large n_tok), no allocation in steady state
// (per-thread scratch may grow once), deterministic for any thread count. x and y must not
// overlap. The kernel level is best_kernel_isa() (D2O_FORCE_SCALAR=1 selects scalar code).
void matmul(const QMatrix& w, const float* x, int64_t n_tok, float* y, ThreadPool& pool);
// The same at a given (available) kernel level; for tests and benchmarks.
void matmul_isa(const QMatrix& w, const float* x, int64_t n_tok, float* y, ThreadPool& pool,
                KernelIsa isa);
// Several independent products with the same token count, run in one parallel region: e.g. the
// Q, K and V projections of a layer, or its gate and up projections. This saves the pool's
// per-call synchronisation (a few microseconds each, a visible share of a decode step), and calls
// that share an x pointer quantise it once. Results are identical to separate matmul() calls.
// At most 16 calls; the y arrays must not overlap each other or any x.
struct MatmulCall {
  const QMatrix* w = nullptr;
  const float* x = nullptr;  // [n_tok, w->n_cols()]
  float* y = nullptr;        // [n_tok, w->n_rows()]
};
void matmul_many(std::span<const MatmulCall> calls, int64_t n_tok, ThreadPool& pool);
void matmul_many_isa(std::span<const MatmulCall> calls, int64_t n_tok, ThreadPool& pool,
                     KernelIsa isa);

// Scalar reference: dequantise each row to fp32 and accumulate in double. For tests.
void matmul_ref(const QMatrix& w, const float* x, int64_t n_tok, float* y);

}  // namespace d2o
