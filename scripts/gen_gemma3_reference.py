#!/usr/bin/env python3
"""What llama.cpp computes with Gemma 3 270M, for the tests of d2o's Gemma 3 forward pass.
d2o's tests compare against these outputs; they never compare d2o with its own earlier output.

  gen_gemma3_reference.py OUT_DIR

scripts/setup.sh --test-data runs it into $D2O_CACHE_DIR/test-data/reference/gemma3 with the
llama.cpp build and bindings of $D2O_CACHE_DIR/llama.cpp and the helpers of
gen_reference_fixtures.py (the SmolLM2 references; same protocol), on
$D2O_CACHE_DIR/models/gemma-3-270m-q4_k_m.gguf (or $D2O_GEMMA_MODEL). Python packages as there.

Outputs:
  gemma3_logits.bin       4 prompts x 512 positions: token ids and llama.cpp's top-k log-probs
                          (F32 KV cache, non-flash attention), in the layout of
                          smollm2_logits.bin except that the top-k ids are uint32 (the vocabulary
                          has 262144 tokens): "D2OL", uint32 n_prompts, n_pos, top_k, n_vocab;
                          int32 ids [n_prompts][n_pos]; then per prompt and position the top_k ids
                          (uint32 when n_vocab > 65536, else uint16) and their log-probs (f32)
  gemma3_f32_logits.bin   the same on a copy of the model dequantised to F32 (exact arithmetic)
  gemma3_noise.json       llama.cpp's own spread: its flash-attention and F16-cache settings vs
                          the reference, and the quantised model vs its F32 dequantisation; also
                          the settings every file was made with
  gemma3_ppl.json         llama.cpp's perplexity of kjv_ppl.txt at context 4096
  kjv_ppl.txt             the KJV passage (public domain) used for it (80,000 characters;
                          SmolLM2's passage is its first half)

The prompts are SmolLM2's (gen_reference_fixtures.py): the KJV, Pride and Prejudice, C++ source,
and the same three-turn conversation, written in Gemma's turn format (<start_of_turn>user ...
<end_of_turn>, the system message in front of the first user turn, as Gemma 3's template does)
and tokenized with special tokens parsed. Gemma's vocabulary adds a BOS token (add_bos_token), so
every prompt starts with it (position 0), as llama.cpp's tools tokenize by default.
"""
import json
import os
import struct
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen_reference_fixtures as ref  # noqa: E402  (sets up the llama.cpp bindings)

MODEL = os.environ.get("D2O_GEMMA_MODEL",
                       os.path.join(ref.CACHE, "models", "gemma-3-270m-q4_k_m.gguf"))
N_POS = ref.N_POS
TOPK = ref.TOPK
PPL_CTX = 4096
THREADS = 2

SYSTEM = "You are a careful assistant who answers briefly."
TURNS = [
    ("What is the difference between a list and a tuple in Python? Give one example of each, and "
     "say when you would pick one over the other.",
     "A list is mutable: you can append, remove or change items, e.g. `xs = [1, 2, 3]; "
     "xs.append(4)`. A tuple is immutable once built, e.g. `point = (3, 4)`. Pick a tuple for "
     "fixed records and dictionary keys, a list for collections that change."),
    ("Translate 'good morning, how are you?' into French, German and Spanish, then count the "
     "words in each.",
     "French: « Bonjour, comment allez-vous ? » (3 words). German: „Guten Morgen, wie geht es "
     "dir?“ (6 words). Spanish: «Buenos días, ¿cómo estás?» (4 words)."),
    ("Now write a short poem of four lines about the sea at night, with the numbers 7, 42 and 1999 "
     "in it somewhere.", None),
]


def gemma_chat():
    """SmolLM2's conversation (ref.CHAT) in Gemma 3's turn format."""
    out = ""
    for k, (user, model) in enumerate(TURNS):
        text = SYSTEM + "\n\n" + user if k == 0 else user
        out += "<start_of_turn>user\n" + text + "<end_of_turn>\n<start_of_turn>model\n"
        if model is not None:
            out += model + "<end_of_turn>\n"
    return out


