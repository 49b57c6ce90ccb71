#!/usr/bin/env python3
"""Multi-turn chat load against a running OpenAI-compatible server (`d2o serve`, llama-server).

N clients each hold one conversation of T turns and run at the same time. A conversation opens
with a passage of a text (a document to talk about) and asks about it; every later turn sends the
whole history, as an OpenAI client does, plus the `session` id when --sessions is given (a
`d2o serve` extension; other servers ignore the field). Every answer is streamed, so that the time
to the first token and the gaps between tokens are measured at the client.

Printed per policy (--kv, sent as the `kv` field; without it the server's default), as a table
and, with --json, as JSON:
  - requests answered, refused with 503 (each retried after its Retry-After) and failed;
  - generated and prompt tokens (from `usage`), prompt tokens the server took from a kept cache;
  - tokens per second: generated tokens over the wall time of the whole load;
  - time to first token and inter-token latency, p50 and p95 (ms);
  - sampled from GET /metrics every --poll seconds: sequences decoded at once, conversations held
    (d2o: kept sessions; llama-server: its slots, from GET /slots, each of which keeps the
    cache of the last conversation it served) and KV bytes in use, max and mean.

--needle plants a fact in each conversation's document, as scripts/next_question.py does ("The
special magic number for WORD is NNNNNNN." at a seeded random sentence boundary, a word and a
number per conversation), and the last turn asks for it instead of a question about the passage
(with one turn, the document's own turn asks). A hit is the 7 digits in the answer; printed as
hits of conversations answered, and per conversation in the JSON (the answer, its prompt tokens
and those taken from a kept cache, `session_rebuilt` where the server says).

Standard library only. Example:
  scripts/serve_bench.py --url http://127.0.0.1:8080 --clients 32 --turns 4 \
      --kv full --kv d2o:budget=384 --sessions --json out.json
"""
import argparse
import http.client
import json
import os
import random
import re
import statistics
import sys
import threading
import time
import urllib.parse

# The needle, its question and what counts as a hit: scripts/next_question.py's (standard library
# at import; it needs the openai package only when run).
from next_question import NEEDLE, QUESTION, hit

QUESTIONS = [
    "Summarise the passage above in two sentences.",
    "Which person or thing does the passage mention first, and what is said about it?",
    "Quote one sentence from the passage that you find important and explain why.",
    "What question would you ask the author of this passage?",
    "Describe the tone of the passage in a few words.",
    "What happens at the end of the passage?",
]


def percentile(xs, p):
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


class Server:
    def __init__(self, url, api_key, timeout):
        u = urllib.parse.urlparse(url)
        if u.scheme != "http" or not u.hostname:
            raise SystemExit(f"serve_bench: --url must be http://HOST[:PORT], got '{url}'")
        self.host, self.port = u.hostname, u.port or 80
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = "Bearer " + api_key
        self.timeout = timeout

    def conn(self):
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def get(self, path):
        c = self.conn()
        try:
            c.request("GET", path, headers=self.headers)
            r = c.getresponse()
            return r.status, r.read().decode("utf-8", "replace")
        finally:
            c.close()


