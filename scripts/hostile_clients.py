#!/usr/bin/env python3
"""`d2o serve` under hostile clients, while ordinary clients chat.

Starts `d2o serve` on loopback with the real model, then for --seconds keeps --connections
hostile connections open from many loopback source addresses (127.0.0.3 and up, each under
--max-conn-per-addr), of four kinds:
  - trickling heads: a request header sent one line at a time, never finished (the gate answers
    408 at --request-timeout, and the connection is opened again);
  - silent: connected, nothing sent (408 as well);
  - half-closed: part of a header, then the client shuts its side (the server closes);
  - unread streams: a streamed chat request whose answer is never read;
and one greedy address, 127.0.0.2, opens more connections than --max-conn-per-addr allows.
Meanwhile 8 ordinary clients (127.0.0.1) hold short conversations (with sessions, unless
--no-sessions), and /health is timed on a fresh connection every 100 ms. The server's KV memory is
capped (--kv-mem, default 64M), so that what the conversations keep stays small next to what the
connections cost.

Prints JSON: ordinary requests sent / answered / failed, /health p50/p99/max latency, the
server's RSS (VmRSS from /proc: idle before the load, once the ordinary clients alone have run for
--warm-up seconds; peak during it, sampled every 0.5 s; after it, once the server has closed what
the clients left), the server's connection counters per refusal reason, and what the hostile side opened. Exits 1 when an
ordinary request fails or /health p99 is 1 s or more, 2 when the server cannot be started.
Python's standard library only; stops itself (the server is stopped in every case).

  scripts/hostile_clients.py --d2o build/d2o -m cache/models/SmolLM2-135M-Instruct.Q4_1.gguf \\
      --connections 1000 --seconds 60
"""
import argparse
import errno
import http.client
import json
import os
import re
import resource
import selectors
import socket
import subprocess
import sys
import threading
import time

HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d2o", default="build/d2o")
    ap.add_argument("-m", "--model", default=os.environ.get("D2O_MODEL", ""))
    ap.add_argument("--connections", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-conn-per-addr", type=int, default=64)
    ap.add_argument("--request-timeout", type=float, default=10)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--kv-mem", default="64M", help="the server's --kv-mem")
    ap.add_argument("--warm-up", type=float, default=10,
                    help="seconds the ordinary clients run alone before the idle RSS is read")
    ap.add_argument("--no-sessions", action="store_true",
                    help="the ordinary clients keep no session (RSS after the load then "
                         "holds no kept conversation)")
    ap.add_argument("--json", help="also write the JSON here")
    return ap.parse_args()


class Server:
    def __init__(self, args):
        cmd = [args.d2o, "serve", "-m", args.model, "--port", "0", "-t", str(args.threads),
               "-c", "1024", "--parallel", "16", "--queue", "64", "-n", "32",
               "--request-timeout", str(args.request_timeout), "--kv-mem", args.kv_mem,
               "--max-conn-per-addr", str(args.max_conn_per_addr)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        self.log, self.port = [], None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and self.port is None:
            line = self.proc.stderr.readline()
            if not line:
                break
            self.log.append(line)
            m = re.search(r"on http://127\.0\.0\.1:(\d+)", line)
            if m:
                self.port = int(m.group(1))
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()

    def rss_mib(self, field="VmRSS"):
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith(field + ":"):
                        return int(line.split()[1]) / 1024.0
        except OSError:
            pass
        return None

    def metrics(self):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            c.request("GET", "/metrics")
            text = c.getresponse().read().decode()
        finally:
            c.close()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Hostile:
    """Every hostile socket, driven by one thread through a selector."""

    KINDS = ("trickle", "trickle_body", "silent", "half_closed", "unread_stream")

    def __init__(self, port, n, per_addr, stop):
        self.port, self.stop = port, stop
        self.sel = selectors.DefaultSelector()
        self.counts = {"opened": 0, "connect_failed": 0, "answered_408": 0, "answered_503": 0,
                       "closed_by_server": 0, "greedy_refused": 0}
        # The greedy address: per_addr + 16 silent connections from 127.0.0.2.
        self.greedy = [("silent", "127.0.0.2") for _ in range(per_addr + 16)] if per_addr else []
        streams = max(1, min(8, n // 125))
        plan, spread = [], max(1, min(per_addr or 48, 48))  # connections per address
        for i in range(n - len(self.greedy)):
            kind = "unread_stream" if i < streams else self.KINDS[i % 4]
            j = i // spread
            plan.append((kind, "127.0.%d.%d" % (j // 250, 3 + j % 250)))
        self.plan = plan
        self.reopen = []  # (kind, addr) to open again at the next tick
        self.addresses = len({a for _, a in plan}) + (1 if self.greedy else 0)

    def open(self, kind, addr):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind((addr, 0))
            s.settimeout(5)
            s.connect(("127.0.0.1", self.port))
            s.setblocking(False)
            if kind == "trickle":
                s.send(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            elif kind == "trickle_body":
                s.send(HEAD + b"Content-Length: 1048576\r\n\r\n{")
            elif kind == "half_closed":
                s.send(b"GET /health HTTP/1.1\r\nHost: ")
                s.shutdown(socket.SHUT_WR)
            elif kind == "unread_stream":
                body = json.dumps({"messages": [{"role": "user", "content": "Count to fifty."}],
                                   "stream": True, "max_tokens": 32}).encode()
                s.send(HEAD + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        except OSError:
            s.close()
            self.counts["connect_failed"] += 1
            return
        self.counts["opened"] += 1
        # Unread streams are never read (registered only to be closed at the end).
        self.sel.register(s, selectors.EVENT_READ, [kind, addr, time.monotonic()])

    def on_readable(self, key):
        kind, addr, _ = key.data
        s = key.fileobj
        if kind == "unread_stream":
            return
        try:
            got = s.recv(256)
        except OSError:
            got = b""
        if got.startswith(b"HTTP/1.1 408"):
            self.counts["answered_408"] += 1
        elif got.startswith(b"HTTP/1.1 503"):
            self.counts["answered_503"] += 1
            if addr == "127.0.0.2":
                self.counts["greedy_refused"] += 1
        else:
            self.counts["closed_by_server"] += 1
        self.sel.unregister(s)
        s.close()
        if addr != "127.0.0.2":
            self.reopen.append((kind, addr))  # keep the pressure up

    def tick(self):
        """A header line to every trickling connection; unread streams renewed every 15 s;
        the connections the server closed opened again."""
        now = time.monotonic()
        again, self.reopen = self.reopen, []
        for kind, addr in again:
            self.open(kind, addr)
        for key in list(self.sel.get_map().values()):
            kind, addr, since = key.data
            try:
                if kind == "trickle":
                    key.fileobj.send(b"X-Slow: 1\r\n")
                elif kind == "trickle_body":
                    key.fileobj.send(b"    ")
                elif kind == "unread_stream" and now - since > 15:
                    self.sel.unregister(key.fileobj)
                    key.fileobj.close()
                    self.open(kind, addr)
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EPIPE, errno.ECONNRESET):
                    raise

    def run(self):
        for kind, addr in self.greedy + self.plan:
            self.open(kind, addr)
        next_tick = time.monotonic() + 1
        while not self.stop.is_set():
            for key, _ in self.sel.select(timeout=0.1):
                self.on_readable(key)
            if time.monotonic() >= next_tick:
                self.tick()
                next_tick += 1

    def close_all(self):
        for key in list(self.sel.get_map().values()):
            self.sel.unregister(key.fileobj)
            key.fileobj.close()


LOCK = threading.Lock()


def count(res, key, error=None):
    with LOCK:
        res[key] += 1
        if error:
            res["errors"].append(error[:200])


def ordinary_client(port, i, stop, res, sessions):
    """Short conversations (with sessions, when `sessions`), a new one every 3 turns."""
    conv, messages = 0, []
    while not stop.is_set():
        if len(messages) >= 6:
            conv, messages = conv + 1, []
        messages.append({"role": "user", "content": f"Client {i}: name one colour ({conv})."})
        req = {"messages": messages, "max_tokens": 16, "temperature": 0}
        if sessions:
            req["session"] = f"c{i}-{conv}"
        body = json.dumps(req)
        count(res, "sent")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
            r = c.getresponse()
            data = r.read()
            c.close()
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {data[:200]!r}")
            answer = json.loads(data)["choices"][0]["message"]["content"]
            messages.append({"role": "assistant", "content": answer})
            count(res, "answered")
        except Exception as e:  # noqa: BLE001 (any failure is a failed request)
            count(res, "failed", str(e))
            messages = []


def health_probe(port, stop, lat):
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/health")
            ok = c.getresponse().status == 200
            c.close()
        except OSError:
            ok = False
        lat.append((time.monotonic() - t0) if ok else 5.0)
        time.sleep(0.1)


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100.0 * len(xs)))] if xs else None


def warm_up(port, clients, seconds, sessions):
    """The ordinary clients alone for `seconds`, so that the idle level is that of a server that
    has served them (compute buffers, the engine's structures for such batches, the weights'
    pages touched); then the drained server's trim. What the hostile clients add is then what
    RSS shows above it."""
    stop, res = threading.Event(), {"sent": 0, "answered": 0, "failed": 0, "errors": []}
    threads = [threading.Thread(target=ordinary_client, args=(port, 100 + i, stop, res, sessions))
               for i in range(clients)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(timeout=150)
    time.sleep(2)
    return res


def run(args, srv):
    stop = threading.Event()
    warm = warm_up(srv.port, args.clients, args.warm_up, not args.no_sessions)
    rss_idle, rss_peak = srv.rss_mib(), srv.rss_mib()
    hostile = Hostile(srv.port, args.connections, args.max_conn_per_addr, stop)
    res = {"sent": 0, "answered": 0, "failed": 0, "errors": []}
    lat = []
    threads = [threading.Thread(target=hostile.run, daemon=True),
               threading.Thread(target=health_probe, args=(srv.port, stop, lat), daemon=True)]
    threads += [threading.Thread(target=ordinary_client,
                                 args=(srv.port, i, stop, res, not args.no_sessions), daemon=True)
                for i in range(args.clients)]
    for t in threads:
        t.start()
    open_max = 0
    end = time.monotonic() + args.seconds
    while time.monotonic() < end and srv.proc.poll() is None:
        time.sleep(0.5)
        rss_peak = max(rss_peak or 0, srv.rss_mib() or 0)
        open_max = max(open_max, int(srv.metrics().get("d2o_connections_open", 0)))
    stop.set()
    for t in threads:
        t.join(timeout=150)
    hostile.close_all()
    # The server closes what the clients left (at most --request-timeout), then frees what the
    # requests held.
    settle = time.monotonic() + args.request_timeout + 10
    while time.monotonic() < settle:
        time.sleep(1)
        if int(srv.metrics().get("d2o_connections_open", 0)) <= 1:
            break
    time.sleep(2)
    m = srv.metrics()
    refused = {k.split('"')[1]: int(v) for k, v in m.items()
               if k.startswith("d2o_connections_refused_total{")}
    return {
        "connections": args.connections, "seconds": args.seconds,
        "hostile_addresses": hostile.addresses, "hostile": hostile.counts,
        "ordinary": {k: res[k] for k in ("sent", "answered", "failed")},
        "ordinary_errors": res["errors"][:5] + warm["errors"][:5],
        "warm_up": {k: warm[k] for k in ("sent", "answered", "failed")},
        "health": {"count": len(lat), "p50_ms": round(1000 * pct(lat, 50), 1),
                   "p99_ms": round(1000 * pct(lat, 99), 1),
                   "max_ms": round(1000 * max(lat), 1)} if lat else {"count": 0},
        "rss_mib": {"idle": rss_idle, "peak": rss_peak, "after": srv.rss_mib()},
        "limits": {"max_conn_per_addr": args.max_conn_per_addr,
                   "request_timeout_s": args.request_timeout, "kv_mem": args.kv_mem,
                   "sessions": not args.no_sessions},
        "load_avg": os.getloadavg(),
        "server": {"connections_open_max": open_max,
                   "connections_open_after": int(m.get("d2o_connections_open", -1)),
                   "accepted": int(m.get("d2o_connections_accepted_total", 0)),
                   "shed": int(m.get("d2o_connections_shed_total", 0)), "refused": refused,
                   # what the kept conversations hold (part of "after")
                   "sessions": int(m.get("d2o_sessions", 0)),
                   "kv_session_mib": round(m.get("d2o_kv_session_bytes", 0) / 2**20, 1)},
        "server_alive": srv.proc.poll() is None,
    }


def main():
    args = parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if not args.model or not os.path.exists(args.model):
        print("no model (-m or $D2O_MODEL)", file=sys.stderr)
        return 2
    srv = Server(args)
    if srv.port is None:
        srv.stop()
        print("the server did not start:\n" + "".join(srv.log), file=sys.stderr)
        return 2
    try:
        out = run(args, srv)
    finally:
        srv.stop()
    for k in ("idle", "peak", "after"):  # sampled every 0.5 s
        if out["rss_mib"][k] is not None:
            out["rss_mib"][k] = round(out["rss_mib"][k], 1)
    r = out["rss_mib"]
    if None not in (r["idle"], r["peak"], r["after"]):
        # The acceptance bounds: at most 100 MiB above idle during the load, within 5% after.
        r["peak_over_idle"] = round(r["peak"] - r["idle"], 1)
        r["after_over_idle_pct"] = round(100.0 * (r["after"] - r["idle"]) / r["idle"], 1)
        r["within_bounds"] = r["peak_over_idle"] <= 100 and r["after_over_idle_pct"] <= 5
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    bad = out["ordinary"]["failed"] > 0 or out["ordinary"]["answered"] == 0
    bad = bad or out["warm_up"]["failed"] > 0
    bad = bad or not out["health"].get("count") or out["health"]["p99_ms"] >= 1000
    bad = bad or not out["server_alive"]
    if bad:
        print("FAIL: an ordinary request failed, /health p99 >= 1 s, or the server died",
              file=sys.stderr)
        print("".join(srv.log[-20:]), file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
