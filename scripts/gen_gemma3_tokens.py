#!/usr/bin/env python3
"""llama.cpp's token ids and detokenized text for the tokenizer corpus with the Gemma 3 vocabulary.
d2o's tokenizer tests (tests/unit/test_tokenizer_gemma3.cpp) compare against these outputs.

  gen_gemma3_tokens.py OUT_DIR

scripts/setup.sh --test-data runs it into $D2O_CACHE_DIR/test-data/tokenizer/gemma3 with the
llama.cpp build and Python bindings of $D2O_CACHE_DIR/llama.cpp (see gen_reference_fixtures.py)
and the model $D2O_CACHE_DIR/models/gemma-3-270m-q4_k_m.gguf (or $D2O_GEMMA_MODEL); only the
vocabulary is loaded (vocab_only), so it takes seconds.

Each corpus file tests/data/tokenizer/corpus_NAME.txt is a list of chunks separated by the line
"@@@@ d2o chunk @@@@"; every chunk is tokenized on its own by llama_tokenize with the model's
own BOS/EOS handling (add_special) and special tokens not parsed, as llama-tokenize
--no-parse-special does. Outputs:
  corpus_NAME.ids           one line of ids per chunk
  corpus_NAME.detok         llama_detokenize of those ids (remove_special and unparse_special
                            off), chunks separated as in the corpus
  corpus_edge.special.ids   corpus_edge.txt with special tokens parsed (and .detok with them
                            rendered)
  gemma3_extra.ids          tests/data/tokenizer/gemma3_extra.txt (Gemma's control and
                            user-defined tokens, whitespace runs, chat turns), and
                            gemma3_extra.special.ids with special tokens parsed (and .detok)
  bytes_invalid_utf8.ids    bytes that are not UTF-8 (and .detok)
  meta.json                 vocabulary size, special ids, add_bos/add_eos, the tool's version
"""
import ctypes
import glob
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.environ.get("D2O_CACHE_DIR", os.path.join(REPO, "cache"))
MODEL = os.environ.get("D2O_GEMMA_MODEL", os.path.join(CACHE, "models", "gemma-3-270m-q4_k_m.gguf"))
LLAMA_BIN = os.path.join(CACHE, "llama.cpp", "build", "bin")
DATA = os.path.join(REPO, "tests", "data", "tokenizer")
SEP = b"\n@@@@ d2o chunk @@@@\n"

if not os.path.isfile(os.path.join(LLAMA_BIN, "libllama.so")):
    sys.exit("no llama.cpp build in %s (scripts/setup.sh --test-data makes it)" % LLAMA_BIN)
if not os.path.isfile(MODEL):
    sys.exit("no Gemma 3 model at %s (scripts/setup.sh --gemma3 fetches it)" % MODEL)
os.environ["LLAMA_CPP_LIB_PATH"] = LLAMA_BIN  # where the bindings look for libllama
sys.path.insert(0, os.path.join(CACHE, "llama.cpp", "py"))
import llama_cpp  # noqa: E402

# llama.cpp's log lines (context set-up) would go to stderr, which setup.sh shows: dropped.
_quiet = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
llama_cpp.llama_log_set(_quiet, ctypes.c_void_p(0))


class Vocab:
    def __init__(self, path):
        self.llm = llama_cpp.Llama(path, vocab_only=True, verbose=False)
        self.vocab = self.llm._model.vocab

    def tokenize(self, text, parse_special):
        n_max = len(text) + 16  # at most one token per byte, plus BOS/EOS
        buf = (llama_cpp.llama_token * n_max)()
        n = llama_cpp.llama_tokenize(self.vocab, text, len(text), buf, n_max, True, parse_special)
        if n < 0:
            raise RuntimeError("llama_tokenize needs %d tokens" % -n)
        return list(buf[:n])

    def detokenize(self, ids, render_special):
        arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
        size = 64 * len(ids) + 64
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_detokenize(self.vocab, arr, len(ids), buf, size, False, render_special)
        if n < 0:
            raise RuntimeError("llama_detokenize needs %d bytes" % -n)
        return buf.raw[:n]


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    v = Vocab(MODEL)
    runs = [(os.path.basename(p)[:-4], p, False)
            for p in sorted(glob.glob(os.path.join(DATA, "corpus_*.txt")))]
    runs.append(("corpus_edge.special", os.path.join(DATA, "corpus_edge.txt"), True))
    runs.append(("gemma3_extra", os.path.join(DATA, "gemma3_extra.txt"), False))
    runs.append(("gemma3_extra.special", os.path.join(DATA, "gemma3_extra.txt"), True))
    runs.append(("bytes_invalid_utf8", os.path.join(DATA, "bytes_invalid_utf8.txt"), False))
    total_chunks = total_tokens = 0
    for name, src, special in runs:
        chunks = open(src, "rb").read().split(SEP)
        lines = ["# llama_tokenize ids, one line per chunk of %s (%s, add_special=true, "
                 "parse_special=%s)" % (os.path.basename(src), os.path.basename(MODEL),
                                        "true" if special else "false")]
        detok = []
        for c in chunks:
            ids = v.tokenize(c, special)
            lines.append(" ".join(map(str, ids)))
            detok.append(v.detokenize(ids, special))
            total_tokens += len(ids)
        total_chunks += len(chunks)
        with open(os.path.join(out_dir, name + ".ids"), "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(os.path.join(out_dir, name + ".detok"), "wb") as f:
            f.write(SEP.join(detok))
    vocab = v.vocab
    meta = {
        "model": os.path.basename(MODEL),
        "n_vocab": llama_cpp.llama_vocab_n_tokens(vocab),
        "bos": llama_cpp.llama_vocab_bos(vocab),
        "eos": llama_cpp.llama_vocab_eos(vocab),
        "eot": llama_cpp.llama_vocab_eot(vocab),
        "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
        "add_eos": bool(llama_cpp.llama_vocab_get_add_eos(vocab)),
        "eog": [t for t in range(llama_cpp.llama_vocab_n_tokens(vocab))
                if llama_cpp.llama_vocab_is_eog(vocab, t)],
        "chunks": total_chunks,
        "tokens": total_tokens,
        "tool": "llama.cpp (llama-cpp-python 0.3.36 sources): llama_tokenize, llama_detokenize",
    }
    with open(os.path.join(out_dir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    print("gemma3 tokens: %d chunks, %d tokens" % (total_chunks, total_tokens))


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        sys.exit(__doc__)
    main(sys.argv[1])
