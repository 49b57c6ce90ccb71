#!/usr/bin/env python3
"""Regenerates tests/data/reference/: what an independent implementation (llama.cpp) computes for
the inputs the model tests use. d2o's tests compare against these files; they never compare d2o
with its own earlier output.

Needs an already built llama.cpp (nothing here builds or downloads it):
  LLAMA_CPP_PY       folder holding the `llama_cpp` Python package (llama-cpp-python sources)
  LLAMA_CPP_LIB_PATH folder holding libllama.so (read by llama_cpp)
  LLAMA_PERPLEXITY   path of llama.cpp's perplexity tool
and d2o's build folder (for the random-model writer): D2O_BUILD (default build/).

Outputs:
  smollm2_logits.bin   4 prompts x 512 positions: token ids and llama.cpp's top-k log-probs
                       (F32 KV cache, non-flash attention)
  smollm2_f32_logits.bin  the same on a copy of the model dequantised to F32 (exact arithmetic)
  smollm2_noise.json   llama.cpp's own spread: its flash-attention and F16-cache settings vs the
                       reference, and the Q4_1 model vs its exact F32 dequantisation
  smollm2_ppl.json     llama.cpp's perplexity of kjv_ppl.txt (context 2048)
  kjv_ppl.txt          the KJV passage (public domain) used for it
  random_<name>.bin    full logits of the random-weight models for a fixed token sequence
"""
import json
import os
import re
import struct
import subprocess
import sys
import tempfile

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(REPO, "tests", "data", "reference")
CACHE = os.environ.get("D2O_CACHE_DIR", os.path.join(REPO, "cache"))
MODEL = os.environ.get("D2O_MODEL", os.path.join(CACHE, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
BUILD = os.environ.get("D2O_BUILD", os.path.join(REPO, "build"))
TOPK = 40
N_POS = 512

sys.path.insert(0, os.environ["LLAMA_CPP_PY"])
from llama_cpp import Llama  # noqa: E402


def llama(path, n_ctx):
    # F32 K/V cache and the plain (non-flash) attention path: llama.cpp's most precise setting, so
    # the comparison measures the model computation rather than either side's KV rounding. The
    # d2o tests run with an F32 cache too.
    return Llama(path, logits_all=True, n_ctx=n_ctx, n_batch=512, n_threads=2, verbose=False,
                 use_mmap=False, seed=0, flash_attn=False, type_k=0, type_v=0)


# The source-code prompt: this repository's attention kernel as of a fixed commit, so that
# regenerating the fixtures gives the same tokens however the file changes later.
CODE_REV = "958d94a4c0a074417524bd7c90bab1c16fb82828"


def code_text():
    try:
        return subprocess.run(["git", "-C", REPO, "show", CODE_REV + ":src/kv/attention.cpp"], check=True,
                              capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        sys.exit("needs the repository's git history (commit %s) for the source-code prompt" % CODE_REV)


def austen_text():
    try:
        out = subprocess.run(["Rscript", "-e", "library(janeaustenr); writeLines(prideprejudice)"],
                             check=True, capture_output=True, text=True).stdout
        return out
    except (OSError, subprocess.CalledProcessError):
        sys.exit("needs R with janeaustenr (Debian r-cran-janeaustenr) for the Austen prompt")


CHAT = (
    "<|im_start|>system\nYou are a careful assistant who answers briefly.<|im_end|>\n"
    "<|im_start|>user\nWhat is the difference between a list and a tuple in Python? Give one example "
    "of each, and say when you would pick one over the other.<|im_end|>\n"
    "<|im_start|>assistant\nA list is mutable: you can append, remove or change items, e.g. "
    "`xs = [1, 2, 3]; xs.append(4)`. A tuple is immutable once built, e.g. `point = (3, 4)`. Pick a "
    "tuple for fixed records and dictionary keys, a list for collections that change.<|im_end|>\n"
    "<|im_start|>user\nTranslate 'good morning, how are you?' into French, German and Spanish, "
    "then count the words in each.<|im_end|>\n"
    "<|im_start|>assistant\nFrench: « Bonjour, comment allez-vous ? » (3 words). German: „Guten "
    "Morgen, wie geht es dir?“ (6 words). Spanish: «Buenos días, ¿cómo estás?» (4 words).<|im_end|>\n"
    "<|im_start|>user\nNow write a short poem of four lines about the sea at night, with the "
    "numbers 7, 42 and 1999 in it somewhere.<|im_end|>\n<|im_start|>assistant\n")


def to_f32_gguf(src, dst):
    """Writes a copy of `src` with every tensor dequantised to F32 (with the gguf package)."""
    import gguf
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, arch=str(r.fields["general.architecture"].contents()))
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k in ("general.architecture", "general.file_type"):
            continue
        t = f.types[0]
        if t == gguf.GGUFValueType.ARRAY:
            w.add_key_value(k, f.contents(), t, sub_type=f.types[-1])
        else:
            w.add_key_value(k, f.contents(), t)
    w.add_file_type(0)
    for t in r.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w.add_tensor(t.name, data, raw_dtype=gguf.GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def log_softmax(x):
    m = x.max(axis=1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=1, keepdims=True))


def top_k(logp):
    top = np.argsort(-logp, axis=1, kind="stable")[:, :TOPK]
    return top, np.take_along_axis(logp, top, axis=1)


def bucketed_kl(ref_logp, other_logp):
    """KL(ref || other) over ref's top-k tokens plus one bucket for the rest, per position; the
    exact formula the C++ tests use (tests/model/test_llama_parity.cpp)."""
    top, lp = top_k(ref_logp)
    lq = np.take_along_axis(other_logp, top, axis=1)
    p, q = np.exp(lp), np.exp(lq)
    p_rest = np.maximum(1e-12, 1 - p.sum(axis=1))
    q_rest = np.maximum(1e-12, 1 - q.sum(axis=1))
    return (p * (lp - lq)).sum(axis=1) + p_rest * np.log(p_rest / q_rest)


def write_topk(path, all_ids, all_logp, n_vocab):
    with open(path, "wb") as f:
        f.write(b"D2OL")
        f.write(struct.pack("<4I", len(all_ids), N_POS, TOPK, n_vocab))
        for ids in all_ids:
            f.write(np.array(ids, dtype=np.int32).tobytes())
        for logp in all_logp:
            top, lp = top_k(logp)
            for p in range(N_POS):
                f.write(top[p].astype(np.uint16).tobytes())
                f.write(lp[p].astype(np.float32).tobytes())


def real_model_logits():
    kjv = open(os.path.join(CACHE, "texts", "kjv.txt"), encoding="utf-8").read()
    code = code_text()
    austen = austen_text()
    start = austen.find("It is a truth universally acknowledged")
    prompts = [("kjv", kjv[:8000], False), ("austen", austen[start:start + 8000], False),
               ("code", code, False), ("chat", CHAT * 3, True)]
    llm = llama(MODEL, N_POS)
    n_vocab = llm.n_vocab()
    all_ids = []
    for name, text, special in prompts:
        ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=special)[:N_POS]
        assert len(ids) == N_POS, (name, len(ids))
        all_ids.append(ids)
    del llm

    def run(path, **kw):
        out = []
        m = Llama(path, logits_all=True, n_ctx=N_POS, n_batch=512, n_threads=2, verbose=False,
                  use_mmap=False, seed=0, **kw)
        for ids in all_ids:
            m.reset()
            m.eval(ids)
            out.append(log_softmax(np.array(m.scores[:N_POS], dtype=np.float64)))
        del m
        return out

    ref = run(MODEL, flash_attn=False, type_k=0, type_v=0)        # the reference setting
    fa_on = run(MODEL, flash_attn=True, type_k=0, type_v=0)       # llama.cpp's other kernel
    f16kv = run(MODEL, flash_attn=False)                          # llama.cpp's default cache type
    with tempfile.TemporaryDirectory() as d:
        f32_path = os.path.join(d, "f32.gguf")
        to_f32_gguf(MODEL, f32_path)
        exact = run(f32_path, flash_attn=False, type_k=0, type_v=0)
    write_topk(os.path.join(OUT, "smollm2_logits.bin"), all_ids, ref, n_vocab)
    write_topk(os.path.join(OUT, "smollm2_f32_logits.bin"), all_ids, exact, n_vocab)

    def stats(a_list, b_list):
        kl = [float(bucketed_kl(a, b).mean()) for a, b in zip(a_list, b_list)]
        top1 = [float((a.argmax(1) == b.argmax(1)).mean()) for a, b in zip(a_list, b_list)]
        return {"kl": kl, "top1": top1, "kl_mean": float(np.mean(kl)), "top1_mean": float(np.mean(top1))}

    noise = {
        "what": "bucketed KL(a || b) (top-%d + rest) and top-1 agreement per prompt" % TOPK,
        "ref_vs_flash_attn": stats(ref, fa_on),
        "ref_vs_f16_cache": stats(ref, f16kv),
        "exact_vs_ref": stats(exact, ref),
        "prompts": [p[0] for p in prompts],
    }
    with open(os.path.join(OUT, "smollm2_noise.json"), "w") as f:
        json.dump(noise, f, indent=2)
    tail = np.concatenate([1 - np.exp(top_k(r)[1]).sum(axis=1) for r in ref])
    print("probability mass outside the top %d: mean %.2e, max %.2e" % (TOPK, tail.mean(), tail.max()))
    print(json.dumps({k: (v["kl_mean"], v["top1_mean"]) for k, v in noise.items() if isinstance(v, dict)}))


def perplexity():
    kjv = open(os.path.join(CACHE, "texts", "kjv.txt"), encoding="utf-8").read()
    passage = kjv[:80000]
    path = os.path.join(OUT, "kjv_ppl.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write(passage)
    out = subprocess.run([os.environ["LLAMA_PERPLEXITY"], "-m", MODEL, "-f", path, "-c", "2048", "-b", "2048",
                          "-t", "2", "-lm", "none"], capture_output=True, text=True,
                         env=dict(os.environ, LD_LIBRARY_PATH=os.environ["LLAMA_CPP_LIB_PATH"]))
    log = out.stdout + out.stderr
    m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", log)
    n = re.search(r"tokenizing the input .*?\n.*?(\d+) tokens", log, re.S)
    chunks = re.search(r"calculating perplexity over (\d+) chunks", log)
    if not m:
        sys.exit("llama.cpp perplexity failed:\n" + log[-3000:])
    res = {"ppl": float(m.group(1)), "ppl_err": float(m.group(2)), "n_ctx": 2048,
           "chunks": int(chunks.group(1)) if chunks else None, "text": "kjv_ppl.txt",
           "tool": "llama.cpp perplexity (llama-cpp-python 0.3.36 sources), -c 2048 -t 2"}
    with open(os.path.join(OUT, "smollm2_ppl.json"), "w") as f:
        json.dump(res, f, indent=2)
    print("perplexity:", res)


def xorshift_tokens(n, n_vocab):
    # Mirrors test::random_model_tokens (tests/common/random_model.h).
    s = (99 * 2654435761 + 1) & 0xFFFFFFFF
    out = []
    for _ in range(n):
        s ^= (s << 13) & 0xFFFFFFFF
        s ^= s >> 17
        s ^= (s << 5) & 0xFFFFFFFF
        out.append(3 + s % (n_vocab - 3))
    return out


def random_models():
    tool = os.path.join(BUILD, "tests", "d2o_make_random_model")
    for name in ["qwen2", "llama-mha"]:
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, name + ".gguf")
            subprocess.run([tool, name, path], check=True)
            llm = llama(path, 128)
            n_vocab = llm.n_vocab()
            ids = xorshift_tokens(64, n_vocab)
            llm.eval(ids)
            logits = np.array(llm.scores[:len(ids)], dtype=np.float32)
            del llm
        with open(os.path.join(OUT, f"random_{name}.bin"), "wb") as f:
            f.write(b"D2OR")
            f.write(struct.pack("<2I", len(ids), n_vocab))
            f.write(np.array(ids, dtype=np.int32).tobytes())
            f.write(logits.tobytes())
        print(f"random {name}: {len(ids)} tokens x {n_vocab} logits, argmax of last {int(logits[-1].argmax())}")


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    what = sys.argv[1:] or ["logits", "ppl", "random"]
    if "logits" in what:
        real_model_logits()
    if "ppl" in what:
        perplexity()
    if "random" in what:
        random_models()
