#!/usr/bin/env python3
"""`d2o serve --session-dir` killed with SIGKILL at random moments while it writes sessions.

Each round starts a server on the same directory and first checks what the last one left:
  - no temporary file (`*.tmp`) once the server is up (a killed save may leave one; the next
    start removes it), and
  - every conversation goes on: its next turn, sent under its session id, either continues the
    session from its file (tokens cached) or says it was rebuilt, and when it continued, its
    greedy answer is the one of the same messages sent without a session (a file that loads
    wrongly would give another);
then sends one more turn of every conversation at once (each ending in a save, as
--session-save turn writes) and kills the server with SIGKILL at a random moment: in odd rounds
within 40 ms of the first answer (among the saves), in even ones anywhere in the turns. Conversations are long enough (a long first message) that a save takes a
while, and start again once they near the context.

Prints JSON: rounds, kills that left a temporary file behind (the kill fell inside a save),
conversations continued from their files / rebuilt / answered otherwise than without a session,
temporary files seen after a start. Exits 1 when a file loaded wrongly, a temporary file
survived a start, a request failed on a server that was not being killed, or a server did not
start. Python's standard library only; every server it starts is stopped.

  scripts/session_kills.py --d2o build/d2o -m cache/models/SmolLM2-135M-Instruct.Q4_1.gguf \\
      --kills 100
"""
import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

N = 8  # tokens per greedy answer
LONG = ("Here are some notes about the weather, the sea and the mountains of a small island: " +
        " ".join("Day %d: the wind came from the west, the sea was calm and the sky was clear."
                 % d for d in range(12)))


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d2o", default="build/d2o")
    ap.add_argument("-m", "--model", default=os.environ.get("D2O_MODEL", ""))
    ap.add_argument("--kills", type=int, default=100)
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--json", help="also write the JSON here")
    return ap.parse_args()


def start(args, d):
    proc = subprocess.Popen([args.d2o, "serve", "-m", args.model, "--port", "0", "-t",
                             str(args.threads), "-c", "1024", "--kv-mem", "256M",
                             "--session-dir", d, "--session-save", "turn"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        m = re.search(r"on http://127\.0\.0\.1:(\d+)", line)
        if m:
            threading.Thread(target=lambda: proc.stderr.read(), daemon=True).start()
            return proc, int(m.group(1))
    proc.kill()
    proc.wait()
    return None, None


def chat(port, messages, session=None, timeout=120):
    body = {"messages": messages, "max_tokens": N, "temperature": 0, "kv": "full"}
    if session is not None:
        body["session"] = session
    req = urllib.request.Request("http://127.0.0.1:%d/v1/chat/completions" % port,
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def text(r):
    return r["choices"][0]["message"]["content"]


class Conversation:
    def __init__(self, i):
        self.i, self.gen = i, 0
        self.reset()

    def reset(self):
        self.gen += 1
        self.id = "k%d-%d" % (self.i, self.gen)
        self.messages = [{"role": "user", "content": "%s Question %d: which day was windy?"
                          % (LONG, self.i)}]

    def answered(self, r):
        self.messages += [{"role": "assistant", "content": text(r)},
                          {"role": "user", "content": "Tell me more (%d)." % len(self.messages)}]
        if r["usage"]["prompt_tokens"] > 800:  # near the context: a new conversation
            self.reset()


def main():
    args = parse_args()
    if not args.model or not os.path.exists(args.model):
        print("no model (-m or $D2O_MODEL)", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    tmp = tempfile.mkdtemp(prefix="d2o-kills-")
    d = os.path.join(tmp, "sessions")
    convs = [Conversation(i) for i in range(args.conversations)]
    out = {"kills": 0, "kills_during_save": 0, "continued": 0, "rebuilt": 0, "fresh": 0,
           "loaded_wrongly": 0, "tmp_after_start": 0, "errors": []}
    save_window = [0.2, 1.5]  # seconds after the turns are sent, adjusted to what is measured
    proc = None
    try:
        for k in range(args.kills + 1):
            proc, port = start(args, d)
            if proc is None:
                out["errors"].append("round %d: the server did not start" % k)
                break
            stray = [n for n in os.listdir(d) if n.endswith(".tmp")] if os.path.isdir(d) else []
            out["tmp_after_start"] += len(stray)
            # What the last server left: each conversation goes on, as it would without a session.
            for c in convs:
                try:
                    r = chat(port, c.messages, c.id)
                    if r["session"]["rebuilt"]:
                        out["rebuilt"] += 1
                    elif r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0:
                        out["continued"] += 1
                        if text(r) != text(chat(port, c.messages)):
                            out["loaded_wrongly"] += 1
                            out["errors"].append("round %d: %s answered otherwise than without "
                                                 "a session" % (k, c.id))
                    else:
                        out["fresh"] += 1
                    c.answered(r)
                except Exception as e:  # noqa: BLE001
                    out["errors"].append("round %d: %s: %s" % (k, c.id, e))
            if k == args.kills:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)
                break
            # One more turn of each at once, and SIGKILL among their saves.
            done = []
            first = threading.Event()
            t0 = time.monotonic()

            def turn(c):
                try:
                    c.answered(chat(port, c.messages, c.id))
                    done.append(time.monotonic() - t0)
                    first.set()
                except Exception:  # noqa: BLE001 (killed: the turn is lost, as for a client)
                    pass
            threads = [threading.Thread(target=turn, args=(c,)) for c in convs]
            for t in threads:
                t.start()
            if k % 2:
                # A save is written as each turn ends: within a few tens of milliseconds of the
                # first answer.
                first.wait(timeout=60)
                time.sleep(rng.uniform(0, 0.04))
            else:
                time.sleep(rng.uniform(*save_window))
            before = set(os.listdir(d))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            out["kills"] += 1
            if any(n.endswith(".tmp") for n in before | set(os.listdir(d))):
                out["kills_during_save"] += 1
            for t in threads:
                t.join(timeout=60)
            if len(done) == len(convs) and done:  # all answered before the kill: aim earlier
                save_window = [0.5 * min(done), max(done) + 0.05]
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    out["errors"] = out["errors"][:10]
    out["load_avg"] = os.getloadavg()
    text_out = json.dumps(out, indent=1)
    print(text_out)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text_out + "\n")
    bad = out["loaded_wrongly"] or out["tmp_after_start"] or out["errors"] or not out["continued"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