def read_passages(path, n, words):
    """n passages of `words` words each, from evenly spaced places of the text at `path`."""
    files = []
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".txt"))
    else:
        files = [path]
    toks = []
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            toks.extend(fh.read().split())
    if len(toks) < words:
        raise SystemExit(f"serve_bench: '{path}' has {len(toks)} words, fewer than --doc-words {words}")
    step = max(1, (len(toks) - words) // max(1, n))
    return [" ".join(toks[i * step:i * step + words]) for i in range(n)]


def plant_needles(passages, seed):
    """Each passage with one needle at a seeded random sentence boundary (conversation i uses
    seed*1000+i): the passages and, per conversation, the word, number and depth."""
    vocab = sorted({w for p in passages for w in re.findall(r"\b[a-z]{5,10}\b", p)})
    out, needles = [], []
    for i, p in enumerate(passages):
        rng = random.Random(seed * 1000 + i)
        word, number = rng.choice(vocab), str(rng.randint(1000000, 9999999))
        sentences = re.split(r"(?<=[.?!])\s+", p)
        at = rng.randint(0, len(sentences))
        out.append(" ".join(sentences[:at] + [NEEDLE.format(word=word, number=number)] + sentences[at:]))
        needles.append({"word": word, "number": number, "depth": round(at / len(sentences), 4)})
    return out, needles


def stream_chat(srv, body, result, headers=None):
    """One streamed chat request; fills result with text, usage, ttft and token gaps."""
    t0 = time.monotonic()
    c = srv.conn()
    try:
        c.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                  headers=dict(srv.headers, **(headers or {})))
        r = c.getresponse()
        result["status"] = r.status
        if r.status != 200:
            result["retry_after"] = r.getheader("Retry-After")
            result["error"] = r.read().decode("utf-8", "replace")[:300]
            return
        text, last, gaps, ttft, usage, finish = [], None, [], None, None, None
        while True:
            line = r.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            ev = json.loads(data)
            if ev.get("usage"):
                usage = ev["usage"]
            if "timings" in ev:
                result["timings"] = ev["timings"]
            if "session_rebuilt" in ev:
                result["session_rebuilt"] = ev["session_rebuilt"]
            for ch in ev.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content")
                if ch.get("finish_reason"):
                    finish = ch["finish_reason"]
                if piece:
                    now = time.monotonic()
                    if ttft is None:
                        ttft = now - t0
                    else:
                        gaps.append(now - last)
                    last = now
                    text.append(piece)
        result.update(text="".join(text), usage=usage, ttft=ttft, gaps=gaps, finish=finish,
                      seconds=time.monotonic() - t0)
    except (OSError, http.client.HTTPException, ValueError) as e:
        result["status"] = -1
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        c.close()


def needle_turn(args):
    """The turn (0: the document's) whose question asks for the needle."""
    return args.turns - 1 if args.needle_turn is None else args.needle_turn


def client(srv, args, idx, passage, policy, tag, out, errors, needle=None):
    sid = f"{tag}-{idx}"

    def question(turn):  # with a needle, its turn asks for it (the last unless --needle-turn)
        if needle and turn == needle_turn(args):
            return QUESTION.format(word=needle["word"])
        return QUESTIONS[turn % len(QUESTIONS)]

    messages = [{"role": "user", "content": passage + "\n\n" + question(0)}]
    for turn in range(args.turns):
        if turn > 0:
            messages.append({"role": "user", "content": question(turn)})
        body = {"model": args.model, "messages": messages, "max_tokens": args.max_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        if args.ignore_eos:
            body["ignore_eos"] = True
        if policy:
            body["kv"] = policy
        headers = {}
        if args.sessions:
            body["session"] = sid
            headers["X-Session-Id"] = sid  # for a load balancer in front (docs/SERVING.md)
        refused = 0
        while True:
            res = {}
            stream_chat(srv, body, res, headers)
            if res.get("status") == 503 and refused < args.max_retries:
                refused += 1
                try:
                    wait = float(res.get("retry_after") or 1)
                except ValueError:
                    wait = 1.0
                time.sleep(min(wait, 5.0))
                continue
            break
        res.update(client=idx, turn=turn, refused=refused)
        out.append(res)
        if res.get("status") != 200:
            errors.append(f"client {idx} turn {turn}: HTTP {res.get('status')}: {res.get('error')}")
            return
        messages.append({"role": "assistant", "content": res["text"]})


def parse_metrics(text):
    vals = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) < 2:
            continue
        name = parts[0].split("{")[0]
        try:
            vals[name] = vals.get(name, 0.0) + float(parts[-1])
        except ValueError:
            pass
    return vals


def poller(srv, args, stop, samples):
    while not stop.is_set():
        s = {"t": time.monotonic()}
        try:
            st, body = srv.get("/metrics")
            if st == 200:
                m = parse_metrics(body)
                if "d2o_sequences_running" in m:
                    s["running"] = m["d2o_sequences_running"]
                    s["held"] = m.get("d2o_sessions", 0.0)
                    s["kv_bytes"] = m.get("d2o_kv_allocated_bytes", 0.0)
                    s["kv_cap"] = m.get("d2o_kv_cap_bytes", 0.0)
                elif "llamacpp:requests_processing" in m:
                    s["running"] = m["llamacpp:requests_processing"]
            if "held" not in s:
                st, body = srv.get("/slots")
                if st == 200:
                    slots = json.loads(body)
                    # llama-server: each slot keeps the cache of the last conversation it served
                    # (with its host-memory prompt cache off, -cram 0), so it holds at most as
                    # many conversations as it has slots.
                    s["held"] = min(len(slots), args.clients)
                    s["slots"] = len(slots)
        except (OSError, http.client.HTTPException, ValueError):
            pass
        samples.append(s)
        stop.wait(args.poll)


