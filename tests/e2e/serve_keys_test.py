#!/usr/bin/env python3
"""End-to-end test of `d2o serve --api-key-file`: each key's sessions are its own.

Usage: serve_keys_test.py PATH_TO_D2O [ATTEMPTS]
Needs $D2O_MODEL (SmolLM2-135M-Instruct); exits 77 (skipped) without it.

First the start-up refusals (a bad key file names its line, --api-key with --api-key-file, an
unknown --admin-key-name), which come before the model loads. Then one server with three keys
(alice, bob, and ops, the admin) and a --session-dir: no key or a wrong one is a 401; Bob, naming
the session id Alice's conversation runs under, gets a fresh session (nothing taken from her
cache, not "rebuilt") whose response is exactly the one of an id never used but for the id and
time fields, and the answer of a question only her history answers is the one Bob gets without
it; Alice's conversation goes on untouched; each key's session is a file of its own; /metrics
answers the admin key only (403 for Alice) and counts per key name. Then ATTEMPTS (default 10;
scripts/test.sh --long: 100) more of Bob's tries at Alice's ids: she opens a conversation holding
a secret number, and Bob names its id, asking for the number (even attempts) or sending her very
messages (odd ones): each time his response is the one he gets on an id never used (greedy, text
and usage), nothing cached, not "rebuilt", the number absent when he did not send it; and every
tenth time Alice's conversation then goes on from her cache.
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from serve_common import check, fail, require_model, start_server


D2O = sys.argv[1]
MODEL = require_model()
KEYS = {"alice": "alice-0123456789abcdef", "bob": "bob-0123456789abcdef01",
        "ops": "ops-0123456789abcdef012"}
N = 8  # tokens per greedy answer
ATTEMPTS = int(sys.argv[2]) if len(sys.argv) > 2 else 10


def refused_at_start(args, want):
    """`d2o serve ARGS` exits non-zero at once, saying `want` on stderr."""
    r = subprocess.run([D2O, "serve", "-m", MODEL, "--port", "0", *args], capture_output=True,
                       text=True, timeout=60)
    check(r.returncode != 0, "%s: exit status %d, not an error" % (args, r.returncode))
    check(want in r.stderr, "%s: stderr %r does not say %r" % (args, r.stderr, want))


def request(port, method, path, key=None, body=None):
    """(status, parsed JSON or text) of one request with `key` as the bearer key."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = "Bearer " + key
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method, headers=headers,
                                 data=json.dumps(body).encode() if body is not None else None)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            st, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        st, raw = e.code, e.read()
    try:
        return st, json.loads(raw)
    except ValueError:
        return st, raw.decode()


def chat(port, who, session, messages):
    st, r = request(port, "POST", "/v1/chat/completions", KEYS[who],
                    {"messages": messages, "max_tokens": N, "temperature": 0, "kv": "full",
                     "session": session})
    check(st == 200, "%s on %s: status %d: %s" % (who, session, st, r))
    return r


def cached(r):
    return r["usage"]["prompt_tokens_details"]["cached_tokens"]


def shape(r):
    """The response but what differs between any two requests: its id, its time, the session id."""
    r = json.loads(json.dumps(r))
    del r["id"], r["created"]
    del r["session"]["id"]
    return r


