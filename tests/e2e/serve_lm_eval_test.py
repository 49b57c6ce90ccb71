#!/usr/bin/env python3
"""lm-evaluation-harness (the PyPI `lm-eval` package) against `d2o serve`, fully offline.

Usage: serve_lm_eval_test.py PATH_TO_D2O [--docs N] [--kv SPEC ...]
Needs $D2O_MODEL (SmolLM2-135M-Instruct), $D2O_TEXT_DIR (kjv.txt) and lm-eval with the packages
its `local-completions` model imports in $D2O_CACHE_DIR/pylib-lmeval (scripts/setup.sh
--test-data installs them); exits 77 (skipped) without them.

Two tasks defined here from local files (a task YAML over a JSON-lines file, `dataset_path: json`),
their documents made from the King James Bible text with a fixed seed:
  d2o_next_word  (multiple choice, loglikelihood): a verse's first words; which of four words
                 comes next (the verse's own, or one of three taken from other verses)
  d2o_needle     (generate_until): a passage with one sentence "The secret number of NAME is N."
                 placed in it; asked for the number
lm-eval runs them through its `local-completions` model with the remote tokenizer backend
(d2o serve's /tokenizer_info, /tokenize, /detokenize; nothing is fetched: HF_HUB_OFFLINE=1,
HF_DATASETS_OFFLINE=1), batches of 4 prompts per request. The test then computes the same scores
itself through the server's own fields (/tokenize, and /v1/completions with echo and logprobs
for the choices, plain greedy completions for the answers) and requires lm-eval's accuracy and
exact-match, and every per-choice log-likelihood, to be exactly those. The log-probabilities
themselves are checked against llama.cpp by serve_logprobs_test.py.

--kv: run the tasks again with the server under each policy (the long form in
scripts/test.sh --long); the scores are printed next to the full cache's.

--package-dir DIR: the Python package d2o is in DIR (the release build's build/python): the same
scores are computed a third time through it (Model.nll for the choices, Model.generate for the
answers, the model loaded with the server's context and threads) and must equal lm-eval's too.
"""
import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import urllib.request

from serve_common import SKIP, check, fail, require_model, start_server

ap = argparse.ArgumentParser()
ap.add_argument("d2o")
ap.add_argument("--docs", type=int, default=12, help="documents per task")
ap.add_argument("--kv", action="append", default=[], help="also run under this policy")
ap.add_argument("--json", help="write the scores here")
ap.add_argument("--package-dir", help="also compute the scores through the Python package here")
args = ap.parse_args()

MODEL = require_model()
CACHE = os.environ.get("D2O_CACHE_DIR") or os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "cache")
LMEVAL_LIB = os.path.join(CACHE, "pylib-lmeval")
TEXT_DIR = os.environ.get("D2O_TEXT_DIR") or os.path.join(CACHE, "texts")
if not os.path.exists(os.path.join(TEXT_DIR, "kjv.txt")):
    print("skipped: no kjv.txt in $D2O_TEXT_DIR (scripts/setup.sh)")
    sys.exit(SKIP)
# lm-eval runs with only its folder on the path (-S: no site-packages), so that the test proves
# that folder holds everything its local-completions path imports.
probe = subprocess.run([sys.executable, "-S", "-c", "import lm_eval.evaluator, "
                        "lm_eval.models.openai_completions, requests, aiohttp, tenacity"],
                       env=dict(os.environ, PYTHONPATH=LMEVAL_LIB), capture_output=True, text=True)
if probe.returncode != 0:
    print("skipped: lm-eval is not installed in %s (scripts/setup.sh --test-data): %s"
          % (LMEVAL_LIB, probe.stderr.strip().splitlines()[-1:] or ""))
    sys.exit(SKIP)

NAMES = ["Abel", "Mara", "Ezra", "Nadab", "Ruth", "Silas", "Tamar", "Jonah", "Leah", "Omri"]


def verses():
    """The KJV's verses as plain strings (the file: book headings, then numbered verses)."""
    text = open(os.path.join(TEXT_DIR, "kjv.txt"), encoding="utf-8").read()
    out = []
    for m in re.finditer(r"^\s+\d+ (.+?)(?=^\s+\d+ |^\S|\Z)", text, re.M | re.S):
        out.append(" ".join(m.group(1).split()))
    return out