def run_policy(srv, args, policy, passages, needles=None):
    tag = f"{args.tag}-{(policy or 'default').replace(':', '_').replace('=', '_').replace(',', '_')}"
    out, errors, samples = [], [], []
    stop = threading.Event()
    pt = threading.Thread(target=poller, args=(srv, args, stop, samples), daemon=True)
    pt.start()
    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(srv, args, i, passages[i], policy, tag, out, errors,
                                                     needles[i] if needles else None))
               for i in range(args.clients)]
    for t in threads:
        t.start()
        if args.stagger > 0:
            time.sleep(args.stagger)
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    stop.set()
    pt.join()
    ok = [r for r in out if r.get("status") == 200]
    gen = sum((r.get("usage") or {}).get("completion_tokens", 0) for r in ok)
    prompt = sum((r.get("usage") or {}).get("prompt_tokens", 0) for r in ok)
    cached = 0
    for r in ok:
        u = r.get("usage") or {}
        d = u.get("prompt_tokens_details") or {}
        if "cached_tokens" in d:
            cached += d["cached_tokens"]
        elif "timings" in r and "cache_n" in r["timings"]:
            cached += r["timings"]["cache_n"]
    ttft = [r["ttft"] * 1000 for r in ok if r.get("ttft") is not None]
    gaps = [g * 1000 for r in ok for g in r.get("gaps", [])]

    def stat(key):
        xs = [s[key] for s in samples if key in s]
        return (max(xs), statistics.fmean(xs)) if xs else (None, None)

    needle = None
    if needles:
        asked = sorted((r for r in ok if r["turn"] == needle_turn(args)), key=lambda r: r["client"])
        convs = []
        for r in asked:
            n = needles[r["client"]]
            u = r.get("usage") or {}
            convs.append(dict(client=r["client"], **n, answer=r.get("text"), hit=hit(r.get("text"), n["number"]),
                              prompt_tokens=u.get("prompt_tokens"),
                              cached_tokens=(u.get("prompt_tokens_details") or {}).get(
                                  "cached_tokens", (r.get("timings") or {}).get("cache_n")),
                              session_rebuilt=r.get("session_rebuilt")))
        needle = {"asked": len(convs), "hits": sum(c["hit"] for c in convs), "conversations": convs}
    run_max, run_mean = stat("running")
    held_max, held_mean = stat("held")
    kv_max, kv_mean = stat("kv_bytes")
    return {
        "policy": policy or "(server default)",
        "clients": args.clients, "turns": args.turns, "max_tokens": args.max_tokens,
        "requests": len(out), "ok": len(ok), "refused_503": sum(r.get("refused", 0) for r in out),
        "failed": len(out) - len(ok), "not_sent": args.clients * args.turns - len(out),
        "wall_s": wall, "generated_tokens": gen, "prompt_tokens": prompt, "cached_prompt_tokens": cached,
        "tokens_per_s": gen / wall if wall > 0 else 0.0,
        "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p95": percentile(ttft, 95),
        "itl_ms_p50": percentile(gaps, 50), "itl_ms_p95": percentile(gaps, 95),
        "running_max": run_max, "running_mean": run_mean,
        "held_max": held_max, "held_mean": held_mean,
        "kv_bytes_max": kv_max, "kv_bytes_mean": kv_mean,
        "kv_cap": next((s["kv_cap"] for s in samples if "kv_cap" in s), None),
        "slots": next((s["slots"] for s in samples if "slots" in s), None),
        "needle": needle,
        "errors": errors[:10],
    }


