#!/usr/bin/env python3
"""scripts/session_kills.py, short form, against the real SmolLM2 behind `d2o serve`.

Usage: serve_session_kills_test.py PATH_TO_D2O
Needs $D2O_MODEL (SmolLM2-135M-Instruct); exits 77 (skipped) without it.

3 SIGKILLs at random moments around the session saves of 4 conversations (seed 1): after each, the next server
removes what a killed save left, and every conversation continued from its file gives the answer
of the same messages sent without a session. The long form (100 kills) is in
scripts/test.sh --long.
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
SCRIPT = os.path.join(HERE, "..", "..", "scripts", "session_kills.py")

with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "kills.json")
    r = subprocess.run([sys.executable, SCRIPT, "--d2o", D2O, "-m", MODEL, "--kills", "3",
                        "--seed", "1", "--json", out], capture_output=True, text=True,
                       timeout=280)
    print(r.stdout)
    if r.returncode != 0:
        fail("session_kills.py exited %d: %s" % (r.returncode, r.stderr[-3000:]))
    res = json.load(open(out))

check(res["kills"] == 3, "kills: %s" % res)
check(res["loaded_wrongly"] == 0 and res["tmp_after_start"] == 0, "files: %s" % res)
check(res["continued"] > 0, "no conversation continued from its file: %s" % res)
print("ok")