def make_docs(n, seed=51):
    rng = random.Random(seed)
    vs = [v for v in verses() if len(v.split()) >= 14 and re.fullmatch(r"[A-Za-z ,;:]+\.?", v)]
    picked = rng.sample(vs, n + 3 * n)
    next_word = []
    for i in range(n):
        words = picked[i].replace(",", "").replace(";", "").replace(":", "").split()
        k = rng.randint(6, 10)
        answer = words[k]
        others = []
        for v in picked[n + 3 * i:n + 3 * i + 3]:
            w = v.replace(",", "").replace(";", "").replace(":", "").split()
            cand = w[rng.randint(2, len(w) - 2)].rstrip(".")
            others.append(cand if cand != answer else cand + "s")
        choices = others + [answer]
        rng.shuffle(choices)
        next_word.append({"context": " ".join(words[:k]), "choices": choices,
                          "label": choices.index(answer)})
    needle = []
    for i in range(n):
        passage = " ".join(rng.sample(vs, 4))
        name, num = NAMES[i % len(NAMES)], str(rng.randint(1000, 9999))
        fact = "The secret number of %s is %s." % (name, num)
        sents = passage.split(". ")
        sents.insert(rng.randint(0, len(sents)), fact.rstrip("."))
        text = ". ".join(sents)
        needle.append({"question": "%s\nQuestion: What is the secret number of %s?\nAnswer:"
                       % (text, name), "answer": num})
    return next_word, needle


TASKS = {
    "d2o_next_word": """task: d2o_next_word
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/next_word.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""",
    "d2o_needle": """task: d2o_needle
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/needle.jsonl
test_split: test
output_type: generate_until
doc_to_text: question
doc_to_target: answer
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    regexes_to_ignore: [" "]
""",
}

RUNNER = r"""
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager
cfg = json.load(open(sys.argv[1]))
r = lm_eval.simple_evaluate(model="local-completions", model_args=cfg["model_args"],
                            tasks=cfg["tasks"], task_manager=TaskManager(include_path=cfg["dir"]),
                            log_samples=True, batch_size=4, random_seed=0, numpy_random_seed=0,
                            torch_random_seed=0, fewshot_random_seed=0)
out = {"version": lm_eval.__version__, "results": r["results"], "samples": {}}
for task, samples in r["samples"].items():
    out["samples"][task] = [{"doc_id": s["doc_id"], "resps": s["resps"],
                             "filtered_resps": s["filtered_resps"]} for s in samples]
json.dump(out, open(cfg["out"], "w"))
"""


class Server:
    def __init__(self, kv):
        self.proc, self.port, self.log, self.reader = start_server(
            [args.d2o, "serve", "-m", MODEL, "--port", "0", "-t", "2", "-c", "2048", "--kv-mem",
             "256M", "--kv", kv])
        self.base = "http://127.0.0.1:%d" % self.port

    def post(self, path, body):
        req = urllib.request.Request(self.base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())

    def tokenize(self, text):
        # As lm-eval's remote tokenizer asks: vLLM's shape, no special tokens added.
        return self.post("/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)


def run_lm_eval(srv, work):
    cfg = {"model_args": "model=d2o,base_url=%s/v1/completions,tokenizer_backend=remote,"
                         "max_length=2048,num_concurrent=1,max_retries=1,timeout=300" % srv.base,
           "tasks": sorted(TASKS), "dir": work, "out": os.path.join(work, "out.json")}
    with open(os.path.join(work, "cfg.json"), "w") as f:
        json.dump(cfg, f)
    with open(os.path.join(work, "runner.py"), "w") as f:
        f.write(RUNNER)
    env = dict(os.environ, PYTHONPATH=LMEVAL_LIB, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", HF_HOME=os.path.join(work, "hf"),
               HF_DATASETS_CACHE=os.path.join(work, "hf", "datasets"), TOKENIZERS_PARALLELISM="false")
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-S", os.path.join(work, "runner.py"),
                        os.path.join(work, "cfg.json")], env=env, capture_output=True, text=True)
    if p.returncode != 0:
        fail("lm-eval failed:\n" + p.stdout[-3000:] + p.stderr[-6000:])
    return json.load(open(cfg["out"])), time.monotonic() - t0


def independent(srv, next_word, needle):
    """The same scores through the server's own fields, as lm-eval defines them: a choice's
    log-likelihood is the sum of its continuation tokens' log-probabilities after the context
    (the continuation's tokens: those of context + " " + choice past the context's), the
    highest-scoring choice is the answer; an answer is the greedy completion of the question
    cut at the first stop string, compared with spaces removed."""
    lls, correct = [], 0
    for d in next_word:
        ctx = srv.tokenize(d["context"])
        scores = []
        for c in d["choices"]:
            whole = srv.tokenize(d["context"] + " " + c)
            check(whole[:len(ctx)] == ctx, "the context's tokens begin the whole's")
            r = srv.post("/v1/completions", {"prompt": whole, "max_tokens": 0, "echo": True,
                                             "logprobs": 1, "temperature": 0})
            scores.append(sum(r["choices"][0]["logprobs"]["token_logprobs"][len(ctx):]))
        lls.append(scores)
        correct += max(range(len(scores)), key=lambda i: scores[i]) == d["label"]
    hits = 0
    for d in needle:
        r = srv.post("/v1/completions", {"prompt": srv.tokenize(d["question"]), "max_tokens": 8,
                                         "temperature": 0, "stop": ["\n", ".", "<|im_end|>"]})
        hits += r["choices"][0]["text"].replace(" ", "") == d["answer"]
    return correct / len(next_word), hits / len(needle), lls


