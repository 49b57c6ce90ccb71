#!/usr/bin/env python3
"""Load test of `d2o serve`: 64 concurrent clients x 4 turns against a cap of 8 full caches.

Usage: serve_load_test.py PATH_TO_D2O
Needs $D2O_MODEL (SmolLM2-135M-Instruct); exits 77 (skipped) without it. Python's standard
library only (503s and their headers are read as they come, without a client's retries).

The real SmolLM2 behind `d2o serve -c 512 --kv-mem <8 full 512-token caches> --parallel 16
--queue 32`. 64 clients start together; each holds one conversation of 4 turns under its own
session id (half of them `full`, half `d2o:budget=64`), greedy, 16 tokens per answer; a turn
answered 503 is dropped and the client goes on with the next. Checks:
  - every request gets exactly one answer, 200 or 503 + `Retry-After` (code queue_full); the
    server's counters agree with the clients' (none lost, none answered twice); every 200 has
    its own response id and carries its own client's session;
  - answers do not mix: the first turns of clients with the same prompt and policy are equal;
  - memory: the server's resident set (VmRSS of /proc/PID/status) after the load is within 5%
    of what it was before it, both taken with no KV memory held: once the load has drained,
    the sessions it left are made to give way (8 requests of a whole context each need the
    whole cap; they are admitted, which drops every idle session, then abandoned); and RSS fell
    by at least 80% of the KV bytes those sessions held when they were dropped.
"Before" is after a warm-up: the same load once (64 other clients), made to give way the same
way. What a server sets up once and keeps whatever the load (such as the stacks and malloc
arenas of its handler threads, the engine's activation and attention scratch at the largest
step the options allow, each policy's state) is then in place, and what the measured load adds
on top of it is what must go back. The resident set of the cold server (started, nothing
served) is printed too.
"""
import http.client
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from serve_common import check, fail, require_model, start_server


D2O = sys.argv[1]
MODEL = require_model()

CTX = 512
# SmolLM2-135M: per token of a full cache, 30 layers x 3 KV heads x (a key and a value row of 64
# F16 and 20 bytes of slot metadata): KvCache::bytes_for_slots.
TOKEN_BYTES = 30 * 3 * (2 * 64 * 2 + 20)
CAP = 8 * CTX * TOKEN_BYTES  # 8 full caches of the context: 101,744,640 bytes
CLIENTS, TURNS, N = 64, 4, 16
POLICIES = ["full", "d2o:budget=64"]
TOPICS = ["the sea", "mountains", "bread", "trains"]
QUESTIONS = ["Tell me about {}.", "Why is that?", "Give an example.", "Say it in one sentence."]
BOUND_S = 300  # a bound against hanging, not a timing check


def status_kib(pid, field):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    fail(f"{field} missing from /proc/{pid}/status")