def attempts(port, n):
    """n of Bob's tries at Alice's session ids (see the module's doc)."""
    t0 = time.monotonic()
    revealed = continued = 0
    for i in range(n):
        secret = str(40000 + 7919 * i)
        sid = "x%d" % i
        conv = [{"role": "user", "content": "My secret number is %s. Reply with OK." % secret}]
        a = chat(port, "alice", sid, conv)
        conv += [{"role": "assistant", "content": a["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "What is my secret number?"}]
        bob = conv if i % 2 else conv[2:]  # her whole conversation, or only the question
        b = chat(port, "bob", sid, bob)
        fresh = chat(port, "bob", "unused-%d" % i, bob)
        check(cached(b) == 0 and b["session"]["rebuilt"] is False and b["session"]["id"] == sid,
              "attempt %d: bob on alice's id is a fresh session: %s" % (i, b["session"]))
        check(shape(b) == shape(fresh),
              "attempt %d: bob on alice's id answers as on an unused id:\n%s\n%s" %
              (i, shape(b), shape(fresh)))
        text = b["choices"][0]["message"]["content"]
        if not i % 2 and secret in text:
            revealed += 1
        if i % 10 == 0:
            a2 = chat(port, "alice", sid, conv)
            check(cached(a2) > 0 and not a2["session"]["rebuilt"],
                  "attempt %d: alice's conversation goes on: %s" % (i, a2["session"]))
            continued += 1
    check(revealed == 0, "%d of bob's answers hold alice's secret number" % revealed)
    print("%d attempts by bob on alice's session ids: every answer that of an unused id, "
          "nothing cached, %d secrets revealed; alice went on %d times (%.1f s)" %
          (n, revealed, continued, time.monotonic() - t0))


def main():
    tmp = tempfile.mkdtemp(prefix="d2o-keys-")
    keyfile = os.path.join(tmp, "keys")
    with open(keyfile, "w") as f:
        f.write("# name:key\nalice:%s\n\nbob:%s\nops:%s\n" %
                (KEYS["alice"], KEYS["bob"], KEYS["ops"]))
    os.chmod(keyfile, 0o600)  # (a file others can read is served, with a warning)
    bad = os.path.join(tmp, "bad")
    with open(bad, "w") as f:
        f.write("alice:%s\nbob:short\n" % KEYS["alice"])
    refused_at_start(["--api-key-file", bad], bad + ":2: the key of 'bob' has 5 characters")
    refused_at_start(["--api-key-file", os.path.join(tmp, "none")], "cannot read it")
    refused_at_start(["--api-key-file", keyfile, "--api-key", KEYS["alice"]], "excludes")
    refused_at_start(["--api-key-file", keyfile, "--admin-key-name", "root"],
                     "--admin-key-name root: no key of that name")

    sessions = os.path.join(tmp, "sessions")
    proc, port, log, reader = start_server(
        [D2O, "serve", "-m", MODEL, "--port", "0", "-t", "2", "-c", "1024", "--kv-mem", "64M",
         "--parallel", "2", "--api-key-file", keyfile, "--admin-key-name", "ops",
         "--session-dir", sessions])
    try:
        st, r = request(port, "GET", "/v1/models")
        check(st == 401 and r["error"]["code"] == "missing_api_key", "no key: %d %s" % (st, r))
        st, r = request(port, "GET", "/v1/models", KEYS["alice"] + "x")
        check(st == 401 and r["error"]["code"] == "invalid_api_key", "wrong key: %d %s" % (st, r))
        st, _ = request(port, "GET", "/v1/models", KEYS["bob"])
        check(st == 200, "bob's key: %d" % st)

        # Alice's conversation, two turns, under session "s".
        conv = [{"role": "user", "content": "Remember this: my secret word is PINEAPPLE."}]
        a1 = chat(port, "alice", "s", conv)
        conv += [{"role": "assistant", "content": a1["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "What is my secret word?"}]
        a2 = chat(port, "alice", "s", conv)
        check(cached(a2) > 0 and not a2["session"]["rebuilt"], "alice's session goes on: %s" % a2)
        conv += [{"role": "assistant", "content": a2["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "Say it again."}]

        # Bob sends Alice's next turn under her id, and under an id never used.
        b = chat(port, "bob", "s", conv)
        fresh = chat(port, "bob", "never-used", conv)
        check(cached(b) == 0 and b["session"]["rebuilt"] is False,
              "bob on alice's id: a fresh session (%d cached, rebuilt %s)" %
              (cached(b), b["session"]["rebuilt"]))
        check(b["session"]["id"] == "s", "bob's session is named as he named it")
        check(shape(b) == shape(fresh), "bob on alice's id answers as on an unused id:\n%s\n%s" %
              (shape(b), shape(fresh)))
        # Only Alice's history holds the word: Bob's answer is the one without it.
        q = [{"role": "user", "content": "What is my secret word?"}]
        b_q = chat(port, "bob", "s2", q)
        a_s2 = chat(port, "alice", "s2", conv[:1] + [conv[1], q[0]])
        b_q2 = chat(port, "bob", "s2-never", q)
        check(b_q["choices"][0]["message"]["content"] == b_q2["choices"][0]["message"]["content"],
              "bob's answer does not depend on alice's history")
        check(not b_q["session"]["rebuilt"] and cached(b_q) == 0, "bob's s2 is fresh")
        b_q3 = chat(port, "bob", "s2", q + [{"role": "assistant", "content":
                                               b_q["choices"][0]["message"]["content"]},
                                              {"role": "user", "content": "Thanks."}])
        check(cached(b_q3) > 0 and not b_q3["session"]["rebuilt"],
              "bob's own s2 goes on after alice used hers: %s" % b_q3["session"])
        check(a_s2["session"]["rebuilt"] is False, "alice's s2 is hers")

        # Alice goes on where she was: Bob changed nothing of hers.
        a3 = chat(port, "alice", "s", conv)
        check(cached(a3) == a2["session"]["n_past"] and not a3["session"]["rebuilt"],
              "alice's third turn continues her session (%d cached of %d)" %
              (cached(a3), a2["session"]["n_past"]))
        check(a3["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"],
              "the same messages, the same greedy answer (full cache)")

        # /metrics: the admin key only, counts per key name.
        st, r = request(port, "GET", "/metrics", KEYS["alice"])
        check(st == 403 and r["error"]["code"] == "admin_key_required", "alice: %d %s" % (st, r))
        deadline = time.monotonic() + 30
        while True:
            st, text = request(port, "GET", "/metrics", KEYS["ops"])
            check(st == 200, "ops reads /metrics: %d" % st)
            if 'd2o_key_requests_total{key="alice",outcome="ok"} 4\n' in text:
                break
            check(time.monotonic() < deadline, "alice's 4 requests counted:\n" + text)
            time.sleep(0.05)
        for line in ['d2o_key_requests_total{key="bob",outcome="ok"} 5',
                     'd2o_key_requests_total{key="ops",outcome="ok"} 0',
                     'd2o_key_generated_tokens_total{key="ops"} 0']:
            check(line + "\n" in text, "%s in /metrics:\n%s" % (line, text))
        per_key = sum(float(l.split()[-1]) for l in text.splitlines()
                      if l.startswith("d2o_key_prompt_tokens_total{"))
        total = [float(l.split()[-1]) for l in text.splitlines()
                 if l.startswith("d2o_prompt_tokens_total ")]
        check(total and per_key == total[0], "per-key prompt tokens add up to the total")

        # Each name's sessions are files of their own (written as each turn ended).
        names = sorted(os.listdir(sessions))
        for want in ["alice@s.d2os", "bob@s.d2os", "alice@s2.d2os", "bob@s2.d2os"]:
            check(want in names, "%s in %s" % (want, names))
        check("s.d2os" not in names, "no file in the default namespace: %s" % names)

        attempts(port, ATTEMPTS)

        proc.send_signal(signal.SIGTERM)
        check(proc.wait(timeout=60) == 0, "exit status 0 after SIGTERM")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(timeout=10)
        subprocess.run(["rm", "-rf", tmp])
    print("ok")


if __name__ == "__main__":
    try:
        main()
    except SystemExit:
        raise
    except Exception as e:  # noqa: BLE001 - any error is a failure with its message
        fail("%s: %s" % (type(e).__name__, e))
