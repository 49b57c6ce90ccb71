#!/usr/bin/env python3
"""End-to-end test of `d2o serve --session-dir`: a conversation survives a restart.

Usage: serve_session_restart_test.py PATH_TO_D2O
Needs $D2O_MODEL (SmolLM2-135M-Instruct); exits 77 (skipped) without it.

A server with `--session-save evict` holds a d2o:budget=256,merge=sized conversation of three
turns (the first longer than the budget, so the cache is compressed with merges); SIGTERM writes
it to the directory. A new server on the same directory continues it: the fourth turn prefills only
itself and gives the greedy answer of the same conversation held in memory without a restart
(the same four turns replayed on the new server under another session id). A damaged session
file is refused and its session rebuilt, and the server goes on serving. A non-streaming request
whose client closes its connection is cancelled.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from serve_common import check, fail, require_model, start_server


D2O = sys.argv[1]
MODEL = require_model()

KV = "d2o:budget=256,merge=sized"
N = 12  # tokens per greedy answer
TEXT = ("The lighthouse keeper walked up the spiral stairs every evening, counting the steps "
        "and listening to the wind against the glass. Ships passed far out at sea, their lights "
        "small and yellow, and the keeper wrote each one into a thick book with a green cover. ")
TURNS = [TEXT * 6 + "What does the keeper write into the book?",
         "What colour is the book?",
         "Where do the ships pass?",
         "Thank you. Say goodbye in one short sentence."]


class Server:
    def __init__(self, session_dir, *extra):
        self.proc, self.port, self.log, self.reader = start_server(
            [D2O, "serve", "-m", MODEL, "--port", "0", "-t", "2", "-c", "1024", "--kv-mem", "64M",
             "--parallel", "2", "--session-dir", session_dir, *extra])
        self.base = f"http://127.0.0.1:{self.port}"

    def post(self, path, body):
        req = urllib.request.Request(self.base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def metric(self, name):
        with urllib.request.urlopen(self.base + "/metrics", timeout=60) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[-1])
        fail("metric %s missing" % name)

    def wait_metric(self, name, done, seconds=60):
        """Polls `name` until done(value) or `seconds` pass (a bound against hanging, not a
        timing check); the last value read."""
        deadline = time.monotonic() + seconds
        v = self.metric(name)
        while not done(v) and time.monotonic() < deadline:
            time.sleep(0.05)
            v = self.metric(name)
        return v

    def turn(self, session, messages, text):
        """Sends the next user turn of `messages` (extended in place with it and the answer)."""
        messages.append({"role": "user", "content": text})
        st, r = self.post("/v1/chat/completions",
                          {"messages": messages, "max_tokens": N, "temperature": 0, "kv": KV,
                           "session": session})
        check(st == 200, "turn of %s: status %d: %s" % (session, st, r))
        messages.append({"role": "assistant", "content": r["choices"][0]["message"]["content"]})
        return r

    def terminate(self):
        """SIGTERM; the exit status."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            fail("the server did not exit after SIGTERM")
        self.reader.join(timeout=10)
        return rc

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def cached(r):
    return r["usage"]["prompt_tokens_details"]["cached_tokens"]


