#!/usr/bin/env python3
"""What an independent implementation (llama.cpp) computes for the inputs the model tests use.
d2o's tests compare against these outputs; they never compare d2o with its own earlier output.

  gen_reference_fixtures.py OUT_DIR            the real-model references, written into OUT_DIR
  gen_reference_fixtures.py full-logits MODEL OUT
                                               llama.cpp's logits of a random-weight model for a
                                               fixed token sequence (the parity tests call this)

scripts/setup.sh --test-data builds llama.cpp from the llama-cpp-python source archive into
$D2O_CACHE_DIR/llama.cpp (build/bin: libllama; llama_ppl: scripts/ref/llama_ppl.cpp built against
it; py: the archive's Python bindings) and runs the first form into
$D2O_CACHE_DIR/test-data/reference. Python packages: numpy, gguf, and the bindings' jinja2, diskcache and typing_extensions (setup installs them into
$D2O_CACHE_DIR/pylib; put that on PYTHONPATH).

Outputs of the first form:
  smollm2_logits.bin   4 prompts x 512 positions: token ids and llama.cpp's top-k log-probs
                       (F32 KV cache, non-flash attention)
  smollm2_f32_logits.bin  the same on a copy of the model dequantised to F32 (exact arithmetic)
  smollm2_noise.json   llama.cpp's own spread: its flash-attention and F16-cache settings vs the
                       reference, and the Q4_1 model vs its exact F32 dequantisation
  smollm2_ppl.json     llama.cpp's perplexity of kjv_ppl.txt (context 2048)
  kjv_ppl.txt          the KJV passage (public domain) used for it
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
CACHE = os.environ.get("D2O_CACHE_DIR", os.path.join(REPO, "cache"))
MODEL = os.environ.get("D2O_MODEL", os.path.join(CACHE, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
LLAMA_BIN = os.path.join(CACHE, "llama.cpp", "build", "bin")
LLAMA_PPL = os.path.join(CACHE, "llama.cpp", "llama_ppl")  # scripts/ref/llama_ppl.cpp, built by set-up
TOPK = 40
N_POS = 512

if not os.path.isfile(os.path.join(LLAMA_BIN, "libllama.so")):
    sys.exit("no llama.cpp build in %s (scripts/setup.sh --test-data makes it)" % LLAMA_BIN)
os.environ["LLAMA_CPP_LIB_PATH"] = LLAMA_BIN  # where the bindings look for libllama
sys.path.insert(0, os.path.join(CACHE, "llama.cpp", "py"))
from llama_cpp import Llama  # noqa: E402


def llama(path, n_ctx):
    # F32 K/V cache and the plain (non-flash) attention path: llama.cpp's most precise setting, so
    # the comparison measures the model computation rather than either side's KV rounding. The
    # d2o tests run with an F32 cache too.
    return Llama(path, logits_all=True, n_ctx=n_ctx, n_batch=512, n_threads=2, verbose=False,
                 use_mmap=False, seed=0, flash_attn=False, type_k=0, type_v=0)


def corpus_text(name):
    # A text of the tokenizer corpus (tests/data/tokenizer), fixed test data of this repository.
    return open(os.path.join(REPO, "tests", "data", "tokenizer", name), encoding="utf-8").read()


def code_text():
    # C++ source (this project's own code, as frozen in the tokenizer corpus).
    return corpus_text("corpus_code.txt")


def austen_text():
    # Pride and Prejudice's first chapters (public domain).
    return corpus_text("corpus_austen.txt")


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
    """The TOPK most probable tokens per row, most probable first, ties to the lower id: the first
    TOPK of a stable argsort, found among the values >= each row's TOPK-th largest."""
    kth = -np.partition(-logp, TOPK - 1, axis=1)[:, TOPK - 1]
    top = np.empty((logp.shape[0], TOPK), dtype=np.int64)
    for r in range(logp.shape[0]):
        cand = np.flatnonzero(logp[r] >= kth[r])  # ascending ids
        top[r] = cand[np.argsort(-logp[r, cand], kind="stable")[:TOPK]]
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


def real_model_logits(out_dir):
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
    write_topk(os.path.join(out_dir, "smollm2_logits.bin"), all_ids, ref, n_vocab)
    write_topk(os.path.join(out_dir, "smollm2_f32_logits.bin"), all_ids, exact, n_vocab)

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
    with open(os.path.join(out_dir, "smollm2_noise.json"), "w") as f:
        json.dump(noise, f, indent=2)
    tail = np.concatenate([1 - np.exp(top_k(r)[1]).sum(axis=1) for r in ref])
    print("probability mass outside the top %d: mean %.2e, max %.2e" % (TOPK, tail.mean(), tail.max()))
    print(json.dumps({k: (v["kl_mean"], v["top1_mean"]) for k, v in noise.items() if isinstance(v, dict)}))


def llama_perplexity(model, text_path, n_ctx, threads=2):
    """llama.cpp's perplexity of a text file by llama-perplexity's protocol and defaults, computed
    by scripts/ref/llama_ppl.cpp over libllama (set-up compiles it next to the llama.cpp build).
    Returns (ppl, ppl_err, chunks)."""
    out = subprocess.run([LLAMA_PPL, model, text_path, str(n_ctx), str(threads)],
                         capture_output=True, text=True, env=dict(os.environ, LD_LIBRARY_PATH=LLAMA_BIN))
    log = out.stdout + out.stderr
    m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", log)
    chunks = re.search(r"calculating perplexity over (\d+) chunks", log)
    if out.returncode != 0 or not m or not chunks:
        sys.exit("llama.cpp perplexity failed:\n" + log[-3000:])
    return float(m.group(1)), float(m.group(2)), int(chunks.group(1))


PPL_TOOL = ("llama.cpp (llama-cpp-python 0.3.36 sources): libllama driven by scripts/ref/llama_ppl.cpp "
            "with llama-perplexity's protocol and defaults (batch = context, micro-batches of 512, "
            "F16 K/V cache, flash attention auto)")


def perplexity(out_dir):
    kjv = open(os.path.join(CACHE, "texts", "kjv.txt"), encoding="utf-8").read()
    passage = kjv[:25000]  # about 6.5K tokens: 3 chunks of 2048
    path = os.path.join(out_dir, "kjv_ppl.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write(passage)
    ppl, err, chunks = llama_perplexity(MODEL, path, 2048)
    res = {"ppl": ppl, "ppl_err": err, "n_ctx": 2048, "chunks": chunks, "text": "kjv_ppl.txt",
           "tool": PPL_TOOL + ", -c 2048 -t 2"}
    with open(os.path.join(out_dir, "smollm2_ppl.json"), "w") as f:
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


def full_logits(model, out):
    """llama.cpp's logits of `model` for 64 fixed tokens (test::random_model_tokens), as D2OR."""
    llm = llama(model, 128)
    n_vocab = llm.n_vocab()
    ids = xorshift_tokens(64, n_vocab)
    llm.eval(ids)
    logits = np.array(llm.scores[:len(ids)], dtype=np.float32)
    del llm
    with open(out, "wb") as f:
        f.write(b"D2OR")
        f.write(struct.pack("<2I", len(ids), n_vocab))
        f.write(np.array(ids, dtype=np.int32).tobytes())
        f.write(logits.tobytes())


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "full-logits":
        full_logits(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 2 and not sys.argv[1].startswith("-"):
        os.makedirs(sys.argv[1], exist_ok=True)
        real_model_logits(sys.argv[1])
        perplexity(sys.argv[1])
    else:
        sys.exit(__doc__)
