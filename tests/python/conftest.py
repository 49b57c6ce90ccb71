"""Shared by the Python package's tests: the model (loaded once), the d2o binary, a server.

Run by scripts/test.sh with PYTHONPATH holding build/python (the package as the release build
makes it) and pytest; $D2O_MODEL names the model (scripts/setup.sh fetches it) and $D2O_BIN the
d2o binary (default: build/d2o). Without the model every test is skipped.
"""
import json
import os
import re
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest

import d2o

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
THREADS = 2
CTX = 2048


def model_path():
    path = os.environ.get("D2O_MODEL", "")
    if not path or not os.path.exists(path):
        pytest.skip("$D2O_MODEL is not set or missing (scripts/setup.sh)")
    return path


def d2o_bin():
    path = os.environ.get("D2O_BIN") or os.path.join(ROOT, "build", "d2o")
    if not os.path.exists(path):
        pytest.skip("no d2o binary at %s (set $D2O_BIN)" % path)
    return path


def kjv(chars):
    text_dir = os.environ.get("D2O_TEXT_DIR") or os.path.join(ROOT, "cache", "texts")
    path = os.path.join(text_dir, "kjv.txt")
    if not os.path.exists(path):
        pytest.skip("no kjv.txt in $D2O_TEXT_DIR (scripts/setup.sh)")
    with open(path, encoding="utf-8") as f:
        return f.read(200000)[100000:100000 + chars]


@pytest.fixture(scope="session")
def model():
    return d2o.Model(model_path(), threads=THREADS, ctx=CTX)


class Server:
    """`d2o serve` on a free loopback port."""

    def __init__(self, *extra):
        cmd = [d2o_bin(), "serve", "-m", model_path(), "--port", "0", "-t", str(THREADS), "-c",
               str(CTX), "--kv-mem", "256M", *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        port, deadline = None, time.monotonic() + 60
        while port is None and time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            m = re.search(r"on http://127\.0\.0\.1:(\d+)", line)
            port = int(m.group(1)) if m else None
        if port is None:
            self.proc.kill()
            raise RuntimeError("the server did not start: " + (self.proc.stderr.read() or ""))
        threading.Thread(target=lambda: [None for _ in self.proc.stderr], daemon=True).start()
        self.base = "http://127.0.0.1:%d" % port

    def post(self, path, body):
        req = urllib.request.Request(self.base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="session")
def server():
    model_path()
    srv = Server()
    yield srv
    srv.stop()
