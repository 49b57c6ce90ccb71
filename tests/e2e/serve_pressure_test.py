#!/usr/bin/env python3
"""`d2o serve --compress when-needed` under memory pressure, with a session directory.

Usage: serve_pressure_test.py PATH_TO_D2O [CLIENTS TURNS DOC_WORDS] [--json OUT] [--always]
                              [--kv SPEC] [--needle [--needle-turn N] [--no-reference]]
Needs $D2O_MODEL (SmolLM2-135M-Instruct); exits 77 (skipped) without it.

The real SmolLM2 behind `d2o serve --kv d2o:budget=256 --compress when-needed --session-dir DIR`
with a cap of 4 full caches of 2,048 tokens (`--kv-mem`). scripts/serve_bench.py runs CLIENTS
conversations of TURNS turns at once (each opens with DOC_WORDS words of a text and asks a
question a turn, the whole history sent each turn with its session id), while this script reads
GET /metrics every 100 ms. Checks:
  - no conversation is lost: every request is answered 200, none is rebuilt because it was lost
    (`d2o_session_rebuilds_total{reason="lost"}` stays 0; a session read back from its file
    continues);
  - the cap holds: every sample of the KV bytes reserved and allocated is at most `--kv-mem`;
  - the pressure was met by compression first: compression steps were taken and freed bytes;
  - the queue moves: a run with requests queued, none running and none answered for 120 s is
    stopped and fails with the server's state (a stalled server).
--always runs the same load with `--compress always` for comparison (no compression step is then
expected). --kv SPEC serves another policy than d2o:budget=256 (e.g. `d2o`, the default).
--needle plants a fact in each conversation's document and asks for it in the last turn, or in
turn N with --needle-turn N (0 being the document's; 1: the next question, as
scripts/next_question.py asks it) (serve_bench.py --needle: scripts/next_question.py's needle and
question); the hits are printed
(not checked), and the same load then runs again on a fresh server with `--kv full` as the
reference (sessions written out and read back instead of compressed; the same checks but the
compression one), unless --no-reference. The default (ctest, label e2e) is a short form, 6 x 3
over 1,100-word passages; scripts/test.sh --long runs 32 x 8 over 1,100-word passages (about
1,500 tokens) with the needle, without the reference, and prints its figures (figures of both:
docs/results/pressure/README.md).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from serve_common import check, require_model, start_server

AP = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
AP.add_argument("d2o")
AP.add_argument("load", nargs="*", type=int, metavar="CLIENTS TURNS DOC_WORDS")
AP.add_argument("--json", default=None)
AP.add_argument("--always", action="store_true")
AP.add_argument("--kv", default="d2o:budget=256")
AP.add_argument("--needle", action="store_true")
AP.add_argument("--needle-turn", type=int, default=None)
AP.add_argument("--no-reference", action="store_true")
A = AP.parse_args()
if len(A.load) not in (0, 3):
    AP.error("give CLIENTS TURNS DOC_WORDS together, or none of them")
D2O = A.d2o
MODEL = require_model()
ALWAYS = A.always
OUT = A.json
CLIENTS, TURNS, WORDS = A.load if A.load else (6, 3, 1100)

# SmolLM2-135M: per token of a full cache, 30 layers x 3 KV heads x (a key and a value row of 64
# F16 and 20 bytes of slot metadata): KvCache::bytes_for_slots.
TOKEN_BYTES = 30 * 3 * (2 * 64 * 2 + 20)
CAP = 4 * 2048 * TOKEN_BYTES  # 4 full caches of 2,048 tokens: 203,489,280 bytes
REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
STALL_S = 120  # seconds with requests queued, none running and none answered: a stalled server


def metrics(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        vals = {}
        for line in r.read().decode().splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                vals[name] = float(value)
        return vals


def poll(port, stop, samples):
    while not stop.is_set():
        try:
            samples.append(metrics(port))
        except OSError:
            pass
        stop.wait(0.1)


def run(kv):
    """The load against a fresh server with policy kv; returns its figures and its checks."""
    sdir = tempfile.mkdtemp(prefix="d2o_pressure_")
    cmd = [D2O, "serve", "-m", MODEL, "--port", "0", "-c", "4096", "--kv", kv,
           "--kv-mem", str(CAP), "--parallel", "8", "--queue", "64", "--chunk", "128",
           "--compress", "always" if ALWAYS else "when-needed", "--session-dir", sdir]
    proc, port, log, _ = start_server(cmd)
    samples, stop = [], threading.Event()
    poller = threading.Thread(target=poll, args=(port, stop, samples), daemon=True)
    poller.start()
    bench_json = os.path.join(sdir, "bench.json")
    t0 = time.monotonic()
    bench_proc = subprocess.Popen([sys.executable, os.path.join(REPO, "scripts", "serve_bench.py"),
                                   "--url", f"http://127.0.0.1:{port}", "--clients", str(CLIENTS),
                                   "--turns", str(TURNS), "--doc-words", str(WORDS), "--max-tokens", "32",
                                   "--sessions", "--poll", "0.1", "--tag", "pressure",
                                   "--json", bench_json] + (["--needle"] if A.needle else [])
                                  + (["--needle-turn", str(A.needle_turn)] if A.needle_turn is not None else []))
    # A stall: requests queued, none running and none answered for STALL_S seconds. The load is
    # then stopped and the run fails with the server's state, rather than waiting for the
    # clients' own timeouts.
    stalled, last_ok, last_change = None, None, time.monotonic()
    while bench_proc.poll() is None:
        time.sleep(1)
        if not samples:
            continue
        m = samples[-1]
        ok = m.get('d2o_requests_total{outcome="ok"}')
        if ok != last_ok or m.get("d2o_sequences_running", 0) > 0 or m.get("d2o_sequences_queued", 0) == 0:
            last_ok, last_change = ok, time.monotonic()
        elif time.monotonic() - last_change > STALL_S:
            stalled = {k: m.get(k) for k in ('d2o_requests_total{outcome="ok"}', "d2o_sequences_running",
                                             "d2o_sequences_queued", "d2o_sessions", "d2o_kv_reserved_bytes",
                                             "d2o_kv_allocated_bytes", "d2o_kv_session_bytes")}
            stalled["seconds"] = STALL_S
            bench_proc.terminate()
            break
    rc = bench_proc.wait()
    wall = time.monotonic() - t0
    stop.set()
    poller.join()
    end = metrics(port)
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:  # a stalled server may not drain
        proc.kill()
        proc.wait()
    if stalled:
        figures = {"kv": kv, "clients": CLIENTS, "turns": TURNS, "doc_words": WORDS, "cap": CAP,
                   "server": cmd[1:], "wall_s": wall, "stalled": stalled}
        return figures, [(False, f"the server stalled: {stalled}")]
    with open(bench_json) as f:
        bench = json.load(f)["results"][0]

    reserved = max(s.get("d2o_kv_reserved_bytes", 0) for s in samples)
    allocated = max(s.get("d2o_kv_allocated_bytes", 0) for s in samples)
    lost = end.get('d2o_session_rebuilds_total{reason="lost"}', 0)
    rebuilt = {k.split('"')[1]: v for k, v in end.items()
               if k.startswith("d2o_session_rebuilds_total") and v > 0}
    figures = {
        "kv": kv, "compress": "always" if ALWAYS else "when-needed", "clients": CLIENTS, "turns": TURNS,
        "doc_words": WORDS, "cap": CAP, "wall_s": wall, "server": cmd[1:],
        "samples": len(samples), "kv_reserved_max": reserved, "kv_allocated_max": allocated,
        "ok": bench["ok"], "requests": bench["requests"], "failed": bench["failed"],
        "tokens_per_s": bench["tokens_per_s"], "generated_tokens": bench["generated_tokens"],
        "held_max": bench["held_max"], "held_mean": bench["held_mean"],
        "prompt_tokens": bench["prompt_tokens"],
        "cached_prompt_tokens": bench["cached_prompt_tokens"],
        "compress_steps": end.get("d2o_session_compress_steps_total", 0),
        "compress_freed_bytes": end.get("d2o_session_compress_freed_bytes_total", 0),
        "evicted": end.get("d2o_sessions_evicted_total", 0),
        "written_out": end.get("d2o_sessions_written_out_total", 0),
        "loaded": end.get("d2o_sessions_loaded_total", 0),
        "rebuilt": rebuilt, "rebuilt_lost": lost,
    }
    if A.needle:
        n = bench["needle"]
        figures["needle_hits"], figures["needle_asked"] = n["hits"], n["asked"]
        figures["needle"] = n["conversations"]
    checks = [
        (rc == 0 and bench["failed"] == 0 and bench["not_sent"] == 0,
         f"every request answered 200 ({bench['errors']})"),
        (bench["ok"] == CLIENTS * TURNS, f"{bench['ok']} of {CLIENTS * TURNS} answered"),
        (len(samples) > 0, "/metrics was read during the load"),
        (reserved <= CAP and allocated <= CAP,
         f"KV bytes reserved {reserved:.0f} / allocated {allocated:.0f} within the cap {CAP}"),
        (lost == 0, f"no conversation lost ({lost} rebuilt as lost)"),
        (ALWAYS or kv == "full" or (figures["compress_steps"] > 0 and figures["compress_freed_bytes"] > 0),
         "the pressure was met by compression steps first"),
    ]
    if A.needle:
        checks.append((figures["needle_asked"] == CLIENTS, f"the needle asked in {figures['needle_asked']} "
                       f"of {CLIENTS} conversations"))
    return figures, checks


def main():
    policies = [A.kv]
    if A.needle and not A.no_reference and A.kv != "full":
        policies.append("full")
    runs = []
    for kv in policies:
        runs.append(run(kv))
        out = runs[0][0] if len(policies) == 1 else {"runs": [f for f, _ in runs]}
        if OUT:  # after each run, so that a later run's failure keeps the earlier figures
            with open(OUT, "w") as f:
                json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))
    for f, _ in runs:
        if "stalled" in f:
            print(f"{f['kv']}: stalled after {f['wall_s']:.0f} s: {f['stalled']}")
            continue
        line = (f"{f['kv']}: {f['ok']}/{f['requests']} answered, {f['tokens_per_s']:.1f} tokens/s in "
                f"{f['wall_s']:.0f} s, KV bytes max {f['kv_reserved_max']:.0f} reserved / "
                f"{f['kv_allocated_max']:.0f} allocated of {CAP}, held {f['held_max']} max / "
                f"{f['held_mean']:.1f} mean, {f['written_out']:.0f} written out, {f['loaded']:.0f} read back")
        if A.needle:
            line += f", needle {f['needle_hits']}/{f['needle_asked']}"
        print(line)
    for f, checks in runs:
        for ok, msg in checks:
            check(ok, f"{f['kv']}: {msg}")
    print("OK")


if __name__ == "__main__":
    main()
