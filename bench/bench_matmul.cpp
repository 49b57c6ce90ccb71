// matmul throughput on the SmolLM2-135M shapes: matvec (decode) and 512-token products (prompt
// processing) for Q4_1 [576 x 1536] (ffn_down), Q4_1 [1536 x 576] (ffn_gate/up) and Q8_0
// [49152 x 576] (tied output matrix), at 1 and 2 threads and every kernel level; and, at one
// thread, Q4_K and Q6_K [576 x 1536] and Q5_0 [2048 x 640] (Gemma 3 270M's ffn_gate/up), and the
// other packed types at [576 x 1536] next to a neighbour: IQ4_NL by Q4_0, IQ4_XS by Q4_K, BF16
// by BF16 [576 x 1535], whose odd rows stay raw and go through the fp32 path; Q3_K and Q2_K.
// BM_Fp32Path times the fp32 path (dequantise 4 rows, fp32 dot products) on the packed types'
// cases, for the ratio of their integer kernels to it.
//
// Counters: GB/s = weight bytes read per second, GFLOP/s = 2 * rows * cols * tokens per second.
// "hot" runs reuse one matrix (it stays in L2/L3); "cold" runs rotate over enough copies
// (>= 96 MiB, the size of the whole model) that every call streams its weights from DRAM, as a
// decode step does. Batched decoding (8 and 32 tokens) is measured cold.
//
//   build/bench/bench_matmul --benchmark_counters_tabular=true [--benchmark_filter=...]
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/fp16.h"
#include "ops/matmul.h"
#include "ops/matmul_kernels.h"
#include "ops/quant.h"

