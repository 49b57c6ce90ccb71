// QMatrix (loading and repacking weights) and the matmul driver: activation quantisation,
// splitting the product into tasks for the thread pool, and the exact reference.
#include "ops/matmul.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "core/assert.h"
#include "ops/matmul_kernels.h"
#include "ops/quant.h"

namespace d2o {

namespace {

constexpr int64_t align64(int64_t v) {
  return (v + 63) / 64 * 64;
}

// Tokens per task for long prompts: 64 tokens' activations (~40 KiB for 576 columns) stay in
// L2 while a few tiles of weights sweep over them.
constexpr int64_t kTokenChunk = 64;
// Tiles per task once there are several token groups: 64 rows of weights (23 KiB for a 576-column
// Q4_1 matrix) stay in L1 while every token group of the task passes over them.
constexpr int64_t kPrefillTileChunk = 4;
// Below this many activation values, quantising on the calling thread beats waking the pool.
constexpr int64_t kParallelQuantizeMin = 1 << 14;

const mm::KernelTable& table_for(KernelIsa isa) {
  D2O_ASSERT(kernel_isa_available(isa));
  switch (isa) {
    case KernelIsa::kAvx512:
      return mm::kernels_avx512();
    case KernelIsa::kAvx2:
      return mm::kernels_avx2();
    case KernelIsa::kScalar:
      break;
  }
  return mm::kernels_scalar();
}

// Per-thread scratch that only ever grows (no allocation once warmed up).
uint8_t* act_scratch(size_t bytes) {
  thread_local AlignedBuffer<uint8_t> buf;
  if (buf.size() < bytes) buf.resize(bytes);
  return buf.data();
}
float* row_scratch(size_t floats) {
  thread_local AlignedBuffer<float> buf;
  if (buf.size() < floats) buf.resize(floats);
  return buf.data();
}

// How the [tiles x tokens] grid is cut into tasks. Results do not depend on it: every (row,
// token) output is computed by the same sequence of operations whatever the grouping.
struct Split {
  int64_t tok_chunk, n_tok_chunks, unit_chunk, n_unit_chunks;
};
Split make_split(int64_t n_units, int64_t n_tok, int n_threads) {
  Split s;
  s.tok_chunk = std::min(n_tok, kTokenChunk);
  s.n_tok_chunks = (n_tok + s.tok_chunk - 1) / s.tok_chunk;
  // About 8 tasks per thread balance well without making per-task overhead visible.
  const int64_t target = 8 * static_cast<int64_t>(n_threads);
  s.unit_chunk = std::max<int64_t>(1, (n_units * s.n_tok_chunks + target - 1) / target);
  if (n_tok > mm::kMaxTokens) s.unit_chunk = std::min(s.unit_chunk, kPrefillTileChunk);
  if (n_threads == 1) s.unit_chunk = n_tok > mm::kMaxTokens ? kPrefillTileChunk : n_units;
  s.n_unit_chunks = (n_units + s.unit_chunk - 1) / s.unit_chunk;
  return s;
}

void packed_matmul(const QMatrix& w, const float* x, int64_t n_tok, float* y, ThreadPool& pool,
                   const mm::KernelTable& k) {
  const mm::PackedLayout& pl = w.layout();
  const mm::ActLayout al = mm::make_act_layout(mm::act_format_for(pl.kind), w.n_cols());
  uint8_t* acts = act_scratch(static_cast<size_t>(n_tok * al.stride));
  const mm::QuantizeFn quantize = k.quantize[static_cast<int>(al.format)];
  const int64_t n_cols = w.n_cols();
  if (n_tok * n_cols < kParallelQuantizeMin) {
    for (int64_t t = 0; t < n_tok; ++t) quantize(al, x + t * n_cols, acts + t * al.stride);
  } else {
    pool.parallel_for(n_tok, 4, [&](int64_t t0, int64_t t1, int) {
      for (int64_t t = t0; t < t1; ++t) quantize(al, x + t * n_cols, acts + t * al.stride);
    });
  }

  const mm::TileFn fn = k.tile[static_cast<int>(pl.kind)];
  const int64_t n_rows = w.n_rows();
  const Split s = make_split(pl.n_tiles, n_tok, pool.n_threads());
  pool.run(s.n_tok_chunks * s.n_unit_chunks, [&](int64_t task, int) {
    const int64_t tile0 = (task % s.n_unit_chunks) * s.unit_chunk;
    const int64_t tile1 = std::min(pl.n_tiles, tile0 + s.unit_chunk);
    const int64_t tok0 = (task / s.n_unit_chunks) * s.tok_chunk;
    const int64_t tok1 = std::min(n_tok, tok0 + s.tok_chunk);
    mm::TileJob job;
    job.w = &pl;
    job.acts = &al;
    job.y_stride = n_rows;
    for (int64_t t = tok0; t < tok1; t += mm::kMaxTokens) {
      job.nt = static_cast<int>(std::min<int64_t>(mm::kMaxTokens, tok1 - t));
      job.act = acts + t * al.stride;
      for (int64_t tile = tile0; tile < tile1; ++tile) {
        job.tile = w.data() + tile * pl.tile_bytes;
        job.rows =
            static_cast<int>(std::min<int64_t>(mm::kTileRows, n_rows - tile * mm::kTileRows));
        job.y = y + t * n_rows + tile * mm::kTileRows;
        fn(job);
      }
    }
  });
}

void f32_matmul(const QMatrix& w, const float* x, int64_t n_tok, float* y, ThreadPool& pool,
                KernelIsa isa, const mm::KernelTable& k) {
  constexpr int64_t kGroupRows = 4;
  const int64_t n_rows = w.n_rows(), n_cols = w.n_cols();
  const int64_t n_groups = (n_rows + kGroupRows - 1) / kGroupRows;
  const Split s = make_split(n_groups, n_tok, pool.n_threads());
  const bool direct = w.type() == GgmlType::kF32;
  pool.run(s.n_tok_chunks * s.n_unit_chunks, [&](int64_t task, int) {
    const int64_t g0 = (task % s.n_unit_chunks) * s.unit_chunk;
    const int64_t g1 = std::min(n_groups, g0 + s.unit_chunk);
    const int64_t tok0 = (task / s.n_unit_chunks) * s.tok_chunk;
    const int64_t tok1 = std::min(n_tok, tok0 + s.tok_chunk);
    float* buf = direct ? nullptr : row_scratch(static_cast<size_t>(kGroupRows * n_cols));
    mm::F32Job job;
    job.x_stride = n_cols;
    job.n = n_cols;
    job.y_stride = n_rows;
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t r0 = g * kGroupRows;
      job.nr = static_cast<int>(std::min(kGroupRows, n_rows - r0));
      for (int i = 0; i < job.nr; ++i) {
        const uint8_t* src = w.data() + (r0 + i) * w.raw_row_bytes();
        if (direct) {
          job.rows[i] = reinterpret_cast<const float*>(src);
        } else {
          dequantize_row_isa(isa, w.type(), src, buf + i * n_cols, n_cols);
          job.rows[i] = buf + i * n_cols;
        }
      }
      for (int64_t t = tok0; t < tok1; t += mm::kMaxTokens) {
        job.nt = static_cast<int>(std::min<int64_t>(mm::kMaxTokens, tok1 - t));
        job.x = x + t * n_cols;
        job.y = y + t * n_rows + r0;
        k.f32(job);
      }
    }
  });
}

}  // namespace

