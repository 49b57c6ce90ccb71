#!/usr/bin/env python3
"""scripts/hostile_clients.py, short form, against the real SmolLM2 behind `d2o serve`.

Usage: serve_hostile_test.py PATH_TO_D2O
Needs $D2O_MODEL (SmolLM2-135M-Instruct); exits 77 (skipped) without it.

150 hostile connections for 10 s (trickling heads and bodies, silent, half-closed, unread streams,
and one address past --max-conn-per-addr) while 8 clients chat: every ordinary request answered, /health
p99 under a second, the greedy address's extra connections refused per address, trickling heads
and bodies answered 408, and every hostile connection closed by the server at the end.
"""
import json
import os
import subprocess
import sys
import tempfile

from serve_common import check, fail, require_model

D2O = sys.argv[1]
MODEL = require_model()
HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "..", "scripts", "hostile_clients.py")

with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "hostile.json")
    r = subprocess.run([sys.executable, SCRIPT, "--d2o", D2O, "-m", MODEL, "--connections", "150",
                        "--seconds", "10", "--warm-up", "2", "--request-timeout", "3",
                        "--max-conn-per-addr", "64", "--json", out], capture_output=True, text=True, timeout=280)
    print(r.stdout)
    if r.returncode != 0:
        fail(f"hostile_clients.py exited {r.returncode}: {r.stderr[-3000:]}")
    res = json.load(open(out))

o = res["ordinary"]
check(o["sent"] > 0 and o["answered"] == o["sent"] and o["failed"] == 0,
      f"ordinary requests: {o}")
check(res["health"]["count"] >= 20 and res["health"]["p99_ms"] < 1000, f"/health: {res['health']}")
refused = res["server"]["refused"]
check(refused["per_address"] >= 16, f"the greedy address was not bounded: {refused}")
# 503s the greedy address read: its 16 extra connections, and any pushed out of a full gate.
check(res["hostile"]["greedy_refused"] >= 16, f"greedy refusals seen: {res['hostile']}")
check(refused["header_timeout"] > 0, f"no trickling head timed out: {refused}")
check(refused["body_timeout"] > 0, f"no trickling body timed out: {refused}")
check(res["server"]["connections_open_after"] <= 2,
      f"connections left open after the load: {res['server']}")
check(res["server_alive"], "the server died")
print("ok")
