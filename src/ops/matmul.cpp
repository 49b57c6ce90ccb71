// QMatrix (loading and repacking weights) and the matmul driver: activation quantisation,
// splitting the product into tasks for the thread pool, and the exact reference.
#include "ops/matmul.h"

#include <algorithm>
#if defined(__linux__)
#include <sys/mman.h>
#endif
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

// Decode streams all weights once per token: with 4 KiB pages a 30 MB matrix spans 7500 pages and
// TLB misses add to every DRAM access. Where transparent huge pages are opt-in ("madvise"), ask
// for them on the 2 MiB-aligned interior of large weight buffers (before the first touch).
void advise_huge_pages(void* data, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const uintptr_t b = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t e = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHuge - 1);
  if (e > b) madvise(reinterpret_cast<void*>(b), e - b, MADV_HUGEPAGE);  // a hint: errors ignored
#else
  (void)data;
  (void)bytes;
#endif
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

// One product ready to run: its activations quantised (integer kernels) and its grid of
// [row units x tokens] cut into tasks.
struct Prepared {
  const QMatrix* w = nullptr;
  const float* x = nullptr;
  float* y = nullptr;
  mm::ActLayout al;               // integer kernels only
  const uint8_t* acts = nullptr;  // quantised x, n_tok records of al.stride bytes
  int64_t n_units = 0;            // tiles of 16 rows, or groups of 4 rows (fp32 path)
  Split split;
  int64_t n_tasks = 0;
};

constexpr int64_t kGroupRows = 4;  // rows per fp32-path micro-tile

void run_packed_task(const Prepared& c, int64_t n_tok, int64_t task, const mm::KernelTable& k) {
  const QMatrix& w = *c.w;
  const mm::PackedLayout& pl = w.layout();
  const Split& s = c.split;
  const int64_t tile0 = (task % s.n_unit_chunks) * s.unit_chunk;
  const int64_t tile1 = std::min(pl.n_tiles, tile0 + s.unit_chunk);
  const int64_t tok0 = (task / s.n_unit_chunks) * s.tok_chunk;
  const int64_t tok1 = std::min(n_tok, tok0 + s.tok_chunk);
  const int64_t n_rows = w.n_rows();
  const mm::TileFn fn = k.tile[static_cast<int>(pl.kind)];
  mm::TileJob job;
  job.w = &pl;
  job.acts = &c.al;
  job.y_stride = n_rows;
  // Token groups outside, tiles inside: a task's few tiles of weights stay in L1 while every
  // token group passes over them. With several groups, the first one would wait on DRAM for
  // every tile (the multi-token kernels do not prefetch, and a tile's sections are streams too
  // short for the hardware prefetcher): ask for all of the task's tiles up front instead.
  if (tok1 - tok0 > mm::kMaxTokens) {
    const uint8_t* p0 = w.data() + tile0 * pl.tile_bytes;
    const uint8_t* p1 = w.data() + tile1 * pl.tile_bytes;
    for (const uint8_t* p = p0; p < p1; p += 64) __builtin_prefetch(p, 0, 3);
  }
  for (int64_t t = tok0; t < tok1; t += mm::kMaxTokens) {
    job.nt = static_cast<int>(std::min<int64_t>(mm::kMaxTokens, tok1 - t));
    job.act = c.acts + t * c.al.stride;
    for (int64_t tile = tile0; tile < tile1; ++tile) {
      job.tile = w.data() + tile * pl.tile_bytes;
      job.rows = static_cast<int>(std::min<int64_t>(mm::kTileRows, n_rows - tile * mm::kTileRows));
      job.y = c.y + t * n_rows + tile * mm::kTileRows;
      fn(job);
    }
  }
}

void run_f32_task(const Prepared& c, int64_t n_tok, int64_t task, KernelIsa isa,
                  const mm::KernelTable& k) {
  const QMatrix& w = *c.w;
  const Split& s = c.split;
  const int64_t n_rows = w.n_rows(), n_cols = w.n_cols();
  const int64_t g0 = (task % s.n_unit_chunks) * s.unit_chunk;
  const int64_t g1 = std::min(c.n_units, g0 + s.unit_chunk);
  const int64_t tok0 = (task / s.n_unit_chunks) * s.tok_chunk;
  const int64_t tok1 = std::min(n_tok, tok0 + s.tok_chunk);
  const bool direct = w.type() == GgmlType::kF32;
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
      job.x = c.x + t * n_cols;
      job.y = c.y + t * n_rows + r0;
      k.f32(job);
    }
  }
}

// At most this many products per matmul_many call are prepared on the stack.
constexpr size_t kMaxCalls = 16;

