#!/usr/bin/env python3
"""scripts/serve_bench.py against a real `d2o serve`: its figures agree with the server's.

Usage: serve_bench_test.py PATH_TO_D2O
Needs $D2O_MODEL (SmolLM2-135M-Instruct); exits 77 (skipped) without it.

4 clients x 3 turns, two policies, sessions on. Checks that every request was answered, that
the later turns took their history from the kept sessions (cached prompt tokens, as the
server's counters say), that the token counts equal the server's counters, and that the
latencies and the sampled metrics are there.
"""
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

from serve_common import fail, require_model, start_server

D2O = sys.argv[1]
MODEL = require_model()
HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.join(HERE, "..", "..", "scripts", "serve_bench.py")


def metrics(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as r:
        text = r.read().decode()
    vals = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{")[0].split()[0]
            vals[name] = vals.get(name, 0.0) + float(line.split()[-1])
    return vals


with tempfile.TemporaryDirectory() as tmp:
    text = os.path.join(tmp, "text.txt")
    with open(text, "w") as f:
        f.write(" ".join(f"word{i % 97} of line {i}." for i in range(3000)))
    proc, port, log, _ = start_server([D2O, "serve", "-m", MODEL, "-t", "2", "-c", "1024",
                                       "--kv-mem", "128M", "--parallel", "8", "--port", "0"])
    try:
        out = os.path.join(tmp, "bench.json")
        r = subprocess.run([sys.executable, BENCH, "--url", f"http://127.0.0.1:{port}",
                            "--clients", "4", "--turns", "3", "--max-tokens", "8", "--doc-words", "120",
                            "--text", text, "--sessions", "--kv", "full", "--kv", "d2o:budget=64",
                            "--poll", "0.05", "--json", out], capture_output=True, text=True, timeout=600)
        print(r.stdout)
        if r.returncode != 0:
            fail(f"serve_bench exited {r.returncode}: {r.stderr}")
        res = json.load(open(out))["results"]
        # The server publishes its counters after each engine step: wait for the last one.
        deadline = time.monotonic() + 30
        while True:
            m = metrics(port)
            if m.get("d2o_requests_total", 0) >= 24 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    if [x["policy"] for x in res] != ["full", "d2o:budget=64"]:
        fail(f"policies: {[x['policy'] for x in res]}")
    gen = prompt = cached = 0
    for x in res:
        if x["ok"] != 12 or x["failed"] or x["not_sent"]:
            fail(f"{x['policy']}: {x['ok']} ok, {x['failed']} failed, {x['not_sent']} not sent")
        if x["generated_tokens"] < 12 or x["tokens_per_s"] <= 0:
            fail(f"{x['policy']}: {x['generated_tokens']} tokens, {x['tokens_per_s']} tok/s")
        # Turns 2 and 3 continue the session: at least the first turn's prompt is cached.
        if x["cached_prompt_tokens"] < 4 * 2 * 100:
            fail(f"{x['policy']}: only {x['cached_prompt_tokens']} prompt tokens from the sessions")
        for k in ("ttft_ms_p50", "ttft_ms_p95", "itl_ms_p50"):
            if not (x[k] > 0):
                fail(f"{x['policy']}: {k} = {x[k]}")
        if not x["held_max"] or x["held_max"] < 4 or not x["kv_bytes_max"]:
            fail(f"{x['policy']}: sampled metrics missing: {x}")
        gen += x["generated_tokens"]
        prompt += x["prompt_tokens"]
        cached += x["cached_prompt_tokens"]
    if gen != m.get("d2o_generated_tokens_total"):
        fail(f"generated tokens {gen} against the server's {m.get('d2o_generated_tokens_total')}")
    if prompt != m.get("d2o_prompt_tokens_total"):
        fail(f"prompt tokens {prompt} against the server's {m.get('d2o_prompt_tokens_total')}")
    if prompt - cached != m.get("d2o_prefilled_tokens_total"):
        fail(f"prefilled {prompt - cached} against the server's {m.get('d2o_prefilled_tokens_total')}")
    print(f"OK: 2 policies x 12 requests; {gen} tokens generated, {cached} of {prompt} prompt "
          "tokens from sessions, as the server counts them")
