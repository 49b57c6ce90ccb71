"""What the `d2o serve` end-to-end tests share: failing and skipping, the model to serve, and
starting a server on a free loopback port."""
import os
import re
import subprocess
import sys
import threading
import time


SKIP = 77  # the exit status ctest counts as skipped (SKIP_RETURN_CODE)


def fail(msg):
    print("FAIL: " + msg, file=sys.stderr)
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)


def require_model():
    """$D2O_MODEL (SmolLM2-135M-Instruct, fetched by scripts/setup.sh); exits SKIP without it."""
    model = os.environ.get("D2O_MODEL", "")
    if not model or not os.path.exists(model):
        print("skipped: $D2O_MODEL is not set or missing (scripts/setup.sh)")
        sys.exit(SKIP)
    return model


def start_server(cmd, timeout=60):
    """Runs `cmd` (a `d2o serve ... --port 0` command line) and waits for the port it announces.

    Returns (process, port, log, reader): `log` collects the server's stderr lines from then on,
    read by the thread `reader` so that the pipe never fills. Exits the test (status 1) with the
    server's output when it does not start within `timeout` seconds.
    """
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    port = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        m = re.search(r"on http://127\.0\.0\.1:(\d+)", line)
        if m:
            port = int(m.group(1))
            break
    if port is None:
        proc.kill()
        print("FAIL: the server did not start: " + (proc.stderr.read() or ""), file=sys.stderr)
        sys.exit(1)
    log = []
    reader = threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True)
    reader.start()
    return proc, port, log, reader
