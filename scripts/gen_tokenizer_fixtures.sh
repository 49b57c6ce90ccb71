#!/usr/bin/env bash
# Regenerates the tokenizer's expected ids (tests/data/tokenizer/*.ids, vocab_hashes.txt) with
# llama.cpp's llama-tokenize, the independent reference the tests compare against.
#
#   LLAMA_TOKENIZE=/path/to/llama-tokenize [D2O_MODEL=SmolLM2-135M-Instruct.Q4_1.gguf] \
#   [D2O_VOCAB_DIR=shared/data/vocab] [D2O_GEMMA_MODEL=gemma-3-270m-q4_k_m.gguf] \
#   scripts/gen_tokenizer_fixtures.sh
#
# The corpus itself comes from scripts/gen_tokenizer_corpus.py. Each corpus file is a list of
# chunks separated by the line "@@@@ d2o chunk @@@@"; every chunk is tokenized on its own with
# the model's default BOS/EOS handling, no escape processing and special-token parsing off
# (--no-parse-special), except the *.special.* outputs which parse special tokens.
# Outputs:
#   corpus_NAME.ids          SmolLM2: one line of ids per chunk of corpus_NAME.txt
#   corpus_edge.special.ids  SmolLM2, corpus_edge.txt with special tokens parsed
#   bytes_invalid_utf8.ids   SmolLM2, not-UTF-8 input (ids only; no round trip)
#   vocab_hashes.txt         for each llama.cpp vocab file (and Gemma 3 when D2O_GEMMA_MODEL is
#                            given: a SentencePiece vocabulary without prefix space) and corpus
#                            chunk: the token count and a 64-bit FNV-1a hash of the ids (int32
#                            little-endian), to keep the fixtures small
set -euo pipefail
: "${LLAMA_TOKENIZE:?set LLAMA_TOKENIZE to the llama-tokenize binary}"
here="$(cd "$(dirname "$0")/.." && pwd)"
export LD_LIBRARY_PATH="$(dirname "$LLAMA_TOKENIZE")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export D2O_MODEL="${D2O_MODEL:-$here/cache/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
if [ -z "${D2O_VOCAB_DIR:-}" ]; then
  D2O_VOCAB_DIR="$here/cache/vocab"  # scripts/setup.sh --test-data
  [ -f "$D2O_VOCAB_DIR/ggml-vocab-gpt-2.gguf" ] || D2O_VOCAB_DIR="$here/../shared/data/vocab"
fi
export D2O_VOCAB_DIR
export LLAMA_TOKENIZE ROOT="$here"

python3 - <<'EOF'
import glob, os, struct, subprocess, tempfile

root = os.environ["ROOT"]
data = os.path.join(root, "tests", "data", "tokenizer")
sep = b"\n@@@@ d2o chunk @@@@\n"

def chunks(path):
    return open(path, "rb").read().split(sep)

def tokenize(model, text, parse_special):
    with tempfile.NamedTemporaryFile() as f:
        f.write(text)
        f.flush()
        cmd = [os.environ["LLAMA_TOKENIZE"], "-m", model, "-f", f.name, "--ids", "--no-escape",
               "--log-disable"]
        if not parse_special:
            cmd.append("--no-parse-special")
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    line = [l for l in out.splitlines() if l.startswith("[")][-1]
    return [int(x) for x in line.strip("[]").split(",") if x.strip()]

def fnv64(ids):
    h = 0xcbf29ce484222325
    for b in struct.pack("<%di" % len(ids), *ids):
        h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return h

def write_ids(out_name, src, model, parse_special):
    lines = ["# llama-tokenize ids, one line per chunk of %s (%s, parse_special=%s)"
             % (os.path.basename(src), os.path.basename(model), parse_special)]
    for c in chunks(src):
        lines.append(" ".join(map(str, tokenize(model, c, parse_special))))
    with open(os.path.join(data, out_name), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(out_name, len(lines) - 1, "chunks")

smol = os.environ["D2O_MODEL"]
corpora = sorted(glob.glob(os.path.join(data, "corpus_*.txt")))
for src in corpora:
    write_ids(os.path.basename(src)[:-4] + ".ids", src, smol, False)
write_ids("corpus_edge.special.ids", os.path.join(data, "corpus_edge.txt"), smol, True)
write_ids("bytes_invalid_utf8.ids", os.path.join(data, "bytes_invalid_utf8.txt"), smol, False)

lines = ["# vocab corpus chunk n_tokens fnv1a64(ids as int32 LE); corpus names ending in"
         " .special were tokenized with special tokens parsed"]
runs = [(src, os.path.basename(src)[:-4], False) for src in corpora]
runs.append((os.path.join(data, "corpus_edge.txt"), "corpus_edge.special", True))
vocab_dir = os.environ["D2O_VOCAB_DIR"]
vocabs = [(v, os.path.join(vocab_dir, "ggml-vocab-%s.gguf" % v))
          for v in ["gpt-2", "llama-bpe", "qwen2", "llama-spm", "phi-3"]]
if os.environ.get("D2O_GEMMA_MODEL"):
    vocabs.append(("gemma3", os.environ["D2O_GEMMA_MODEL"]))
for vocab, model in vocabs:
    for src, run_name, parse_special in runs:
        for k, c in enumerate(chunks(src)):
            ids = tokenize(model, c, parse_special)
            lines.append("%s %s %d %d %016x" % (vocab, run_name, k, len(ids), fnv64(ids)))
    print(vocab, "done")
with open(os.path.join(data, "vocab_hashes.txt"), "w") as f:
    f.write("\n".join(lines) + "\n")
EOF
