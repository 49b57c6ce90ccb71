// The glue every SIMD level of the matmul shares: dispatch on a micro-tile's token count (and the
// fp32 path's row count) and the kernel table. Written once and included by each per-ISA file
// (matmul_avx2.cpp, matmul_avx512.cpp) inside its anonymous namespace, after its kernels, which
// it calls by name:
//   tile_32<PackKind, NT>, tile_q45_k<bool five, NT>, tile_q6_k<NT>, tile_iq4_xs<NT>,
//   tile_bf16<NT>, tile_q23_k<bool three, NT>, f32_tile<NR, NT>
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
template <template <int> class K>
void by_nt(const TileJob& job) {
  switch (job.nt) {
    case 1:
      return K<1>::run(job);
    case 2:
      return K<2>::run(job);
    case 3:
      return K<3>::run(job);
    default:
      return K<4>::run(job);
  }
}
template <PackKind kKind>
struct Tile32 {
  template <int NT>
  struct K {
    static void run(const TileJob& j) { tile_32<kKind, NT>(j); }
  };
};
template <bool kFive>
struct TileQ45 {
  template <int NT>
  struct K {
    static void run(const TileJob& j) { tile_q45_k<kFive, NT>(j); }
  };
};
template <int NT>
struct TileQ6 {
  static void run(const TileJob& j) { tile_q6_k<NT>(j); }
};
template <bool kThree>
struct TileQ23 {
  template <int NT>
  struct K {
    static void run(const TileJob& j) { tile_q23_k<kThree, NT>(j); }
  };
};
template <int NT>
struct TileBf16 {
  static void run(const TileJob& j) { tile_bf16<NT>(j); }
};
template <int NT>
struct TileIq4Xs {
  static void run(const TileJob& j) { tile_iq4_xs<NT>(j); }
};

KernelTable make_kernel_table(QuantizeFn quantize) {
  KernelTable t;
  t.quantize[static_cast<int>(ActFormat::kQ8x32)] = quantize;
  t.quantize[static_cast<int>(ActFormat::kQ8x256)] = quantize;
  t.quantize[static_cast<int>(ActFormat::kBf16)] = quantize_bf16;
  t.tile[static_cast<int>(PackKind::kQ4_0)] = by_nt<Tile32<PackKind::kQ4_0>::K>;
  t.tile[static_cast<int>(PackKind::kQ4_1)] = by_nt<Tile32<PackKind::kQ4_1>::K>;
  t.tile[static_cast<int>(PackKind::kQ5_0)] = by_nt<Tile32<PackKind::kQ5_0>::K>;
  t.tile[static_cast<int>(PackKind::kQ8_0)] = by_nt<Tile32<PackKind::kQ8_0>::K>;
  t.tile[static_cast<int>(PackKind::kIQ4_NL)] = by_nt<Tile32<PackKind::kIQ4_NL>::K>;
  t.tile[static_cast<int>(PackKind::kQ4_K)] = by_nt<TileQ45<false>::K>;
  t.tile[static_cast<int>(PackKind::kQ5_K)] = by_nt<TileQ45<true>::K>;
  t.tile[static_cast<int>(PackKind::kQ6_K)] = by_nt<TileQ6>;
  t.tile[static_cast<int>(PackKind::kIQ4_XS)] = by_nt<TileIq4Xs>;
  t.tile[static_cast<int>(PackKind::kBF16)] = by_nt<TileBf16>;
  t.tile[static_cast<int>(PackKind::kQ3_K)] = by_nt<TileQ23<true>::K>;
  t.tile[static_cast<int>(PackKind::kQ2_K)] = by_nt<TileQ23<false>::K>;
  t.f32 = f32_by_rows;
  return t;
}