namespace mm {

ActFormat act_format_for(PackKind kind) {
  switch (kind) {
    case PackKind::kQ4_K:
    case PackKind::kQ5_K:
    case PackKind::kQ6_K:
      return ActFormat::kQ8x256;
    default:
      return ActFormat::kQ8x32;
  }
}

ActLayout make_act_layout(ActFormat format, int64_t n_cols) {
  ActLayout l;
  l.format = format;
  l.n_cols = n_cols;
  l.block = format == ActFormat::kQ8x32 ? 32 : 256;
  D2O_ASSERT(n_cols % l.block == 0);
  l.off_d = align64(n_cols);
  l.off_a = align64(l.off_d + 4 * (n_cols / l.block));
  if (format == ActFormat::kQ8x32) {
    l.off_b = align64(l.off_a + 4 * (n_cols / 32));
    l.stride = align64(l.off_b + 4 * (n_cols / 32));
  } else {
    l.off_b = align64(l.off_a + 2 * (n_cols / 32));
    l.stride = align64(l.off_b + 2 * (n_cols / 16));
  }
  return l;
}

}  // namespace mm

Result<QMatrix> QMatrix::from_gguf_bytes(GgmlType type, int64_t n_rows, int64_t n_cols,
                                         const uint8_t* src, size_t src_bytes) {
  const std::string what = ggml_type_name(type) + " matrix [" + std::to_string(n_rows) + ", " +
                           std::to_string(n_cols) + "]";
  if (!ggml_type_traits(static_cast<uint32_t>(type)) || !dequantize_supported(type)) {
    return unsupported(what + ": tensor type " + ggml_type_name(type) +
                       " is not supported for compute (supported: F32, F16, BF16, Q4_0, Q4_1, "
                       "Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)");
  }
  constexpr int64_t kMaxDim = int64_t{1} << 40;
  if (n_rows <= 0 || n_cols <= 0 || n_rows > kMaxDim || n_cols > kMaxDim) {
    return invalid_argument(what + ": dimensions must be positive (and below 2^40)");
  }
  const int64_t bs = ggml_block_size(type);
  if (n_cols % bs != 0) {
    return invalid_argument(what + ": the row length " + std::to_string(n_cols) +
                            " is not a multiple of the block size " + std::to_string(bs));
  }
  const int64_t row_bytes = ggml_row_bytes(type, n_cols);
  int64_t total = 0;
  if (__builtin_mul_overflow(row_bytes, n_rows, &total)) {
    return invalid_argument(what + ": size overflows");
  }
  if (src_bytes != static_cast<uint64_t>(total)) {
    return invalid_argument(what + ": expected " + std::to_string(total) + " bytes of data, got " +
                            std::to_string(src_bytes));
  }
  if (src == nullptr) return invalid_argument(what + ": no data");

  QMatrix m;
  m.type_ = type;
  m.n_rows_ = n_rows;
  m.n_cols_ = n_cols;
  m.raw_row_bytes_ = row_bytes;
  m.layout_ = mm::make_packed_layout(type, n_rows, n_cols);
  if (!m.packed()) {
    m.data_.resize(static_cast<size_t>(total));
    std::memcpy(m.data_.data(), src, static_cast<size_t>(total));
    return m;
  }
  const mm::PackedLayout& l = m.layout_;
  m.data_.resize(static_cast<size_t>(l.n_tiles * l.tile_bytes));
  m.data_.zero();  // padding rows and alignment gaps: zero scales contribute nothing
  const int64_t block_bytes = row_bytes / l.n_blocks;
  for (int64_t row = 0; row < n_rows; ++row) {
    uint8_t* tile = m.data_.data() + (row / mm::kTileRows) * l.tile_bytes;
    const int r = static_cast<int>(row % mm::kTileRows);
    for (int64_t b = 0; b < l.n_blocks; ++b) {
      mm::pack_block(l, src + row * row_bytes + b * block_bytes, tile, r, b);
    }
  }
  return m;
}