void matmul_many_impl(std::span<const MatmulCall> calls, int64_t n_tok, ThreadPool& pool,
                      KernelIsa isa) {
  D2O_ASSERT(n_tok >= 0);
  if (n_tok == 0 || calls.empty()) return;
  D2O_ASSERT(calls.size() <= kMaxCalls);
  const mm::KernelTable& k = table_for(isa);
  Prepared prep[kMaxCalls];

  // Activation records: one set per distinct (x, format, n_cols); calls sharing x share them.
  int64_t act_bytes = 0;
  for (size_t i = 0; i < calls.size(); ++i) {
    const MatmulCall& c = calls[i];
    D2O_ASSERT(c.w != nullptr && c.w->n_rows() > 0 && c.x != nullptr && c.y != nullptr);
    Prepared& p = prep[i];
    p.w = c.w;
    p.x = c.x;
    p.y = c.y;
    if (c.w->packed()) {
      p.al = mm::make_act_layout(mm::act_format_for(c.w->layout().kind), c.w->n_cols());
      p.n_units = c.w->layout().n_tiles;
    } else {
      p.n_units = (c.w->n_rows() + kGroupRows - 1) / kGroupRows;
    }
    p.split = make_split(p.n_units, n_tok, pool.n_threads());
    p.n_tasks = p.split.n_tok_chunks * p.split.n_unit_chunks;
    if (c.w->packed()) act_bytes += n_tok * p.al.stride;
  }
  uint8_t* scratch = act_scratch(static_cast<size_t>(act_bytes));
  int64_t used = 0;
  for (size_t i = 0; i < calls.size(); ++i) {
    Prepared& p = prep[i];
    if (!p.w->packed()) continue;
    for (size_t j = 0; j < i; ++j) {
      if (prep[j].acts != nullptr && prep[j].x == p.x && prep[j].al.format == p.al.format &&
          prep[j].al.n_cols == p.al.n_cols) {
        p.acts = prep[j].acts;
        break;
      }
    }
    if (p.acts != nullptr) continue;
    uint8_t* acts = scratch + used;
    used += n_tok * p.al.stride;
    p.acts = acts;
    const mm::QuantizeFn quantize = k.quantize[static_cast<int>(p.al.format)];
    const int64_t n_cols = p.al.n_cols;
    const mm::ActLayout& al = p.al;
    const float* x = p.x;
    if (n_tok * n_cols < kParallelQuantizeMin) {
      for (int64_t t = 0; t < n_tok; ++t) quantize(al, x + t * n_cols, acts + t * al.stride);
    } else {
      pool.parallel_for(n_tok, 4, [&](int64_t t0, int64_t t1, int) {
        for (int64_t t = t0; t < t1; ++t) quantize(al, x + t * n_cols, acts + t * al.stride);
      });
    }
  }

  int64_t total = 0;
  for (size_t i = 0; i < calls.size(); ++i) total += prep[i].n_tasks;
  const size_t n_calls = calls.size();
  pool.run(total, [&](int64_t task, int) {
    size_t i = 0;
    while (task >= prep[i].n_tasks) task -= prep[i++].n_tasks;
    D2O_ASSERT(i < n_calls);
    if (prep[i].w->packed()) {
      run_packed_task(prep[i], n_tok, task, k);
    } else {
      run_f32_task(prep[i], n_tok, task, isa, k);
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
    case PackKind::kIQ4_XS:
    case PackKind::kQ3_K:
    case PackKind::kQ2_K:
      return ActFormat::kQ8x256;
    case PackKind::kBF16:
      return ActFormat::kBf16;
    default:
      return ActFormat::kQ8x32;
  }
}

ActLayout make_act_layout(ActFormat format, int64_t n_cols) {
  ActLayout l;
  l.format = format;
  l.n_cols = n_cols;
  if (format == ActFormat::kBf16) {
    l.block = 2;
    l.stride = align64(4 * n_cols);
    return l;
  }
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

namespace {

// The checks every QMatrix source passes: a supported type, positive dimensions, whole blocks per
// row, a size without overflow. Sets the GGUF bytes of a row and of the matrix.
Status check_matrix_shape(GgmlType type, int64_t n_rows, int64_t n_cols, const std::string& what,
                          int64_t* row_bytes, int64_t* total) {
  if (!ggml_type_traits(static_cast<uint32_t>(type)) || !dequantize_supported(type)) {
    return unsupported(what + ": tensor type " + ggml_type_name(type) +
                       " is not supported for compute (supported: F32, F16, BF16, Q4_0, Q4_1, "
                       "Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS)");
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
  *row_bytes = ggml_row_bytes(type, n_cols);
  if (__builtin_mul_overflow(*row_bytes, n_rows, total)) {
    return invalid_argument(what + ": size overflows");
  }
  return {};
}

std::string matrix_what(GgmlType type, int64_t n_rows, int64_t n_cols) {
  return ggml_type_name(type) + " matrix [" + std::to_string(n_rows) + ", " +
         std::to_string(n_cols) + "]";
}

// Rows a repacked matrix copies from its source at a time (from_gguf_bytes).
constexpr int64_t kCopySliceRows = 1024;

}  // namespace

Result<QMatrix> QMatrix::from_gguf_bytes(GgmlType type, int64_t n_rows, int64_t n_cols,
                                         const uint8_t* src, size_t src_bytes) {
  const std::string what = matrix_what(type, n_rows, n_cols);
  int64_t row_bytes = 0, total = 0;
  D2O_RETURN_IF_ERROR(check_matrix_shape(type, n_rows, n_cols, what, &row_bytes, &total));
  if (src_bytes != static_cast<uint64_t>(total)) {
    return invalid_argument(what + ": expected " + std::to_string(total) + " bytes of data, got " +
                            std::to_string(src_bytes));
  }
  if (src == nullptr) return invalid_argument(what + ": no data");
  return from_gguf_rows(type, n_rows, n_cols, kCopySliceRows,
                        [&](uint64_t offset, uint64_t n, uint8_t* dst) {
                          std::memcpy(dst, src + offset, static_cast<size_t>(n));
                          return Status();
                        });
}

Result<QMatrix> QMatrix::from_gguf_rows(GgmlType type, int64_t n_rows, int64_t n_cols,
                                        int64_t slice_rows, const RowReader& read) {
  const std::string what = matrix_what(type, n_rows, n_cols);
  int64_t row_bytes = 0, total = 0;
  D2O_RETURN_IF_ERROR(check_matrix_shape(type, n_rows, n_cols, what, &row_bytes, &total));
  if (slice_rows < 1) return invalid_argument(what + ": slices must hold at least one row");

  QMatrix m;
  m.type_ = type;
  m.n_rows_ = n_rows;
  m.n_cols_ = n_cols;
  m.raw_row_bytes_ = row_bytes;
  m.layout_ = mm::make_packed_layout(type, n_rows, n_cols);
  if (!m.packed()) {
    // Kept as stored: the rows are read in place, no slice needed.
    m.data_.resize(static_cast<size_t>(total));
    advise_huge_pages(m.data_.data(), m.data_.size());
    D2O_RETURN_IF_ERROR(read(0, static_cast<uint64_t>(total), m.data_.data()));
    return m;
  }
  const mm::PackedLayout& l = m.layout_;
  m.data_.resize(static_cast<size_t>(l.n_tiles * l.tile_bytes));
  advise_huge_pages(m.data_.data(), m.data_.size());
  m.data_.zero();  // padding rows and alignment gaps: zero scales contribute nothing
  const int64_t block_bytes = row_bytes / l.n_blocks;
  const int64_t slice = std::min(slice_rows, n_rows);
  AlignedBuffer<uint8_t> src(static_cast<size_t>(slice * row_bytes));
  for (int64_t first = 0; first < n_rows; first += slice) {
    const int64_t count = std::min(slice, n_rows - first);
    D2O_RETURN_IF_ERROR(read(static_cast<uint64_t>(first * row_bytes),
                             static_cast<uint64_t>(count * row_bytes), src.data()));
    for (int64_t row = first; row < first + count; ++row) {
      uint8_t* tile = m.data_.data() + (row / mm::kTileRows) * l.tile_bytes;
      const int r = static_cast<int>(row % mm::kTileRows);
      const uint8_t* raw = src.data() + (row - first) * row_bytes;
      for (int64_t b = 0; b < l.n_blocks; ++b) mm::pack_block(l, raw + b * block_bytes, tile, r, b);
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
  const MatmulCall call{&w, x, y};
  matmul_many_impl(std::span<const MatmulCall>(&call, 1), n_tok, pool, isa);
}

void matmul(const QMatrix& w, const float* x, int64_t n_tok, float* y, ThreadPool& pool) {
  matmul_isa(w, x, n_tok, y, pool, best_kernel_isa());
}

void matmul_many(std::span<const MatmulCall> calls, int64_t n_tok, ThreadPool& pool) {
  matmul_many_impl(calls, n_tok, pool, best_kernel_isa());
}

void matmul_many_isa(std::span<const MatmulCall> calls, int64_t n_tok, ThreadPool& pool,
                     KernelIsa isa) {
  matmul_many_impl(calls, n_tok, pool, isa);
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
