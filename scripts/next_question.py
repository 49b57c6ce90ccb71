#!/usr/bin/env python3
"""Does a compressed chat session still hold the fact that its *next* question asks for?

A chat whose first turn is a long document has its KV cache compressed at the end of that turn,
before the question is known. This measures it: a needle ("The special magic number for WORD is
NNNNNNN.") at a random sentence boundary of a window of the KJV text, and, per KV policy and
trial, two settings on one `d2o serve` (the policy is the request's `kv` field):
  before: one fresh request holding the document and the question;
  after:  turn 1 the document (and a short instruction) in a session, turn 2 in the same session
          the question: the answer comes from the cache compressed after turn 1.
Chat models use /v1/chat/completions; --completions (base models, e.g. -m gemma3) sends the
document as a /v1/completions prompt, then that prompt extended by the question and an answer
prefix. Greedy; a hit is the needle's 7 digits in the answer. Turn 2 must be served from the
session (usage.prompt_tokens_details.cached_tokens covers turn 1, session_rebuilt false), or the
run fails. Documents are sized with the server's /tokenize, so a seed gives the same documents
for the same model. Prints a Markdown table (hits with 95% Wilson intervals); --json keeps every
trial. Needs the `openai` package (scripts/setup.sh --test-data). Example:
  scripts/next_question.py -t 1 --trials 20 --json /tmp/nq.json
"""
import argparse
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(os.environ.get("D2O_CACHE_DIR") or os.path.join(REPO, "cache"),
                                "pylib-openai"))

NEEDLE = "The special magic number for {word} is {number}."
QUESTION = "What is the special magic number for {word}? Answer with the number only."
INSTRUCTION = "Read this document; I will ask you a question about it next."
# --completions: the text appended to the document (no chat template to carry a question); the
# answer stops at the line's end, so that a base model's next made-up "Question:" is not read.
COMPLETION_QA = "Question: What is the special magic number for {word}?\nAnswer: The special magic number for {word} is"
DEFAULT_POLICIES = "full;d2o:ratio=0.2;snapkv:ratio=0.2;h2o:ratio=0.2"


class Failure(Exception):
    """An error that ends the run with its message (and the server's last lines)."""


class Server:
    """`d2o serve` on a free loopback port; stop() ends it whatever state it is in."""

    def __init__(self, args):
        cmd = [args.d2o, "serve", "--port", "0", "-t", str(args.threads), "-c", str(args.ctx),
               "--kv-mem", args.kv_mem, "--drain", "0", "--compress", args.compress,
               # (one client sizing its documents with /tokenize: no per-address rate bound)
               "--rate-per-addr", "0"]
        if args.model:
            cmd += ["-m", args.model]
        self.log, self.port, self.banner, found = [], None, "", threading.Event()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)

        def read():  # drains stderr for the server's whole life, so that the pipe never fills
            for line in self.proc.stderr:
                self.log.append(line)
                m = self.port is None and re.search(r"on http://127\.0\.0\.1:(\d+)", line)
                if m:
                    self.port, self.banner = int(m.group(1)), line.strip()
                    found.set()
            found.set()  # the server ended

        threading.Thread(target=read, daemon=True).start()
        found.wait(120)  # loading a model takes seconds; the port is announced last
        if self.port is None:
            try:
                why = f"exited with status {self.proc.wait(timeout=5)}"
            except subprocess.TimeoutExpired:
                why = "did not announce its port in 120 s"
            self.stop()
            raise Failure(f"the server {why}: " + "".join(self.log[-20:]).strip())
        self.base = f"http://127.0.0.1:{self.port}"

    def tokens(self, text):
        req = urllib.request.Request(self.base + "/tokenize", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"content": text, "add_special": False}).encode())
        with urllib.request.urlopen(req, timeout=60) as r:
            return len(json.load(r)["tokens"])

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def kjv_sentences(path):
    """The KJV as plain prose sentences: chapter headings and verse numbers dropped."""
    with open(path, encoding="utf-8", errors="replace") as f:
        blocks = f.read().split("\n\n")
    heading = re.compile(r"^\S.* \d+$")  # "Genesis 1", "1 Kings 3": a block's first line
    kept = []
    for b in blocks:
        lines = b.strip("\n").split("\n")
        if lines and heading.match(lines[0]):
            lines = lines[1:]
        kept.append(re.sub(r"^\s*\d+\s+", "", "\n".join(lines), flags=re.M))
    text = " ".join(" ".join(kept).split())
    return [s for s in re.split(r"(?<=[.?!])\s+", text) if s]