class Server:
    def __init__(self):
        self.proc, self.port, self.log, self.reader = start_server(
            [D2O, "serve", "-m", MODEL, "--port", "0", "-t", "2", "-c", str(CTX), "--kv-mem",
             str(CAP), "--parallel", "16", "--queue", "32",
             # 64 clients and the samplers on one address: past the default bound per address
             "--max-conn-per-addr", "0"])
        self.base = f"http://127.0.0.1:{self.port}"

    def rss_kib(self):
        return status_kib(self.proc.pid, "VmRSS")

    def post(self, body):
        """(status, headers, parsed body) of a chat request."""
        req = urllib.request.Request(self.base + "/v1/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=BOUND_S) as r:
                return r.status, dict(r.headers), json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), json.loads(e.read())

    def metrics(self):
        with urllib.request.urlopen(self.base + "/metrics", timeout=60) as r:
            out = {}
            for line in r.read().decode().splitlines():
                if line and not line.startswith("#"):
                    name, value = line.rsplit(" ", 1)
                    out[name] = float(value)
            return out

    def drained(self):
        """Waits until no sequence runs or waits (metrics are published after each step)."""
        deadline = time.monotonic() + BOUND_S
        while time.monotonic() < deadline:
            m = self.metrics()
            if m["d2o_sequences_running"] == 0 and m["d2o_sequences_queued"] == 0:
                return m
            time.sleep(0.05)
        fail("the server did not drain")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def make_room_for_all(srv):
    """Has the server drop every idle session its own way: 8 streamed requests of a whole
    context each reserve 8 full caches, the cap; admitting them all takes the room of every idle
    session (least recently used first). Once each has streamed its first event they are
    abandoned (cancelled, their caches freed). Returns the metrics while all 8 ran."""
    # A prompt whose greedy answer is long: none of the 8 ends before all are admitted.
    probe = {"messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
             "temperature": 0, "kv": "full"}
    st, _, body = srv.post(dict(probe, max_tokens=1))
    check(st == 200, "probe: %s" % body)
    body = json.dumps(dict(probe, max_tokens=CTX - body["usage"]["prompt_tokens"], stream=True))
    started, release, errors = threading.Semaphore(0), threading.Event(), []

    def hold():
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=BOUND_S)
        try:
            conn.request("POST", "/v1/chat/completions", body,
                         {"Content-Type": "application/json"})
            r = conn.getresponse()
            if r.status != 200:
                errors.append((r.status, r.read()))
            else:
                while True:  # up to the first text event
                    line = r.readline()
                    if not line:
                        errors.append("a stream ended before its first text")
                        break
                    if b'"content"' in line:
                        break
        except OSError as e:
            errors.append(repr(e))
        started.release()
        release.wait(BOUND_S)
        conn.close()

    threads = [threading.Thread(target=hold, daemon=True) for _ in range(8)]
    for t in threads:
        t.start()
    for _ in threads:
        check(started.acquire(timeout=BOUND_S), "the 8 full-context requests did not start")
    check(not errors, "full-context requests: %s" % errors)
    deadline = time.monotonic() + 60  # metrics are published after the step
    while (m := srv.metrics())["d2o_sessions"] > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    release.set()
    for t in threads:
        t.join(BOUND_S)
    return m


def client(srv, i, prefix, start, results):
    kv = POLICIES[(i // len(TOPICS)) % len(POLICIES)]
    messages = []
    start.wait()
    for t in range(TURNS):
        messages.append({"role": "user", "content": QUESTIONS[t].format(TOPICS[i % len(TOPICS)])})
        try:
            st, hdrs, body = srv.post({"messages": messages, "max_tokens": N, "temperature": 0,
                                       "kv": kv, "session": f"{prefix}-{i}"})
        except OSError as e:  # reported by the count check below
            st, hdrs, body = -1, {}, {"error": {"message": repr(e)}}
        results.append((i, t, kv, st, hdrs, body))
        if st == 200:
            messages.append({"role": "assistant",
                             "content": body["choices"][0]["message"]["content"]})
        else:
            messages.pop()  # the turn is dropped; the next one goes on from the last answer


def main():
    srv = Server()
    try:
        run(srv)
    finally:
        srv.stop()


def load(srv, prefix):
    """64 clients x 4 turns, all started at once; their results and the time it took."""
    results, start = [], threading.Barrier(CLIENTS)
    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(srv, i, prefix, start, results))
               for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOUND_S)
        check(not t.is_alive(), "a client hangs")
    lost = [(i, t, body["error"]["message"]) for i, t, _, st, _, body in results if st == -1]
    check(not lost, "%d requests got no answer: %s" % (len(lost), lost[:4]))
    return results, time.monotonic() - t0