def through_package(model, kv, next_word, needle):
    """independent()'s scores through the Python package: the same tokens (the model's tokenizer
    without special tokens, as the server's /tokenize), each choice's log-likelihood the sum of
    its tokens' (Model.nll, passes cut as the server cuts them), the answers greedy under the
    same stop strings."""
    lls, correct = [], 0
    for d in next_word:
        ctx = model.tokenize(d["context"], add_special=False)
        scores = []
        for c in d["choices"]:
            whole = model.tokenize(d["context"] + " " + c, add_special=False)
            scores.append(-sum(model.nll(whole, kv=kv)[len(ctx) - 1:]))
        lls.append(scores)
        correct += max(range(len(scores)), key=lambda i: scores[i]) == d["label"]
    hits = 0
    for d in needle:
        r = model.generate(model.tokenize(d["question"], add_special=False), 8, kv=kv,
                           stop=["\n", ".", "<|im_end|>"], chunk=256)
        hits += r.text.replace(" ", "") == d["answer"]
    return correct / len(next_word), hits / len(needle), lls


def check_package(kv, acc, em, samples, next_word, needle):
    sys.path.insert(0, args.package_dir)
    import d2o  # noqa: E402 (the build's package, found only now)

    model = d2o.Model(MODEL, threads=2, ctx=2048)
    t0 = time.monotonic()
    p_acc, p_em, p_lls = through_package(model, kv, next_word, needle)
    print("kv=%s through the Python package: next-word acc %.4f, needle exact-match %.4f (%.1f s)"
          % (kv, p_acc, p_em, time.monotonic() - t0))
    check(p_acc == acc, "kv=%s: lm-eval's accuracy %.4f, the package's %.4f" % (kv, acc, p_acc))
    check(p_em == em, "kv=%s: lm-eval's exact match %.4f, the package's %.4f" % (kv, em, p_em))
    worst = 0.0
    for s, mine in zip(samples, p_lls):
        theirs = [r[0][0] for r in s["resps"]]
        worst = max([worst] + [abs(a - b) for a, b in zip(theirs, mine)])
    print("kv=%s: largest log-likelihood difference, lm-eval against the package: %.3g"
          % (kv, worst))
    check(worst <= 1e-5, "kv=%s: the package's log-likelihoods differ from lm-eval's by %.3g"
          % (kv, worst))


def main():
    next_word, needle = make_docs(args.docs)
    report = {"docs": args.docs, "runs": []}
    for kv in ["full"] + args.kv:
        with tempfile.TemporaryDirectory(prefix="d2o-lm-eval-") as work:
            for name, rows in (("next_word", next_word), ("needle", needle)):
                with open(os.path.join(work, name + ".jsonl"), "w") as f:
                    for r in rows:
                        f.write(json.dumps(r) + "\n")
            for task, yml in TASKS.items():
                with open(os.path.join(work, task + ".yaml"), "w") as f:
                    f.write(yml.format(dir=work))
            srv = Server(kv)
            try:
                out, secs = run_lm_eval(srv, work)
                acc = out["results"]["d2o_next_word"]["acc,none"]
                em = out["results"]["d2o_needle"]["exact_match,none"]
                t0 = time.monotonic()
                my_acc, my_em, my_lls = independent(srv, next_word, needle)
                my_secs = time.monotonic() - t0
            finally:
                srv.stop()
        print("lm-eval %s, kv=%s, %d docs per task: next-word acc %.4f (recomputed %.4f), needle "
              "exact-match %.4f (recomputed %.4f); lm-eval %.1f s, recomputation %.1f s"
              % (out["version"], kv, args.docs, acc, my_acc, em, my_em, secs, my_secs))
        report["runs"].append({"kv": kv, "acc": acc, "acc_recomputed": my_acc, "exact_match": em,
                               "exact_match_recomputed": my_em, "lm_eval_s": secs})
        check(acc == my_acc, "kv=%s: lm-eval's accuracy %.4f, recomputed %.4f" % (kv, acc, my_acc))
        check(em == my_em, "kv=%s: lm-eval's exact match %.4f, recomputed %.4f" % (kv, em, my_em))
        # Every choice's log-likelihood, as lm-eval summed it.
        samples = sorted(out["samples"]["d2o_next_word"], key=lambda s: s["doc_id"])
        check(len(samples) == len(next_word), "one sample per document")
        for s, mine in zip(samples, my_lls):
            theirs = [r[0][0] for r in s["resps"]]
            check(all(abs(a - b) <= 1e-9 for a, b in zip(theirs, mine)),
                  "doc %d: lm-eval's log-likelihoods %s, recomputed %s" % (s["doc_id"], theirs, mine))
        if args.package_dir:
            check_package(kv, acc, em, samples, next_word, needle)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print("ok")


if __name__ == "__main__":
    main()