namespace d2o {
namespace {

struct Case {
  GgmlType type;
  int64_t rows, cols;
};
constexpr Case kCases[] = {
    {GgmlType::kQ4_1, 576, 1536},
    {GgmlType::kQ4_1, 1536, 576},
    {GgmlType::kQ8_0, 49152, 576},
    // Not in SmolLM2, for reference: the K formats of Q4_K_M models.
    {GgmlType::kQ4_K, 576, 1536},
    {GgmlType::kQ6_K, 576, 1536},
    // Q5_0 at the ffn_gate/up shape of Gemma 3 270M.
    {GgmlType::kQ5_0, 2048, 640},
    {GgmlType::kQ4_0, 576, 1536},
    {GgmlType::kIQ4_NL, 576, 1536},
    {GgmlType::kIQ4_XS, 576, 1536},
    {GgmlType::kBF16, 576, 1536},
    {GgmlType::kBF16, 576, 1535},
    {GgmlType::kQ3_K, 576, 1536},
    {GgmlType::kQ2_K, 576, 1536},
};
constexpr int64_t kNumCases = sizeof(kCases) / sizeof(kCases[0]);

std::vector<uint8_t> random_bytes(const Case& c, uint32_t seed) {
  std::mt19937 rng(seed);
  const int64_t row_bytes = ggml_row_bytes(c.type, c.cols);
  std::vector<uint8_t> bytes(static_cast<size_t>(row_bytes * c.rows));
  for (auto& b : bytes) b = static_cast<uint8_t>(rng());
  // Finite fp16 scale fields (offsets inside a block), random quants.
  const int64_t block_bytes = ggml_row_bytes(c.type, ggml_block_size(c.type));
  const size_t d_off = c.type == GgmlType::kQ6_K   ? 208
                       : c.type == GgmlType::kQ3_K ? 108
                       : c.type == GgmlType::kQ2_K ? 80
                                                   : 0;
  const size_t m_off = c.type == GgmlType::kQ2_K ? 82 : 2;
  const bool has_min =
      c.type == GgmlType::kQ4_1 || c.type == GgmlType::kQ4_K || c.type == GgmlType::kQ2_K;
  std::uniform_real_distribution<float> u(-0.02f, 0.02f);
  for (size_t off = 0; off < bytes.size(); off += static_cast<size_t>(block_bytes)) {
    const uint16_t d = fp32_to_fp16(u(rng)), m = fp32_to_fp16(-0.01f);
    std::memcpy(bytes.data() + off + d_off, &d, 2);
    if (has_min) std::memcpy(bytes.data() + off + m_off, &m, 2);
  }
  return bytes;
}

QMatrix random_matrix(const Case& c, uint32_t seed) {
  const std::vector<uint8_t> bytes = random_bytes(c, seed);
  auto m = QMatrix::from_gguf_bytes(c.type, c.rows, c.cols, bytes.data(), bytes.size());
  if (!m.ok()) std::abort();
  return std::move(m).value();
}

// The fp32 path that types without a packed layout take (matmul.cpp's run_f32_task on one
// thread): per 64 tokens, per 4 rows, dequantise the GGUF rows and run the fp32 micro-tiles.
// For the packed types it says what they would cost without their integer kernels.
// args: case index, tokens, kernel level
void BM_Fp32Path(benchmark::State& state) {
  const Case& c = kCases[state.range(0)];
  const int64_t n_tok = state.range(1);
  const auto isa = static_cast<KernelIsa>(state.range(2));
  if (!kernel_isa_available(isa)) {
    state.SkipWithError("kernel level not available on this CPU");
    return;
  }
  const mm::KernelTable& k = isa == KernelIsa::kAvx512 ? mm::kernels_avx512() : mm::kernels_avx2();
  const std::vector<uint8_t> bytes = random_bytes(c, 1);
  const int64_t row_bytes = ggml_row_bytes(c.type, c.cols);
  std::vector<float> x(static_cast<size_t>(n_tok * c.cols)), y(static_cast<size_t>(n_tok * c.rows));
  std::vector<float> buf(static_cast<size_t>(4 * c.cols));
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  for (float& v : x) v = nd(rng);
  mm::F32Job job;
  job.x_stride = job.n = c.cols;
  job.y_stride = c.rows;
  for (auto _ : state) {
    for (int64_t t0 = 0; t0 < n_tok; t0 += 64) {
      for (int64_t r0 = 0; r0 < c.rows; r0 += 4) {
        job.nr = static_cast<int>(std::min<int64_t>(4, c.rows - r0));
        for (int i = 0; i < job.nr; ++i) {
          dequantize_row_isa(isa, c.type, bytes.data() + (r0 + i) * row_bytes, &buf[i * c.cols],
                             c.cols);
          job.rows[i] = &buf[i * c.cols];
        }
        for (int64_t t = t0; t < std::min(n_tok, t0 + 64); t += 4) {
          job.nt = static_cast<int>(std::min<int64_t>(4, n_tok - t));
          job.x = x.data() + t * c.cols;
          job.y = y.data() + t * c.rows + r0;
          k.f32(job);
        }
      }
    }
    benchmark::DoNotOptimize(y.data());
  }
  state.SetLabel(ggml_type_name(c.type) + " [" + std::to_string(c.rows) + " x " +
                 std::to_string(c.cols) + "] " + kernel_isa_name(isa) + " fp32 path");
}
BENCHMARK(BM_Fp32Path)
    ->ArgNames({"case", "tok", "isa"})
    ->ArgsProduct({{7, 8, 9, 11, 12}, {1, 512}, {1, 2}})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

// args: case index, tokens, threads, kernel level, cold (0/1)
void BM_Matmul(benchmark::State& state) {
  const Case& c = kCases[state.range(0)];
  const int64_t n_tok = state.range(1);
  const int threads = static_cast<int>(state.range(2));
  const auto isa = static_cast<KernelIsa>(state.range(3));
  const bool cold = state.range(4) != 0;
  if (!kernel_isa_available(isa)) {
    state.SkipWithError("kernel level not available on this CPU");
    return;
  }
  std::vector<QMatrix> mats;
  mats.push_back(random_matrix(c, 1));
  if (cold) {
    const size_t target = size_t{96} << 20;
    while (mats.size() * mats[0].bytes() < target)
      mats.push_back(random_matrix(c, static_cast<uint32_t>(mats.size() + 1)));
  }
  ThreadPool pool(threads);
  std::vector<float> x(static_cast<size_t>(n_tok * c.cols)), y(static_cast<size_t>(n_tok * c.rows));
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  for (float& v : x) v = nd(rng);
  size_t i = 0;
  for (auto _ : state) {
    matmul_isa(mats[i], x.data(), n_tok, y.data(), pool, isa);
    benchmark::DoNotOptimize(y.data());
    if (++i == mats.size()) i = 0;
  }
  const double bytes = static_cast<double>(mats[0].bytes());
  const double flops = 2.0 * static_cast<double>(c.rows * c.cols * n_tok);
  state.counters["GB/s"] =
      benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(ggml_type_name(c.type) + " [" + std::to_string(c.rows) + " x " +
                 std::to_string(c.cols) + "] " + kernel_isa_name(isa) + (cold ? " cold" : " hot"));
}

void args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"case", "tok", "thr", "isa", "cold"});
  for (int64_t c = 0; c < 3; ++c) {
    for (int64_t thr : {1, 2}) {
      // Decode: every level, weights hot and cold.
      for (int64_t isa : {0, 1, 2}) {
        for (int64_t cold : {0, 1}) {
          if (isa == 0 && (cold == 1 || c == 2)) continue;  // scalar: one point is enough
          b->Args({c, 1, thr, isa, cold});
        }
      }
      // Batched decoding (8 and 32 sequences, weights from DRAM) and prompt processing (512).
      for (int64_t isa : {1, 2}) {
        for (int64_t tok : {8, 32}) b->Args({c, tok, thr, isa, 1});
        b->Args({c, 512, thr, isa, 0});
      }
    }
  }
  for (int64_t c = 3; c < kNumCases; ++c) {
    for (int64_t isa : {1, 2}) {
      b->Args({c, 1, 1, isa, 0});
      b->Args({c, 512, 1, isa, 0});
    }
  }
  b->UseRealTime()->Unit(benchmark::kMicrosecond);
}
BENCHMARK(BM_Matmul)->Apply(args);

}  // namespace
}  // namespace d2o

BENCHMARK_MAIN();
