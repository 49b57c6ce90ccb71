// The glue every SIMD level of the matmul shares: dispatch on a micro-tile's token count (and the
// fp32 path's row count) and the kernel table. Written once and included by each per-ISA file
// (matmul_avx2.cpp, matmul_avx512.cpp) inside its anonymous namespace, after its kernels, which
// it calls by name:
//   tile_32<PackKind, NT>, f32_tile<NR, NT>
// The tiles of the formats in 256-element blocks and of BF16 come from the level's K-quant file
// (matmul_kquant.h), which has its own glue (matmul_kquant_impl.h).
// Everything here has internal linkage, so each level keeps its own copy, compiled for its own
// instruction set (tests/check_isa_objects.cmake guards against shared weak symbols).
//
// Not a self-contained header: include it only there, inside `namespace d2o::mm { namespace {`.

template <int NR>
void f32_rows(const F32Job& job) {
  switch (job.nt) {
    case 1:
      return f32_tile<NR, 1>(job);
    case 2:
      return f32_tile<NR, 2>(job);
    case 3:
      return f32_tile<NR, 3>(job);
    default:
      return f32_tile<NR, 4>(job);
  }
}

void f32_by_rows(const F32Job& job) {
  switch (job.nr) {
    case 1:
      return f32_rows<1>(job);
    case 2:
      return f32_rows<2>(job);
    case 3:
      return f32_rows<3>(job);
    default:
      return f32_rows<4>(job);
  }
}

// Dispatch on the token count of the micro-tile.
template <PackKind kKind>
void tile_32_by_nt(const TileJob& job) {
  switch (job.nt) {
    case 1:
      return tile_32<kKind, 1>(job);
    case 2:
      return tile_32<kKind, 2>(job);
    case 3:
      return tile_32<kKind, 3>(job);
    default:
      return tile_32<kKind, 4>(job);
  }
}

KernelTable make_kernel_table(QuantizeFn quantize, const KQuantTiles& kq) {
  KernelTable t;
  t.quantize[static_cast<int>(ActFormat::kQ8x32)] = quantize;
  t.quantize[static_cast<int>(ActFormat::kQ8x256)] = quantize;
  t.quantize[static_cast<int>(ActFormat::kBf16)] = quantize_bf16;
  t.tile[static_cast<int>(PackKind::kQ4_0)] = tile_32_by_nt<PackKind::kQ4_0>;
  t.tile[static_cast<int>(PackKind::kQ4_1)] = tile_32_by_nt<PackKind::kQ4_1>;
  t.tile[static_cast<int>(PackKind::kQ5_0)] = tile_32_by_nt<PackKind::kQ5_0>;
  t.tile[static_cast<int>(PackKind::kQ8_0)] = tile_32_by_nt<PackKind::kQ8_0>;
  t.tile[static_cast<int>(PackKind::kIQ4_NL)] = tile_32_by_nt<PackKind::kIQ4_NL>;
  t.tile[static_cast<int>(PackKind::kQ4_K)] = kq.q4_k;
  t.tile[static_cast<int>(PackKind::kQ5_K)] = kq.q5_k;
  t.tile[static_cast<int>(PackKind::kQ6_K)] = kq.q6_k;
  t.tile[static_cast<int>(PackKind::kIQ4_XS)] = kq.iq4_xs;
  t.tile[static_cast<int>(PackKind::kBF16)] = kq.bf16;
  t.tile[static_cast<int>(PackKind::kQ3_K)] = kq.q3_k;
  t.tile[static_cast<int>(PackKind::kQ2_K)] = kq.q2_k;
  t.f32 = f32_by_rows;
  return t;
}
