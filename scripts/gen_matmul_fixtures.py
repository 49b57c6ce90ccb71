#!/usr/bin/env python3
"""Writes OUT_DIR/matmul_<TYPE>.bin: a small weight matrix, activations, and the product that
llama.cpp's ggml library computes for them (ggml_mul_mat on the CPU backend, one thread).
tests/unit/test_matmul.cpp checks that d2o's matmul reproduces it up to float summation order,
i.e. that d2o quantises activations exactly like llama.cpp. `scripts/setup.sh --test-data` builds
ggml from the llama-cpp-python source archive into the cache and runs this into
cache/test-data/matmul.

Needs an already built ggml (this script builds and downloads nothing):
  LLAMA_CPP_LIB_PATH  folder holding libggml.so, libggml-base.so and libggml-cpu.so

The weights are random normal values quantised by ggml itself (ggml_quantize_chunk), so the
blocks look like real ones. File layout (little-endian):
  char[4] "D2OM", u32 version (1), u32 ggml type, u32 n_rows, u32 n_cols, u32 n_tok,
  u8[n_rows * row_bytes] weights (GGUF layout), f32[n_tok * n_cols] x, f32[n_tok * n_rows] y.

Usage: LLAMA_CPP_LIB_PATH=/path/to/ggml/libs python3 scripts/gen_matmul_fixtures.py OUT_DIR
"""
import ctypes as C
import os
import struct
import sys

import numpy as np


# GGML type numbers (the GGUF numbering) and the shapes to write: [n_rows, n_cols], tokens.
# New cases go at the end: the random draws of the earlier ones (and their files) stay the same.
CASES = [("Q4_0", 2, 40, 576, 7), ("Q4_1", 3, 40, 576, 7), ("Q8_0", 8, 40, 576, 7),
         ("Q4_K", 12, 24, 512, 5), ("Q5_K", 13, 24, 512, 5), ("Q6_K", 14, 24, 512, 5),
         ("Q5_0", 6, 40, 640, 7), ("IQ4_NL", 20, 40, 576, 7), ("IQ4_XS", 23, 24, 512, 5),
         ("BF16", 30, 40, 576, 7), ("Q3_K", 11, 24, 512, 5), ("Q2_K", 10, 24, 512, 5)]


class InitParams(C.Structure):
    _fields_ = [("mem_size", C.c_size_t), ("mem_buffer", C.c_void_p), ("no_alloc", C.c_bool)]


def load():
    lib_dir = os.environ.get("LLAMA_CPP_LIB_PATH")
    if not lib_dir:
        sys.exit("set LLAMA_CPP_LIB_PATH to the folder of libggml.so (an existing llama.cpp build)")
    mode = C.RTLD_GLOBAL
    C.CDLL(os.path.join(lib_dir, "libggml-base.so"), mode=mode)
    cpu = C.CDLL(os.path.join(lib_dir, "libggml-cpu.so"), mode=mode)
    ggml = C.CDLL(os.path.join(lib_dir, "libggml.so"), mode=mode)
    P = C.c_void_p
    ggml.ggml_init.restype = P
    ggml.ggml_init.argtypes = [InitParams]
    ggml.ggml_new_tensor_2d.restype = P
    ggml.ggml_new_tensor_2d.argtypes = [P, C.c_int, C.c_int64, C.c_int64]
    ggml.ggml_get_data.restype = P
    ggml.ggml_get_data.argtypes = [P]
    ggml.ggml_mul_mat.restype = P
    ggml.ggml_mul_mat.argtypes = [P, P, P]
    ggml.ggml_new_graph.restype = P
    ggml.ggml_new_graph.argtypes = [P]
    ggml.ggml_build_forward_expand.argtypes = [P, P]
    ggml.ggml_row_size.restype = C.c_size_t
    ggml.ggml_row_size.argtypes = [C.c_int, C.c_int64]
    ggml.ggml_quantize_chunk.restype = C.c_size_t
    ggml.ggml_quantize_chunk.argtypes = [C.c_int, P, P, C.c_int64, C.c_int64, C.c_int64, P]
    ggml.ggml_free.argtypes = [P]
    cpu.ggml_graph_compute_with_ctx.restype = C.c_int
    cpu.ggml_graph_compute_with_ctx.argtypes = [P, P, C.c_int]
    return ggml, cpu


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: gen_matmul_fixtures.py OUT_DIR")
    out_dir = sys.argv[1]
    ggml, cpu = load()
    rng = np.random.default_rng(4242)
    os.makedirs(out_dir, exist_ok=True)
    for name, gtype, n_rows, n_cols, n_tok in CASES:
        w = (rng.standard_normal((n_rows, n_cols)) * 0.05).astype(np.float32)
        x = rng.standard_normal((n_tok, n_cols)).astype(np.float32)
        x *= np.where(rng.random((n_tok, n_cols)) < 0.02, 20.0, 1.0).astype(np.float32)  # outliers
        row_bytes = ggml.ggml_row_size(gtype, n_cols)
        wq = np.zeros(n_rows * row_bytes, dtype=np.uint8)
        ggml.ggml_quantize_chunk(gtype, w.ctypes.data, wq.ctypes.data, 0, n_rows, n_cols, None)

        ctx = ggml.ggml_init(InitParams(64 << 20, None, False))
        tw = ggml.ggml_new_tensor_2d(ctx, gtype, n_cols, n_rows)
        C.memmove(ggml.ggml_get_data(tw), wq.ctypes.data, wq.nbytes)
        tx = ggml.ggml_new_tensor_2d(ctx, 0, n_cols, n_tok)  # GGML_TYPE_F32
        C.memmove(ggml.ggml_get_data(tx), x.ctypes.data, x.nbytes)
        ty = ggml.ggml_mul_mat(ctx, tw, tx)
        graph = ggml.ggml_new_graph(ctx)
        ggml.ggml_build_forward_expand(graph, ty)
        if cpu.ggml_graph_compute_with_ctx(ctx, graph, 1) != 0:
            sys.exit("ggml_graph_compute_with_ctx failed")
        y = np.ctypeslib.as_array(C.cast(ggml.ggml_get_data(ty), C.POINTER(C.c_float)),
                                  shape=(n_tok * n_rows,)).copy()
        ggml.ggml_free(ctx)

        path = os.path.join(out_dir, f"matmul_{name}.bin")
        with open(path, "wb") as f:
            f.write(b"D2OM")
            f.write(struct.pack("<IIIII", 1, gtype, n_rows, n_cols, n_tok))
            f.write(wq.tobytes())
            f.write(x.astype("<f4").tobytes())
            f.write(y.astype("<f4").tobytes())
        print(f"{path}: [{n_rows} x {n_cols}] x {n_tok} tokens, "
              f"{os.path.getsize(path)} bytes")


if __name__ == "__main__":
    main()