def load(path, **kw):
    from llama_cpp import Llama
    return Llama(path, logits_all=True, n_ctx=N_POS, n_batch=512, n_threads=THREADS, verbose=False,
                 use_mmap=False, seed=0, **kw)


def logp_rows(m, ids):
    m.reset()
    m.eval(ids)
    return ref.log_softmax(np.array(m.scores[:N_POS], dtype=np.float64))


def write_topk(path, all_ids, tops, n_vocab):
    id_type = np.uint32 if n_vocab > 65536 else np.uint16
    with open(path, "wb") as f:
        f.write(b"D2OL")
        f.write(struct.pack("<4I", len(all_ids), N_POS, TOPK, n_vocab))
        for ids in all_ids:
            f.write(np.array(ids, dtype=np.int32).tobytes())
        for top, lp in tops:
            for p in range(N_POS):
                f.write(top[p].astype(id_type).tobytes())
                f.write(lp[p].astype(np.float32).tobytes())


def kl_top(a_lp, b_lp_at_a_top):
    """Bucketed KL(a || b) per position from a's top-k log-probs and b's log-probs of the same
    tokens: the formula of ref.bucketed_kl (and of the C++ tests)."""
    p, q = np.exp(a_lp), np.exp(b_lp_at_a_top)
    p_rest = np.maximum(1e-12, 1 - p.sum(axis=1))
    q_rest = np.maximum(1e-12, 1 - q.sum(axis=1))
    return (p * (a_lp - b_lp_at_a_top)).sum(axis=1) + p_rest * np.log(p_rest / q_rest)


