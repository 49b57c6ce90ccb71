// The glue the K-quant files of every SIMD level share (matmul_kquant_avx2.cpp,
// matmul_kquant_avx512.cpp): dispatch on a micro-tile's token count and the level's KQuantTiles.
// Written once and included by each inside its anonymous namespace, after its kernels, which it
// calls by name:
//   tile_q45_k<bool five, NT>, tile_q6_k<NT>, tile_iq4_xs<NT>, tile_bf16<NT>,
//   tile_q23_k<bool three, NT>
// Everything here has internal linkage, so each level keeps its own copy, compiled for its own
// instruction set (tests/check_isa_objects.cmake guards against shared weak symbols).
//
// Not a self-contained header: include it only there, inside `namespace d2o::mm { namespace {`.

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

KQuantTiles make_kquant_tiles() {
  KQuantTiles t;
  t.q4_k = by_nt<TileQ45<false>::K>;
  t.q5_k = by_nt<TileQ45<true>::K>;
  t.q6_k = by_nt<TileQ6>;
  t.iq4_xs = by_nt<TileIq4Xs>;
  t.bf16 = by_nt<TileBf16>;
  t.q3_k = by_nt<TileQ23<true>::K>;
  t.q2_k = by_nt<TileQ23<false>::K>;
  return t;
}