void QMatrix::get_row(int64_t row, float* dst) const {
  D2O_ASSERT(row >= 0 && row < n_rows_);
  if (!packed()) {
    dequantize_row(type_, data_.data() + row * raw_row_bytes_, dst, n_cols_);
    return;
  }
  const mm::PackedLayout& l = layout_;
  const uint8_t* tile = data_.data() + (row / mm::kTileRows) * l.tile_bytes;
  const int r = static_cast<int>(row % mm::kTileRows);
  alignas(64) uint8_t block[256];  // one GGUF block (at most 210 bytes)
  for (int64_t b = 0; b < l.n_blocks; ++b) {
    mm::unpack_block(l, tile, r, b, block);
    dequantize_row(type_, block, dst + b * l.block_elems, l.block_elems);
  }
}

void matmul_isa(const QMatrix& w, const float* x, int64_t n_tok, float* y, ThreadPool& pool,
                KernelIsa isa) {
  D2O_ASSERT(n_tok >= 0);
  if (n_tok == 0) return;
  D2O_ASSERT(w.n_rows() > 0 && x != nullptr && y != nullptr);
  const mm::KernelTable& k = table_for(isa);
  if (w.packed()) {
    packed_matmul(w, x, n_tok, y, pool, k);
  } else {
    f32_matmul(w, x, n_tok, y, pool, isa, k);
  }
}

void matmul(const QMatrix& w, const float* x, int64_t n_tok, float* y, ThreadPool& pool) {
  matmul_isa(w, x, n_tok, y, pool, best_kernel_isa());
}

void matmul_ref(const QMatrix& w, const float* x, int64_t n_tok, float* y) {
  const int64_t n_rows = w.n_rows(), n_cols = w.n_cols();
  AlignedBuffer<float> row(static_cast<size_t>(n_cols));
  for (int64_t r = 0; r < n_rows; ++r) {
    w.get_row(r, row.data());
    for (int64_t t = 0; t < n_tok; ++t) {
      const float* xt = x + t * n_cols;
      double s = 0.0;
      for (int64_t c = 0; c < n_cols; ++c) s += static_cast<double>(row[c]) * xt[c];
      y[t * n_rows + r] = static_cast<float>(s);
    }
  }
}

}  // namespace d2o