def real_model_logits(out_dir):
    kjv = open(os.path.join(ref.CACHE, "texts", "kjv.txt"), encoding="utf-8").read()
    austen = ref.austen_text()
    start = austen.find("It is a truth universally acknowledged")
    prompts = [("kjv", kjv[:8000], False), ("austen", austen[start:start + 8000], False),
               ("code", ref.code_text(), False), ("chat", gemma_chat() * 3, True)]
    from llama_cpp import Llama
    tok = Llama(MODEL, vocab_only=True, verbose=False)
    n_vocab = tok.n_vocab()
    all_ids = []
    for name, text, special in prompts:
        ids = tok.tokenize(text.encode("utf-8"), add_bos=True, special=special)
        assert len(ids) >= N_POS, (name, len(ids))
        all_ids.append(ids[:N_POS])
    del tok

    # One setting at a time, one prompt at a time: a full row of log-probs is 262144 wide, so only
    # what the outputs need is kept (top-k of the reference and of the exact run, the other
    # settings' log-probs of those tokens, arg-maxes).
    settings = {
        "ref": dict(flash_attn=False, type_k=0, type_v=0),  # the reference setting
        "flash_attn": dict(flash_attn=True, type_k=0, type_v=0),  # llama.cpp's other kernel
        "f16_cache": dict(flash_attn=False),  # llama.cpp's default cache type
    }
    with tempfile.TemporaryDirectory(dir=out_dir) as d:
        f32_path = os.path.join(d, "f32.gguf")
        ref.to_f32_gguf(MODEL, f32_path)
        m = load(f32_path, flash_attn=False, type_k=0, type_v=0)
        exact = []  # (top ids, top log-probs, argmax) per prompt
        for ids in all_ids:
            lp = logp_rows(m, ids)
            top, tlp = ref.top_k(lp)
            exact.append((top, tlp, lp.argmax(axis=1)))
            del lp
        del m
    out = {}
    for name, kw in settings.items():
        m = load(MODEL, **kw)
        rows = []
        for k, ids in enumerate(all_ids):
            lp = logp_rows(m, ids)
            entry = {"argmax": lp.argmax(axis=1)}
            if name == "ref":
                entry["top"] = ref.top_k(lp)
                entry["at_exact_top"] = np.take_along_axis(lp, exact[k][0], axis=1)
            else:
                entry["at_ref_top"] = np.take_along_axis(lp, out["ref"][k]["top"][0], axis=1)
            rows.append(entry)
            del lp
        out[name] = rows
        del m

    write_topk(os.path.join(out_dir, "gemma3_logits.bin"), all_ids,
               [r["top"] for r in out["ref"]], n_vocab)
    write_topk(os.path.join(out_dir, "gemma3_f32_logits.bin"), all_ids,
               [(e[0], e[1]) for e in exact], n_vocab)

    def stats(kl, top1):
        kl = [float(x.mean()) for x in kl]
        top1 = [float(x.mean()) for x in top1]
        return {"kl": kl, "top1": top1, "kl_mean": float(np.mean(kl)), "top1_mean": float(np.mean(top1))}

    r = out["ref"]
    noise = {
        "what": "bucketed KL(a || b) (top-%d + rest) and top-1 agreement per prompt" % TOPK,
        "ref_vs_flash_attn": stats([kl_top(r[k]["top"][1], out["flash_attn"][k]["at_ref_top"]) for k in range(4)],
                                   [r[k]["argmax"] == out["flash_attn"][k]["argmax"] for k in range(4)]),
        "ref_vs_f16_cache": stats([kl_top(r[k]["top"][1], out["f16_cache"][k]["at_ref_top"]) for k in range(4)],
                                  [r[k]["argmax"] == out["f16_cache"][k]["argmax"] for k in range(4)]),
        "exact_vs_ref": stats([kl_top(exact[k][1], r[k]["at_exact_top"]) for k in range(4)],
                              [exact[k][2] == r[k]["argmax"] for k in range(4)]),
        "prompts": [p[0] for p in prompts],
        "settings": {
            "model": os.path.basename(MODEL),
            "tool": "llama.cpp (llama-cpp-python 0.3.36 sources and bindings)",
            "n_ctx": N_POS, "n_batch": 512, "n_threads": THREADS, "top_k": TOPK,
            "top_k_id_type": "uint32",
            "tokenize": "add_bos=true (the vocabulary's add_bos_token); special tokens parsed for "
                        "'chat' only; the first 512 tokens",
            "reference": "F32 K/V cache, flash_attn off (gemma3_logits.bin)",
            "exact": "every tensor dequantised to F32 by the gguf package, F32 K/V cache, flash_attn "
                     "off (gemma3_f32_logits.bin)",
            "flash_attn": "F32 K/V cache, flash_attn on", "f16_cache": "F16 K/V cache, flash_attn off",
        },
    }
    with open(os.path.join(out_dir, "gemma3_noise.json"), "w") as f:
        json.dump(noise, f, indent=2)
    tail = np.concatenate([1 - np.exp(e["top"][1]).sum(axis=1) for e in r])
    print("probability mass outside the top %d: mean %.2e, max %.2e" % (TOPK, tail.mean(), tail.max()))
    print(json.dumps({k: (v["kl_mean"], v["top1_mean"]) for k, v in noise.items()
                      if isinstance(v, dict) and "kl_mean" in v}))


def perplexity(out_dir):
    kjv = open(os.path.join(ref.CACHE, "texts", "kjv.txt"), encoding="utf-8").read()
    passage = kjv[:80000]  # about 20K tokens of the KJV text (SmolLM2's passage is its first half)
    path = os.path.join(out_dir, "kjv_ppl.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write(passage)
    ppl, err, chunks = ref.llama_perplexity(MODEL, path, PPL_CTX, THREADS)
    res = {"ppl": ppl, "ppl_err": err, "n_ctx": PPL_CTX, "chunks": chunks, "text": "kjv_ppl.txt",
           "model": os.path.basename(MODEL),
           "tool": ref.PPL_TOOL + ", -c %d -t %d" % (PPL_CTX, THREADS),
           "protocol": "chunks of n_ctx tokens, each starting with BOS; the NLL of the second half "
                       "of each chunk; default K/V cache type and attention path"}
    with open(os.path.join(out_dir, "gemma3_ppl.json"), "w") as f:
        json.dump(res, f, indent=2)
    print("perplexity:", res)


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        sys.exit(__doc__)
    if not os.path.isfile(MODEL):
        sys.exit("no Gemma 3 model at %s (scripts/setup.sh --gemma3 fetches it)" % MODEL)
    os.makedirs(sys.argv[1], exist_ok=True)
    perplexity(sys.argv[1])
    real_model_logits(sys.argv[1])
