#!/usr/bin/env python3
"""End-to-end test of `d2o serve --session-dir` on a disk that fills up during a load.

Usage: serve_full_disk_test.py PATH_TO_D2O [CONVERSATIONS] [TMPFS_SIZE]
Needs $D2O_MODEL (SmolLM2-135M-Instruct); exits 77 (skipped) without it, or where the machine
allows no private tmpfs (the test re-runs itself under `unshare -rm`: a user and mount namespace,
no root needed, in which it mounts a tmpfs of TMPFS_SIZE, default 6m, as the session directory).

CONVERSATIONS (default 16) clients hold 3-turn conversations with sessions at once; each session
file of the full cache is about a megabyte, so the tmpfs fills during the load and saves fail
with ENOSPC. Checked: every request is answered 200 and the server stays up; every later turn
either continues its session (tokens cached, not rebuilt) or says it was rebuilt; saves did fail
(d2o_session_save_failures_total > 0) and no temporary file is left. Then a new server on the same
(full) directory: every conversation's fourth turn is answered, continuing from its file or
rebuilt and saying so, and each one continued from a file gives the greedy answer of the same
messages sent without a session (a damaged file taken for a good one would not).
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.request

from serve_common import SKIP, check, fail, require_model, start_server

D2O = sys.argv[1]
MODEL = require_model()
CONVERSATIONS = int(sys.argv[2]) if len(sys.argv) > 2 else 16
SIZE = sys.argv[3] if len(sys.argv) > 3 else "6m"
N = 8  # tokens per greedy answer


def in_namespace():
    """Re-runs this test in a user + mount namespace unless already there; returns the tmpfs."""
    if os.environ.get("D2O_FULL_DISK_NS") != "1":
        probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
        if probe.returncode != 0:
            print("skipped: no user namespace here (unshare -rm: %s)" % probe.stderr.decode().strip())
            sys.exit(SKIP)
        env = dict(os.environ, D2O_FULL_DISK_NS="1")
        r = subprocess.run(["unshare", "-rm", sys.executable] + sys.argv, env=env)
        sys.exit(r.returncode)
    tmp = tempfile.mkdtemp(prefix="d2o-full-disk-")
    d = os.path.join(tmp, "sessions")
    os.mkdir(d)
    m = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=" + SIZE, "tmpfs", d],
                       capture_output=True, text=True)
    if m.returncode != 0:
        print("skipped: cannot mount a tmpfs in a user namespace: " + m.stderr.strip())
        sys.exit(SKIP)
    return d


def chat(port, messages, session=None):
    body = {"messages": messages, "max_tokens": N, "temperature": 0, "kv": "full"}
    if session is not None:
        body["session"] = session
    req = urllib.request.Request("http://127.0.0.1:%d/v1/chat/completions" % port,
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        check(r.status == 200, "status %d" % r.status)
        return json.loads(r.read())


def cached(r):
    return r["usage"]["prompt_tokens_details"]["cached_tokens"]


def metrics(port):
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=30) as r:
        out = {}
        for line in r.read().decode().splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                out[k] = float(v)
        return out


def serve(d):
    return start_server([D2O, "serve", "-m", MODEL, "--port", "0", "-t", "2", "-c", "1024",
                         "--kv-mem", "256M", "--parallel", "16", "--session-dir", d])


def stop(proc, reader):
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=120)
    reader.join(timeout=10)
    return rc


def conversation(port, i, convs, errors, outcome):
    """Three turns of conversation i; records how each later turn went."""
    try:
        msgs = [{"role": "user", "content": "Conversation %d. Tell me a short fact about the "
                 "number %d, and about the sea, the sky and the mountains." % (i, 100 + i)}]
        for turn in range(3):
            r = chat(port, msgs, "c%d" % i)
            if turn > 0:
                outcome.append("rebuilt" if r["session"]["rebuilt"] else
                               "continued" if cached(r) > 0 else "neither")
            msgs += [{"role": "assistant", "content": r["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "And one more (%d)." % turn}]
        convs[i] = msgs
    except Exception as e:  # noqa: BLE001 (any failure is the test's)
        errors.append("conversation %d: %s: %s" % (i, type(e).__name__, e))


def main():
    d = in_namespace()
    proc, port, log, reader = serve(d)
    try:
        convs, errors, outcome = {}, [], []
        threads = [threading.Thread(target=conversation, args=(port, i, convs, errors, outcome))
                   for i in range(CONVERSATIONS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        check(not errors, "requests failed: %s" % errors[:3])
        check(proc.poll() is None, "the server died: " + "".join(log[-20:]))
        check("neither" not in outcome,
              "a later turn neither continued nor said it was rebuilt: %s" % outcome)
        m = metrics(port)
        failures = int(m.get("d2o_session_save_failures_total", 0))
        saved = int(m.get("d2o_sessions_saved_total", 0))
        check(failures > 0, "the disk never filled (%d saved): a larger load or a smaller tmpfs"
              % saved)
        check(stop(proc, reader) == 0, "exit status after SIGTERM: " + "".join(log[-20:]))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    names = os.listdir(d)
    check(not [n for n in names if n.endswith(".tmp")], "temporary files left: %s" % names)
    print("load: %d conversations, %d later turns: %d continued, %d rebuilt; %d files saved, %d "
          "saves failed; %d files on the %s tmpfs" %
          (CONVERSATIONS, len(outcome), outcome.count("continued"), outcome.count("rebuilt"),
           saved, failures, len(names), SIZE))

    # A new server on the same full directory: each conversation goes on.
    proc, port, log, reader = serve(d)
    try:
        from_file = rebuilt = 0
        for i, msgs in sorted(convs.items()):
            r = chat(port, msgs, "c%d" % i)
            if r["session"]["rebuilt"]:
                rebuilt += 1
                continue
            if cached(r) == 0:
                continue  # no file was left for it (all its saves failed): a fresh session
            from_file += 1
            plain = chat(port, msgs)
            check(r["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"],
                  "conversation %d continued from its file answers otherwise than without it:"
                  "\n%r\n%r" % (i, r["choices"][0]["message"]["content"],
                                plain["choices"][0]["message"]["content"]))
        check(proc.poll() is None, "the server died: " + "".join(log[-20:]))
        check(stop(proc, reader) == 0, "exit status after SIGTERM")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    check(from_file > 0, "no conversation continued from its file")
    print("after a restart: %d continued from their files (each the answer without a session), "
          "%d rebuilt, %d fresh" % (from_file, rebuilt, len(convs) - from_file - rebuilt))
    print("ok")


if __name__ == "__main__":
    try:
        main()
    except SystemExit:
        raise
    except Exception as e:  # noqa: BLE001 - any error is a failure with its message
        fail("%s: %s" % (type(e).__name__, e))