def make_trial(srv, sentences, words, doc_tokens, seed):
    """One seeded document: whole sentences from a random place, sized with the server's
    tokenizer to at most doc_tokens with the needle, the needle at a random sentence boundary."""
    rng = random.Random(seed)
    word, number = rng.choice(words), str(rng.randint(1000000, 9999999))
    needle = NEEDLE.format(word=word, number=number)
    budget = doc_tokens - srv.tokens(" " + needle)
    # Every sentence is at least one token, so doc_tokens of them always suffice.
    start = rng.randrange(len(sentences) - doc_tokens)
    lo, hi = 1, 2
    while srv.tokens(" ".join(sentences[start:start + hi])) <= budget:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # the most sentences that fit: lo fits, hi does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if srv.tokens(" ".join(sentences[start:start + mid])) <= budget else (lo, mid)
    hay = sentences[start:start + lo]
    at = rng.randint(0, len(hay))
    doc = " ".join(hay[:at] + [needle] + hay[at:])
    return {"seed": seed, "word": word, "number": number, "depth": round(at / len(hay), 4),
            "start_sentence": start, "doc_tokens": srv.tokens(doc), "doc": doc}


def hit(answer, number):
    # "1,234,567" or "1 234 567" count as the number too.
    return number in re.sub(r"(?<=\d)[,\s](?=\d)", "", answer or "")


def turn_info(r):
    """What a response says about its prompt and its session."""
    u = r.usage
    cached = (u.prompt_tokens_details.cached_tokens or 0) if u.prompt_tokens_details else 0
    extra = r.model_extra or {}
    return {"finish_reason": r.choices[0].finish_reason, "prompt_tokens": u.prompt_tokens,
            "cached_tokens": cached, "session_rebuilt": extra.get("session_rebuilt"),
            "session": extra.get("session")}


def run_trial(client, args, t, kv, tag):
    """Both settings of one trial under policy kv; returns the trial's record."""
    word = t["word"]
    question = QUESTION.format(word=word)
    qa = COMPLETION_QA.format(word=word)
    common = {"model": "d2o", "temperature": 0}

    def ask(session, max_tokens, **kw):
        body = {"kv": kv, "session": session}
        if args.completions:
            r = client.completions.create(max_tokens=max_tokens, extra_body=body, **common, **kw)
            return r.choices[0].text, r
        r = client.chat.completions.create(max_tokens=max_tokens, extra_body=body, **common, **kw)
        return r.choices[0].message.content, r

    rec = {k: v for k, v in t.items() if k != "doc"}
    rec["policy"] = kv
    # before: a fresh session, the question in the same request as the document.
    if args.completions:
        text, r = ask(f"{tag}-b", args.max_tokens, prompt=t["doc"] + "\n" + qa, stop="\n")
    else:
        text, r = ask(f"{tag}-b", args.max_tokens,
                      messages=[{"role": "user", "content": t["doc"] + "\n\n" + question}])
    rec["before"] = dict(answer=text, hit=hit(text, t["number"]), **turn_info(r))
    if rec["before"]["cached_tokens"] != 0:
        raise Failure(f"session {tag}-b was not fresh: {rec['before']}")
    # after: turn 1 ends with the cache compressed; turn 2 asks.
    if args.completions:
        # One token is sampled but never fed, so the session keeps exactly the prompt's tokens
        # (n_past), and the question's prompt extends them.
        reply, r1 = ask(f"{tag}-a", 1, prompt=t["doc"] + "\n")
        text, r2 = ask(f"{tag}-a", args.max_tokens, prompt=t["doc"] + "\n" + qa, stop="\n")
    else:
        msgs = [{"role": "user", "content": t["doc"] + "\n\n" + INSTRUCTION}]
        reply, r1 = ask(f"{tag}-a", args.reply_tokens, messages=msgs)
        msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": question}]
        text, r2 = ask(f"{tag}-a", args.max_tokens, messages=msgs)
    one, two = turn_info(r1), turn_info(r2)
    rec["after"] = {"reply": reply, "answer": text, "hit": hit(text, t["number"]), "turn1": one,
                    **two}
    # The point of the measurement: turn 2 must have come from turn 1's (compressed) cache.
    if two["session_rebuilt"] is not False or two["cached_tokens"] < one["prompt_tokens"]:
        raise Failure(f"turn 2 of session {tag}-a was not served from the session: turn 1 "
                      f"{one}, turn 2 {two}")
    return rec


def wilson(k, n, z=1.96):
    if n == 0:
        return 0.0, 1.0
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, c - h), min(1.0, c + h)


