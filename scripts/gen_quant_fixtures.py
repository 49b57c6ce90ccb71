#!/usr/bin/env python3
"""Writes dequant_<TYPE>.bin: random blocks of each GGUF type and their dequantisation
by the `gguf` PyPI package (gguf.quants.dequantize), the independent reference that
tests/unit/test_quant.cpp checks d2o's dequantisers against bit for bit; and quantize_<TYPE>.bin
for Q8_0 and Q4_0 (the KV cache's quantised storage types): float rows and their quantisation by
gguf.quants.quantize, which tests/unit/test_kv_quant.cpp checks d2o's quantisers against.

Blocks are random bytes except for the fp16 scale fields, which are redrawn until finite (a NaN
or Inf scale would make the comparison meaningless). F16/BF16/F32 rows hold random finite values.

File layout (little-endian):
  char[4] "D2OQ", u32 version (1), u32 ggml type, u32 n_elements, u32 n_bytes,
  u8[n_bytes] raw GGUF row bytes, f32[n_elements] expected values.
quantize_<TYPE>.bin: the same header, then f32[n_elements] input values, u8[n_bytes] expected
  blocks.

Usage: python3 scripts/gen_quant_fixtures.py [out_dir]   (needs: pip install gguf numpy)

scripts/setup.sh --test-data runs it into <cache>/test-data/quant (the default out_dir), where
the tests read the files ($D2O_QUANT_DIR overrides).
"""
import os
import struct
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

# Byte offsets of the fp16 scale fields inside one block of each type.
SCALE_FIELDS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
    T.IQ4_NL: [0], T.IQ4_XS: [0],
}
N_BLOCKS = {32: 5, 256: 3}  # a few blocks per type: small files, several blocks per row


def finite_halves(rng, n):
    h = rng.integers(0, 1 << 16, size=n, dtype=np.uint32).astype(np.uint16)
    bad = (h & 0x7C00) == 0x7C00
    while bad.any():
        h[bad] = rng.integers(0, 1 << 16, size=int(bad.sum()), dtype=np.uint32).astype(np.uint16)
        bad = (h & 0x7C00) == 0x7C00
    return h


def make(qtype, rng):
    block, size = GGML_QUANT_SIZES[qtype]
    if qtype == T.F32:
        vals = (rng.standard_normal(67) * 10.0 ** rng.integers(-20, 20, 67)).astype(np.float32)
        raw = vals.view(np.uint8)
    elif qtype == T.F16:
        raw = finite_halves(rng, 67).view(np.uint8)
    elif qtype == T.BF16:
        b = rng.integers(0, 1 << 16, size=67, dtype=np.uint32).astype(np.uint16)
        b[(b & 0x7F80) == 0x7F80] &= 0xBFFF  # exponent all ones -> not Inf/NaN
        raw = b.view(np.uint8)
    else:
        nb = N_BLOCKS[block]
        raw = rng.integers(0, 256, size=(nb, size), dtype=np.uint32).astype(np.uint8)
        for off in SCALE_FIELDS[qtype]:
            raw[:, off:off + 2] = finite_halves(rng, nb).view(np.uint8).reshape(nb, 2)
        if qtype in (T.Q4_0, T.Q5_0, T.Q8_0, T.Q4_K, T.IQ4_NL):
            raw[0, 0:2] = 0  # one block with a zero scale
        raw = raw.reshape(-1)
    expected = np.asarray(dequantize(raw.copy(), qtype), dtype=np.float32).reshape(-1)
    n_el = raw.size // size * block
    assert expected.size == n_el and np.isfinite(expected).all(), qtype.name
    return raw, expected


def quantize_rows(rng):
    """Rows of 32-element blocks: random values at many scales, and blocks that hit the rounding
    rules' edges (ties, a negative extreme, equal extremes of both signs, zeros, tiny values)."""
    blocks = [(rng.standard_normal(32) * 10.0 ** rng.integers(-6, 4)) for _ in range(60)]
    blocks.append(np.zeros(32))
    blocks.append(np.arange(-16, 16) + 0.5)                  # Q8_0 ties after scaling
    blocks.append(np.concatenate([[127.0], np.arange(31) - 15.5]))  # d = 1: exact .5 ties
    blocks.append(np.concatenate([[-8.0], np.arange(31) / 4 - 4]))  # Q4_0: d = 1, x + 8.5 edges
    blocks.append(np.concatenate([[3.0, -3.0], rng.standard_normal(30)]))  # equal |extremes|
    blocks.append(np.concatenate([[-3.0, 3.0], rng.standard_normal(30)]))
    blocks.append(rng.standard_normal(32) * 1e-9)              # scale below fp16's range
    blocks.append(np.full(32, -2.25))
    return np.concatenate(blocks).astype(np.float32)


def write_quantize(out, rng):
    x = quantize_rows(rng)
    for qtype in (T.Q8_0, T.Q4_0):
        raw = np.asarray(quantize(x.reshape(-1, 64), qtype), dtype=np.uint8).reshape(-1)
        assert raw.size == x.size // 32 * GGML_QUANT_SIZES[qtype][1], qtype.name
        path = os.path.join(out, f"quantize_{qtype.name}.bin")
        with open(path, "wb") as f:
            f.write(b"D2OQ")
            f.write(struct.pack("<IIII", 1, int(qtype), x.size, raw.size))
            f.write(x.astype("<f4").tobytes())
            f.write(raw.tobytes())
        print(f"{os.path.normpath(path)}: {x.size} floats -> {raw.size} bytes")


def main():
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "cache", "test-data", "quant")
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(20240611)
    types = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
             T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS]
    for qtype in types:
        raw, expected = make(qtype, rng)
        path = os.path.join(out, f"dequant_{qtype.name}.bin")
        with open(path, "wb") as f:
            f.write(b"D2OQ")
            f.write(struct.pack("<IIII", 1, int(qtype), expected.size, raw.size))
            f.write(raw.tobytes())
            f.write(expected.astype("<f4").tobytes())
        print(f"{os.path.normpath(path)}: {raw.size} bytes -> {expected.size} floats")
    write_quantize(out, np.random.default_rng(20261202))


if __name__ == "__main__":
    main()