def fmt(v, f="{:.1f}"):
    return "-" if v is None or v != v else f.format(v)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", ""))
    ap.add_argument("--model", default="d2o", help="the request's model field")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--doc-words", type=int, default=900,
                    help="words of text opening each conversation (about 1.3 tokens each)")
    ap.add_argument("--text", default=None,
                    help="text file or directory of .txt files (default: $D2O_TEXT_DIR/pg, else kjv.txt)")
    ap.add_argument("--kv", action="append", default=[], help="policy spec sent as `kv`; repeat")
    ap.add_argument("--sessions", action="store_true",
                    help="send a `session` id per conversation (in the body and as X-Session-Id)")
    ap.add_argument("--tag", default=f"bench{os.getpid()}", help="prefix of the session ids")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="send ignore_eos (llama-server); d2o serve ignores the field")
    ap.add_argument("--needle", action="store_true",
                    help="plant a fact in each document and ask for it in the last turn (above)")
    ap.add_argument("--needle-seed", type=int, default=1, help="conversation i's needle uses seed*1000+i")
    ap.add_argument("--needle-turn", type=int, default=None,
                    help="the turn that asks for the needle, 0 being the document's (default: the "
                         "last; 1: right after the document, as scripts/next_question.py asks)")
    ap.add_argument("--stagger", type=float, default=0.0, help="seconds between client starts")
    ap.add_argument("--max-retries", type=int, default=600, help="503 answers retried per turn")
    ap.add_argument("--poll", type=float, default=0.25)
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--label", default="", help="name of this server in the output")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    if args.needle_turn is not None and not 0 <= args.needle_turn < args.turns:
        ap.error(f"--needle-turn must be in [0, {args.turns - 1}] (--turns {args.turns})")
    for name in ("clients", "turns", "max_tokens", "doc_words"):
        if getattr(args, name) < 1:
            raise SystemExit(f"serve_bench: --{name.replace('_', '-')} must be at least 1")
    text = args.text
    if text is None:
        base = os.environ.get("D2O_TEXT_DIR", os.path.join(os.path.dirname(__file__), "..", "cache", "texts"))
        text = os.path.join(base, "pg") if os.path.isdir(os.path.join(base, "pg")) else os.path.join(base, "kjv.txt")
    if not os.path.exists(text):
        raise SystemExit(f"serve_bench: no text at '{text}' (give --text)")
    srv = Server(args.url, args.api_key, args.timeout)
    try:
        st, _ = srv.get("/health")
    except OSError as e:
        raise SystemExit(f"serve_bench: cannot reach {args.url}: {e}")
    if st != 200:
        raise SystemExit(f"serve_bench: GET /health answered {st}")
    passages = read_passages(text, args.clients, args.doc_words)
    needles = None
    if args.needle:
        passages, needles = plant_needles(passages, args.needle_seed)
    results = [run_policy(srv, args, p, passages, needles) for p in (args.kv or [None])]

    hdr = ["policy", "ok", "503", "failed", "wall s", "gen tok", "tok/s", "prompt tok", "cached",
           "TTFT p50/p95 ms", "ITL p50/p95 ms", "decoding at once max/mean", "held max/mean", "KV MiB max"]
    if args.needle:
        hdr.append("needle hits")
    rows = []
    for r in results:
        rows.append([r["policy"], str(r["ok"]), str(r["refused_503"]), str(r["failed"]), fmt(r["wall_s"]),
                     str(r["generated_tokens"]), fmt(r["tokens_per_s"], "{:.2f}"), str(r["prompt_tokens"]),
                     str(r["cached_prompt_tokens"]),
                     fmt(r["ttft_ms_p50"], "{:.0f}") + " / " + fmt(r["ttft_ms_p95"], "{:.0f}"),
                     fmt(r["itl_ms_p50"], "{:.0f}") + " / " + fmt(r["itl_ms_p95"], "{:.0f}"),
                     fmt(r["running_max"], "{:.0f}") + " / " + fmt(r["running_mean"]),
                     fmt(r["held_max"], "{:.0f}") + " / " + fmt(r["held_mean"]),
                     fmt(None if r["kv_bytes_max"] is None else r["kv_bytes_max"] / 2**20)])
        if args.needle:
            rows[-1].append(f"{r['needle']['hits']}/{r['needle']['asked']}")
    title = f"{args.label or args.url}: {args.clients} clients x {args.turns} turns, max_tokens {args.max_tokens}"
    print(title)
    print("| " + " | ".join(hdr) + " |")
    print("|" + "---|" * len(hdr))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    for r in results:
        for e in r["errors"]:
            print(f"  {r['policy']}: {e}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"label": args.label, "url": args.url, "args": vars(args), "results": results}, fh, indent=1)
    return 1 if any(r["failed"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