def cell(k, n):
    lo, hi = wilson(k, n)
    return f"{k}/{n} ({100 * k / n:.0f}%) [{100 * lo:.0f}-{100 * hi:.0f}%]"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d2o", default=os.path.join(REPO, "build", "d2o"), help="the d2o binary")
    ap.add_argument("-m", "--model", default=None, help="GGUF path or name (default: $D2O_MODEL, else d2o's default)")
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("-c", "--ctx", type=int, default=0, help="server context (default: --doc-tokens + 512)")
    ap.add_argument("--kv-mem", default="512M", help="the server's --kv-mem (sessions over it are dropped, LRU)")
    ap.add_argument("--compress", default="always", choices=["always", "when-needed"],
                    help="the server's --compress: always (default here: every session compressed "
                         "at the end of its turn, what this measures) or when-needed (sessions "
                         "stay full while --kv-mem allows)")
    ap.add_argument("--policies", default=DEFAULT_POLICIES, help="';'-separated KV policy specs")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1, help="trial i uses seed*1000+i")
    ap.add_argument("--doc-tokens", type=int, default=1500, help="document size, needle included")
    # 16 cut chat answers that restate the question ("The special magic number for kindreds is
    # 278404"): SmolLM2 writes a digit a token.
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens of the answer")
    ap.add_argument("--reply-tokens", type=int, default=16, help="tokens of the chat's turn-1 reply")
    ap.add_argument("--completions", action="store_true",
                    help="/v1/completions (base models without a chat template, e.g. -m gemma3)")
    ap.add_argument("--text", default=os.path.join(os.environ.get("D2O_TEXT_DIR") or os.path.join(REPO, "cache", "texts"), "kjv.txt"))
    ap.add_argument("--timeout", type=float, default=600, help="seconds per request at most")
    ap.add_argument("--json", default=None, help="write parameters and every trial here")
    args = ap.parse_args()
    policies = [p.strip() for p in args.policies.split(";") if p.strip()]
    if args.trials < 1 or not 64 <= args.doc_tokens <= 100000 or not policies:
        raise Failure("need --trials >= 1, --doc-tokens in 64..100000 and at least one policy")
    args.ctx = args.ctx or args.doc_tokens + 512
    if not os.access(args.d2o, os.X_OK):
        raise Failure(f"no d2o binary at '{args.d2o}' (build it, or give --d2o)")
    if not os.path.exists(args.text):
        raise Failure(f"no text at '{args.text}' (scripts/setup.sh fetches it; or give --text)")
    try:
        import openai
    except ImportError:
        raise Failure("the openai package is missing (scripts/setup.sh --test-data, or pip install openai)")

    sentences = kjv_sentences(args.text)
    # Deterministic vocabulary for the needle's word (sorted: set order varies between runs).
    words = sorted({w for s in sentences for w in re.findall(r"\b[a-z]{5,10}\b", s)})
    srv = Server(args)
    try:
        print(srv.banner, file=sys.stderr)
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0,
                               timeout=args.timeout)
        t0 = time.monotonic()
        trials = [make_trial(srv, sentences, words, args.doc_tokens, args.seed * 1000 + i)
                  for i in range(args.trials)]
        records = []
        for p, kv in enumerate(policies):
            for i, t in enumerate(trials):
                rec = run_trial(client, args, t, kv, f"nq{os.getpid()}-{p}-{i}")
                records.append(rec)
                print(f"{kv} trial {i}: before {'hit' if rec['before']['hit'] else 'miss'} "
                      f"{rec['before']['answer']!r}, after {'hit' if rec['after']['hit'] else 'miss'} "
                      f"{rec['after']['answer']!r}", file=sys.stderr)
    except (openai.OpenAIError, OSError) as e:
        raise Failure(f"request failed: {type(e).__name__}: {e}\nserver log tail:\n" + "".join(srv.log[-10:]))
    finally:
        srv.stop()

    summary = []
    for kv in policies:
        rs = [r for r in records if r["policy"] == kv]
        summary.append({"policy": kv, "n": len(rs), "hits_before": sum(r["before"]["hit"] for r in rs),
                        "hits_after": sum(r["after"]["hit"] for r in rs)})
    mean_tokens = sum(t["doc_tokens"] for t in trials) / len(trials)
    print(f"{args.trials} trials, seed {args.seed}, documents of {mean_tokens:.0f} tokens on average "
          f"({'completions' if args.completions else 'chat'}; {time.monotonic() - t0:.0f} s)")
    print("| policy | hits before (same turn) [95% CI] | hits after (next turn) [95% CI] |")
    print("|---|---|---|")
    for s in summary:
        print(f"| {s['policy']} | {cell(s['hits_before'], s['n'])} | {cell(s['hits_after'], s['n'])} |")
    if args.json:
        params = {k: v for k, v in vars(args).items() if k != "json"}
        params.update(policies=policies, needle=NEEDLE, question=QUESTION, instruction=INSTRUCTION,
                      completion_qa=COMPLETION_QA, server=srv.banner, session_verified=True,
                      token_counts="server /tokenize")
        with open(args.json, "w") as f:
            json.dump({"params": params, "summary": summary, "trials": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    # SIGTERM ends the run like Ctrl-C: the finally above stops the server.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("next_question: terminated"))
    try:
        sys.exit(main())
    except Failure as e:
        sys.exit(f"next_question: {e}")
    except KeyboardInterrupt:
        sys.exit("next_question: interrupted")
