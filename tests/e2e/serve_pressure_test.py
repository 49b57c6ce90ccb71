#!/usr/bin/env python3
"""`d2o serve --compress when-needed` under memory pressure, with a session directory.

Usage: serve_pressure_test.py PATH_TO_D2O [CLIENTS TURNS DOC_WORDS] [--json OUT] [--always]
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
  - the pressure was met by compression first: compression steps were taken and freed bytes.
--always runs the same load with `--compress always` for comparison (no compression step is then
expected). The default (ctest, label e2e) is a short form, 6 x 3 over 1,100-word passages; scripts/test.sh
--long runs 32 x 8 over 1,100-word passages (about 1,500 tokens) and prints its figures.
"""
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from serve_common import check, require_model, start_server

D2O = sys.argv[1]
MODEL = require_model()
ARGS = sys.argv[2:]
ALWAYS = "--always" in ARGS
ARGS = [a for a in ARGS if a != "--always"]
OUT = None
if "--json" in ARGS:
    OUT = ARGS[ARGS.index("--json") + 1]
    ARGS = ARGS[:ARGS.index("--json")] + ARGS[ARGS.index("--json") + 2:]
CLIENTS, TURNS, WORDS = (int(ARGS[0]), int(ARGS[1]), int(ARGS[2])) if len(ARGS) >= 3 else (6, 3, 1100)

# SmolLM2-135M: per token of a full cache, 30 layers x 3 KV heads x (a key and a value row of 64
# F16 and 20 bytes of slot metadata): KvCache::bytes_for_slots.
TOKEN_BYTES = 30 * 3 * (2 * 64 * 2 + 20)
CAP = 4 * 2048 * TOKEN_BYTES  # 4 full caches of 2,048 tokens: 188,743,680 bytes
REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


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


def main():
    sdir = tempfile.mkdtemp(prefix="d2o_pressure_")
    cmd = [D2O, "serve", "-m", MODEL, "--port", "0", "-c", "4096", "--kv", "d2o:budget=256",
           "--kv-mem", str(CAP), "--parallel", "8", "--queue", "64", "--chunk", "128",
           "--compress", "always" if ALWAYS else "when-needed", "--session-dir", sdir]
    proc, port, log, _ = start_server(cmd)
    samples, stop = [], threading.Event()
    poller = threading.Thread(target=poll, args=(port, stop, samples), daemon=True)
    poller.start()
    bench_json = os.path.join(sdir, "bench.json")
    t0 = time.monotonic()
    rc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "serve_bench.py"),
                         "--url", f"http://127.0.0.1:{port}", "--clients", str(CLIENTS),
                         "--turns", str(TURNS), "--doc-words", str(WORDS), "--max-tokens", "32",
                         "--sessions", "--poll", "0.1", "--tag", "pressure",
                         "--json", bench_json]).returncode
    wall = time.monotonic() - t0
    stop.set()
    poller.join()
    end = metrics(port)
    proc.terminate()
    proc.wait(timeout=60)
    with open(bench_json) as f:
        bench = json.load(f)["results"][0]

    reserved = max(s.get("d2o_kv_reserved_bytes", 0) for s in samples)
    allocated = max(s.get("d2o_kv_allocated_bytes", 0) for s in samples)
    lost = end.get('d2o_session_rebuilds_total{reason="lost"}', 0)
    rebuilt = {k.split('"')[1]: v for k, v in end.items()
               if k.startswith("d2o_session_rebuilds_total") and v > 0}
    figures = {
        "compress": "always" if ALWAYS else "when-needed", "clients": CLIENTS, "turns": TURNS, "doc_words": WORDS, "cap": CAP, "wall_s": wall,
        "samples": len(samples), "kv_reserved_max": reserved, "kv_allocated_max": allocated,
        "ok": bench["ok"], "requests": bench["requests"], "failed": bench["failed"],
        "tokens_per_s": bench["tokens_per_s"], "held_max": bench["held_max"],
        "held_mean": bench["held_mean"], "prompt_tokens": bench["prompt_tokens"],
        "cached_prompt_tokens": bench["cached_prompt_tokens"],
        "compress_steps": end.get("d2o_session_compress_steps_total", 0),
        "compress_freed_bytes": end.get("d2o_session_compress_freed_bytes_total", 0),
        "evicted": end.get("d2o_sessions_evicted_total", 0),
        "written_out": end.get("d2o_sessions_written_out_total", 0),
        "loaded": end.get("d2o_sessions_loaded_total", 0),
        "rebuilt": rebuilt, "rebuilt_lost": lost,
    }
    print(json.dumps(figures, indent=1))
    if OUT:
        with open(OUT, "w") as f:
            json.dump(figures, f, indent=1)
    check(rc == 0 and bench["failed"] == 0 and bench["not_sent"] == 0,
          f"every request answered 200 ({bench['errors']})")
    check(bench["ok"] == CLIENTS * TURNS, f"{bench['ok']} of {CLIENTS * TURNS} answered")
    check(len(samples) > 0, "/metrics was read during the load")
    check(reserved <= CAP and allocated <= CAP,
          f"KV bytes reserved {reserved:.0f} / allocated {allocated:.0f} within the cap {CAP}")
    check(lost == 0, f"no conversation lost ({lost} rebuilt as lost)")
    check(ALWAYS or (figures["compress_steps"] > 0 and figures["compress_freed_bytes"] > 0),
          "the pressure was met by compression steps first")
    print("OK")


if __name__ == "__main__":
    main()