def main():
    d = tempfile.mkdtemp(prefix="d2o-sessions-")
    path = os.path.join(d, "s1.d2os")
    with open(os.path.join(d, "broken.d2os"), "wb") as f:
        f.write(b"D2OSESS\0" + bytes(range(256)) * 4)
    a = b = None
    try:
        # Three turns, then SIGTERM: written at the drain (evict: not before).
        a = Server(d, "--session-save", "evict")
        conv = []
        before = [a.turn("s1", conv, t) for t in TURNS[:3]]
        check(all(not r["session"]["rebuilt"] for r in before), "the conversation continued")
        check(before[0]["usage"]["prompt_tokens"] > 256, "the first turn outgrows the budget")
        check(not os.path.exists(path), "evict: nothing written while the session is in memory")
        check(a.terminate() == 0, "exit status 0 after SIGTERM")
        check(os.path.exists(path), "the session was written at the drain")
        check(any("sessions saved to" in line for line in a.log), "the drain says so")
        size = os.path.getsize(path)

        # A new server continues it.
        b = Server(d)
        after = b.turn("s1", conv, TURNS[3])
        info = after["session"]
        check(info["rebuilt"] is False and after.get("session_rebuilt") is not True,
              "the session read back continues: %s" % info)
        check(cached(after) == before[-1]["session"]["n_past"],
              "only the new turn is prefilled (%d cached, %d held)" %
              (cached(after), before[-1]["session"]["n_past"]))
        check(b.metric("d2o_sessions_loaded_total") == 1, "one session read back")
        # Metrics are published after the engine step that answered (bounded wait).
        check(b.wait_metric("d2o_sessions_saved_total", lambda v: v >= 1) >= 1,
              "turn: written when the request ended")

        # The same conversation without a restart, on the new server under another id.
        ref_conv = []
        ref = [b.turn("ref", ref_conv, t) for t in TURNS]
        for i in range(3):
            check(ref[i]["choices"][0]["message"]["content"] ==
                  before[i]["choices"][0]["message"]["content"], "turn %d is deterministic" % i)
        got = after["choices"][0]["message"]["content"]
        want = ref[3]["choices"][0]["message"]["content"]
        check(got == want, "the turn after the restart answers %r, without a restart %r" %
              (got, want))
        check(cached(ref[3]) == cached(after) and
              ref[3]["usage"]["prompt_tokens"] == after["usage"]["prompt_tokens"],
              "the same prefill as without a restart")
        check(info["kv_bytes"] == ref[3]["session"]["kv_bytes"], "the same cache size")

        # A damaged file: refused, the session rebuilt, the server still serving.
        errors = b.metric("d2o_session_file_errors_total")
        r = b.turn("broken", [], "Hello.")
        check(r["session"]["rebuilt"] is True, "a refused file rebuilds its session")
        # An answer reaches its client before the engine publishes the step that gave it: wait
        # for the publication of this one, the sixth on this server, so that no later read sees
        # it still running.
        ok = b.wait_metric('d2o_requests_total{outcome="ok"}', lambda v: v >= 6)
        check(ok == 6, "six requests answered (%g)" % ok)
        check(b.metric("d2o_session_file_errors_total") == errors + 1, "counted")
        # A non-streaming request whose client goes away is cancelled, its sequence freed.
        cancelled = b.metric('d2o_requests_total{outcome="cancelled"}')
        generated = b.metric("d2o_generated_tokens_total")
        check(b.metric("d2o_sequences_running") == 0, "nothing runs before the request")
        body = json.dumps({"prompt": "Count slowly from one to one thousand:", "max_tokens": 900,
                           "temperature": 0}).encode()
        sock = socket.create_connection(("127.0.0.1", b.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
                     + body)
        running = b.wait_metric("d2o_sequences_running", lambda v: v != 0)
        check(running == 1, "the request runs (%g sequences running)" % running)
        sock.close()
        running = b.wait_metric("d2o_sequences_running", lambda v: v == 0)
        check(running == 0, "the abandoned request's sequence is freed (%g running)" % running)
        check(b.metric('d2o_requests_total{outcome="cancelled"}') == cancelled + 1,
              "counted cancelled")
        check(b.metric("d2o_generated_tokens_total") - generated < 900, "it stopped early")

        check(b.terminate() == 0, "exit status 0 after SIGTERM")
        check(any("session 'broken'" in line and "refused" in line for line in b.log),
              "the refusal is logged")
        print("ok (session file %d bytes for %d tokens)" % (size, before[-1]["session"]["n_past"]))
    finally:
        for s in (a, b):
            if s:
                s.kill()
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
