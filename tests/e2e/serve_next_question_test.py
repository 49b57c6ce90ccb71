#!/usr/bin/env python3
"""scripts/next_question.py on a real `d2o serve`: the needle question in the same turn as the
document and in the next turn of the session, with the full cache and with `d2o:ratio=0.2` (the
preset as users get it: its cold tier on disk recalls, at the question's turn, what the
compaction of the document's turn evicted).

Usage: serve_next_question_test.py PATH_TO_D2O
Needs $D2O_MODEL (SmolLM2-135M-Instruct), the KJV text ($D2O_TEXT_DIR/kjv.txt) and the `openai`
package (scripts/setup.sh --test-data); exits 77 (skipped) without them.

Two trials of 600-token documents per policy (20-25 s on 2 cores). Checks that the JSON is well
formed, that both settings ran for every trial, that turn 2 of every `after` conversation was
served from its session, that the full cache finds the number in both settings and `d2o` in the
next turn (seed 1: SmolLM2 answers both trials right in both settings with the full cache, and
the first in the next turn with `d2o`, whose next-turn answers without its tier are wrong 49
times in 50 on 1,500-token documents; each check asks for one trial).
The long form, for people: scripts/next_question.py -t 2 --trials 50 (every default policy).
"""
import json
import os
import subprocess
import sys
import tempfile
import time

from serve_common import SKIP, check, fail, require_model

D2O = sys.argv[1]
MODEL = require_model()
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.join(HERE, "..", "..")
SCRIPT = os.path.join(REPO, "scripts", "next_question.py")
TEXT = os.path.join(os.environ.get("D2O_TEXT_DIR") or os.path.join(REPO, "cache", "texts"),
                    "kjv.txt")
CACHE = os.environ.get("D2O_CACHE_DIR") or os.path.join(REPO, "cache")

if not os.path.exists(TEXT):
    print(f"skipped: no KJV text at {TEXT} (scripts/setup.sh)")
    sys.exit(SKIP)
if subprocess.run([sys.executable, "-c", "import openai"], capture_output=True,
                  env=dict(os.environ, PYTHONPATH=os.path.join(CACHE, "pylib-openai"))).returncode:
    print("skipped: the openai package is not installed (scripts/setup.sh --test-data)")
    sys.exit(SKIP)

TRIALS = 2
with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "nq.json")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, SCRIPT, "--d2o", D2O, "-m", MODEL, "-t", "2",
                        "--trials", str(TRIALS), "--policies", "full;d2o:ratio=0.2",
                        "--doc-tokens", "600",
                        "--seed", "1", "--text", TEXT, "--timeout", "120", "--json", out],
                       capture_output=True, text=True, timeout=240)
    print(r.stdout)
    if r.returncode != 0:
        fail(f"next_question.py exited {r.returncode}:\n{r.stderr}")
    try:
        with open(out) as f:
            res = json.load(f)
    except (OSError, ValueError) as e:
        fail(f"the JSON is not readable: {e}")

p = res["params"]
POLICIES = ["full", "d2o:ratio=0.2"]
check(p["session_verified"] is True and p["policies"] == POLICIES and p["trials"] == TRIALS,
      f"parameters: {p}")
check(len(res["trials"]) == TRIALS * len(POLICIES),
      f"{len(res['trials'])} trial records, not {TRIALS * len(POLICIES)}")
for t in res["trials"]:
    name = f"{t['policy']} trial seed {t['seed']}"
    check(t["policy"] in POLICIES and len(t["number"]) == 7 and 0 <= t["depth"] <= 1,
          f"{name}: {t}")
    check(500 <= t["doc_tokens"] <= 600, f"{name}: a document of {t['doc_tokens']} tokens")
    for setting in ("before", "after"):
        s = t.get(setting)
        check(isinstance(s, dict) and isinstance(s.get("answer"), str) and
              isinstance(s.get("hit"), bool),
              f"{name}: setting '{setting}' missing or inconsistent: {s}")
    b, a = t["before"], t["after"]
    check(b["cached_tokens"] == 0 and b["prompt_tokens"] > t["doc_tokens"],
          f"{name}: 'before' was not one fresh request: {b}")
    # Turn 2 prefilled only itself: turn 1's prompt and reply came from the kept session.
    check(a["session_rebuilt"] is False and a["cached_tokens"] >= a["turn1"]["prompt_tokens"] >
          t["doc_tokens"] and a["prompt_tokens"] > a["cached_tokens"],
          f"{name}: turn 2 was not served from the session: {a}")
for s in res["summary"]:
    mine = [t for t in res["trials"] if t["policy"] == s["policy"]]
    check(len(mine) == TRIALS and s["hits_before"] == sum(t["before"]["hit"] for t in mine) and
          s["hits_after"] == sum(t["after"]["hit"] for t in mine), f"summary: {s}")
    check(f"| {s['policy']} |" in r.stdout, f"the table has no row for {s['policy']}")
full = [t for t in res["trials"] if t["policy"] == "full"]
both = [t["seed"] for t in full if t["before"]["hit"] and t["after"]["hit"]]
check(both, "the full cache found the number in both settings in no trial: " +
      json.dumps([(t["before"]["answer"], t["after"]["answer"]) for t in full]))
d2o = [t for t in res["trials"] if t["policy"] == "d2o:ratio=0.2"]
after = [t["seed"] for t in d2o if t["after"]["hit"]]
check(after, "d2o:ratio=0.2 found the number in the next turn in no trial: " +
      json.dumps([t["after"]["answer"] for t in d2o]))
print(f"OK: {TRIALS} trials x 2 settings x {len(POLICIES)} policies, sessions continued, full "
      f"cache right in both settings for seeds {both}, d2o in the next turn for seeds {after} "
      f"({time.monotonic() - t0:.1f} s)")