def run(srv):
    m = srv.drained()
    check(m["d2o_kv_cap_bytes"] == CAP, "the cap")
    rss_cold = srv.rss_kib()
    _, warm_s = load(srv, "warm")
    make_room_for_all(srv)
    m0 = srv.drained()
    check(m0["d2o_kv_allocated_bytes"] == 0, "nothing held after the warm-up")
    rss_before = srv.rss_kib()
    count = lambda m, outcome: m.get('d2o_requests_total{outcome="%s"}' % outcome, 0)

    results, load_s = load(srv, "load")
    m1 = srv.drained()
    rss_loaded = srv.rss_kib()
    rss_peak = status_kib(srv.proc.pid, "VmHWM")

    # Every request answered once: 200 or 503 with Retry-After.
    check(len(results) == CLIENTS * TURNS, "%d answers for %d requests" %
          (len(results), CLIENTS * TURNS))
    oks = [r for r in results if r[3] == 200]
    busy = [r for r in results if r[3] == 503]
    check(len(oks) + len(busy) == len(results),
          "only 200 and 503: %s" % sorted({(r[3], json.dumps(r[5])[:200]) for r in results
                                           if r[3] not in (200, 503)}))
    for _, _, _, _, hdrs, body in busy:
        check(hdrs.get("Retry-After") == "1", "a 503 carries Retry-After: 1")
        check(body["error"]["code"] == "queue_full", "503 code: %s" % body)
    check(len({r[5]["id"] for r in oks}) == len(oks), "every answer has its own id")
    fingerprints = {}
    for i, t, kv, _, _, body in oks:
        check(body["session"]["id"] == f"load-{i}", "client %d got another's answer" % i)
        fingerprints.setdefault(kv, set()).add(body["system_fingerprint"])
        check(body["choices"][0]["message"]["content"] != "", "an empty answer")
    check(all(len(f) == 1 for f in fingerprints.values()) and
          len(set.union(*fingerprints.values())) == len(POLICIES),
          "each answer under its client's policy: %s" % fingerprints)
    check(count(m1, "ok") - count(m0, "ok") == len(oks),
          "the server counts %d answers, the clients %d" % (count(m1, "ok") - count(m0, "ok"),
                                                              len(oks)))
    check(count(m1, "rejected") - count(m0, "rejected") == len(busy),
          "the server counts the 503s the clients got")
    for name in ("cancelled", "invalid", "error"):
        check(count(m1, name) == count(m0, name), "no %s requests" % name)
    # Answers do not mix: equal first turns for the same prompt and policy.
    first = {}
    for i, t, kv, _, _, body in oks:
        if t == 0:
            first.setdefault((i % len(TOPICS), kv), set()).add(
                body["choices"][0]["message"]["content"])
    check(all(len(s) == 1 for s in first.values()), "first turns differ: %s" % first)

    kept = m1["d2o_kv_allocated_bytes"]
    check(kept == m1["d2o_kv_session_bytes"], "only idle sessions hold KV memory")
    check(0 < kept <= CAP, "kept sessions under the cap")
    print(f"load: {len(oks)} answered 200, {len(busy)} answered 503 in {load_s:.1f} s "
          f"(warm-up {warm_s:.1f} s); {m1['d2o_sessions']:.0f} sessions kept "
          f"({kept / 2**20:.1f} MiB), "
          f"{m1['d2o_sessions_evicted_total'] - m0['d2o_sessions_evicted_total']:.0f} dropped "
          f"to make room; RSS then {rss_loaded / 1024:.1f} MiB, peak {rss_peak / 1024:.1f} MiB")

    # The kept sessions give way; then nothing is held, as before the load.
    m2 = make_room_for_all(srv)
    check(m2["d2o_sessions"] == 0, "the sessions made room for 8 full contexts")
    m3 = srv.drained()
    check(count(m3, "cancelled") - count(m1, "cancelled") == 8, "the 8 were cancelled")
    check(m3["d2o_kv_allocated_bytes"] == 0 and m3["d2o_kv_reserved_bytes"] == 0,
          "nothing held once they are gone")
    rss_after = srv.rss_kib()
    change = (rss_after - rss_before) / rss_before
    print(f"RSS with no KV held: cold (started, idle) {rss_cold / 1024:.1f} MiB, after the "
          f"warm-up {rss_before / 1024:.1f} MiB, after the load {rss_after / 1024:.1f} MiB "
          f"({100 * change:+.1f}%)")
    check(abs(change) <= 0.05, "RSS after the load is not within 5% of RSS before it")
    # And the sessions' memory went back to the system when they were dropped (glibc keeps freed
    # memory in its arenas unless told otherwise: then RSS before and after would both stay near
    # the peak, and the check above alone would not see it).
    returned = (rss_loaded - rss_after) * 1024
    print(f"dropping the kept sessions ({kept / 2**20:.1f} MiB) lowered RSS by "
          f"{returned / 2**20:.1f} MiB")
    check(returned >= 0.8 * kept, "the dropped sessions' memory did not go back to the system")
    print("ok")


if __name__ == "__main__":
    main()
