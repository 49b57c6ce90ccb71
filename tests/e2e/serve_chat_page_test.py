#!/usr/bin/env python3
"""End-to-end test of the chat page of `d2o serve` (GET /) in headless Chromium.

Usage: serve_chat_page_test.py PATH_TO_D2O ARTIFACT_DIR
Needs $D2O_MODEL (SmolLM2-135M-Instruct) and Debian's `chromium` (scripts/setup.sh --test-data
installs it); exits 77 (skipped) without them. Leaves ARTIFACT_DIR/chat_page.png, a screenshot
of the page after the two turns.

The real SmolLM2 behind `d2o serve` (with an API key, which the page sends); Chromium loads the
page, the test types two turns into it (policy `full`, greedy, a session id) and presses Send;
each answer is read from the DOM once the page has streamed it. Checks: each answer is
non-empty, arrived as several Server-Sent Events, and equals the answer to the same messages
sent to the API without the page (non-streamed, no session); the second turn continued the
session (its prompt tokens came from the kept cache) and the page shows the KV bytes held.

How Chromium is driven: the DevTools protocol over `--remote-debugging-pipe` (JSON messages
separated by NUL bytes on file descriptors 3 and 4 of the browser), which needs nothing beyond
Python's standard library; a websocket client (`--remote-debugging-port`) would be a new PyPI
dependency, and `--dump-dom` cannot type into the page or wait for a stream to end. The page
is driven through its own controls (values set, Send clicked), and its state is read from the
DOM: <body data-state="idle|streaming|error" data-turns="N">, each finished answer marked
data-done, its number of received events in data-events.
"""
import base64
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

from serve_common import SKIP, check, fail, require_model, start_server


D2O = sys.argv[1]
ARTIFACTS = sys.argv[2] if len(sys.argv) > 2 else "."
MODEL = require_model()
CHROMIUM = shutil.which("chromium")
if not CHROMIUM:
    print("skipped: Debian's chromium is not installed (scripts/setup.sh --test-data, or "
          "apt-get install chromium)")
    sys.exit(SKIP)

KEY = "page-key"
N = 24  # max_tokens of each turn
TURNS = ["What is the capital of France?", "And of Germany? Answer in one sentence."]
KV = "full"
SESSION = "page-test-1"
BOUND_S = 120  # a bound against hanging, not a timing check


class Browser:
    """Headless Chromium, driven by the DevTools protocol over a pipe."""

    def __init__(self, profile):
        to_browser_r, self.to_browser = os.pipe()
        self.from_browser, from_browser_w = os.pipe()
        args = ["--headless", "--remote-debugging-pipe", "--user-data-dir=" + profile,
                "--no-first-run", "--no-default-browser-check", "--disable-gpu",
                "--disable-extensions", "--disable-background-networking", "--disable-sync",
                "--disable-component-update", "--disable-dev-shm-usage", "--mute-audio",
                "--password-store=basic", "--hide-scrollbars", "--window-size=1000,760",
                "about:blank"]
        if os.geteuid() == 0:
            args.insert(0, "--no-sandbox")  # Chromium refuses to run as root with its sandbox
        # The protocol's descriptors must be 3 (commands in) and 4 (replies out): bash moves the
        # pipe ends there through descriptors 10 and 11, whatever numbers they have here.
        script = 'exec 10<&"$R" 11>&"$W" && exec 3<&10 4>&11 10<&- 11>&- && exec "$@"'
        env = dict(os.environ, R=str(to_browser_r), W=str(from_browser_w))
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(["bash", "-c", script, "bash", CHROMIUM, *args], env=env,
                                     pass_fds=(to_browser_r, from_browser_w),
                                     stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self.next_id = 0
        self.buf = b""
        self.lock = threading.Lock()

    def log_text(self):
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-3000:]

    def call(self, method, params=None, session=None):
        """Sends one command and returns its result (events in between are skipped)."""
        with self.lock:
            self.next_id += 1
            msg = {"id": self.next_id, "method": method, "params": params or {}}
            if session:
                msg["sessionId"] = session
            os.write(self.to_browser, json.dumps(msg).encode() + b"\0")
            while True:
                while b"\0" not in self.buf:
                    chunk = os.read(self.from_browser, 1 << 16)
                    if not chunk:
                        fail("Chromium went away:\n" + self.log_text())
                    self.buf += chunk
                raw, self.buf = self.buf.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self.next_id:
                    if "error" in reply:
                        fail(f"DevTools {method}: {reply['error']}")
                    return reply.get("result", {})

    def close(self):
        try:
            os.write(self.to_browser, json.dumps({"id": 0, "method": "Browser.close"}).encode()
                     + b"\0")
            self.proc.wait(timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


class Page:
    def __init__(self, browser):
        self.b = browser
        target = browser.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = browser.call("Target.attachToTarget",
                                    {"targetId": target, "flatten": True})["sessionId"]

    def call(self, method, params=None):
        return self.b.call(method, params, self.session)

    def eval(self, expr):
        r = self.call("Runtime.evaluate",
                      {"expression": expr, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in r:
            fail(f"page script {expr!r}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait_for(self, expr, what):
        deadline = time.monotonic() + BOUND_S
        while time.monotonic() < deadline:
            v = self.eval(expr)
            if v:
                return v
            time.sleep(0.1)
        fail(f"the page did not get to: {what} (state {self.eval('document.body.dataset.state')})")


class Server:
    def __init__(self):
        self.proc, self.port, self.log, self.reader = start_server(
            [D2O, "serve", "-m", MODEL, "--port", "0", "-t", "2", "-c", "512", "--kv-mem", "64M",
             "--parallel", "2", "--api-key", KEY])
        self.base = f"http://127.0.0.1:{self.port}"

    def chat(self, messages):
        body = json.dumps({"messages": messages, "max_tokens": N, "temperature": 0, "kv": KV})
        req = urllib.request.Request(self.base + "/v1/chat/completions", data=body.encode(),
                                     headers={"Authorization": "Bearer " + KEY,
                                              "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=BOUND_S) as r:
                return json.loads(r.read())["choices"][0]["message"]["content"]
        except urllib.error.HTTPError as e:
            fail(f"API request failed: {e.code} {e.read()!r}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def main():
    os.makedirs(ARTIFACTS, exist_ok=True)
    shot = os.path.join(ARTIFACTS, "chat_page.png")
    if os.path.exists(shot):
        os.remove(shot)
    with tempfile.TemporaryDirectory(prefix="d2o-chromium-") as profile:
        browser = Browser(profile)
        srv = Server()
        try:
            run(browser, srv, shot)
        finally:
            browser.close()
            srv.stop()
    print("ok (screenshot: %s)" % shot)


def run(browser, srv, shot):
    page = Page(browser)
    page.call("Page.navigate", {"url": srv.base + "/"})
    page.wait_for("document.readyState === 'complete' && !!document.getElementById('send')",
                  "the page loaded")
    check(page.eval("document.title") == "d2o chat", "the page's title")
    # The page's own controls: the key, greedy decoding of N tokens under `full`, a session.
    page.eval(f"""(() => {{
        const set = (id, v) => {{ document.getElementById(id).value = v; }};
        set('api_key', {json.dumps(KEY)}); set('kv', {json.dumps(KV)});
        set('max_tokens', '{N}'); set('temperature', '0'); set('session', {json.dumps(SESSION)});
        return true; }})()""")
    messages, answers = [], []
    for i, text in enumerate(TURNS):
        page.eval(f"""(() => {{
            document.getElementById('prompt').value = {json.dumps(text)};
            document.getElementById('send').click(); return true; }})()""")
        page.wait_for(f"document.body.dataset.state === 'error' || "
                      f"(document.body.dataset.state === 'idle' && "
                      f"document.body.dataset.turns === '{i + 1}')", f"turn {i + 1} answered")
        if page.eval("document.body.dataset.state") != "idle":
            fail("turn %d failed in the page: %r" % (
                i + 1, page.eval("document.querySelector('.msg.error').textContent")))
        done = page.eval("""Array.from(document.querySelectorAll('.msg.assistant'),
            (e) => ({text: e.textContent, done: e.dataset.done === '1',
                     events: +(e.dataset.events || 0)}))""")
        check(len(done) == i + 1 and done[i]["done"], "one finished answer per turn: %r" % done)
        answer = done[i]["text"]
        print(f"turn {i + 1}: {done[i]['events']} events: {answer!r}")
        check(answer.strip() != "", f"turn {i + 1}: the answer is empty")
        check(done[i]["events"] > 1, f"turn {i + 1}: the answer came in one piece, not streamed")
        messages.append({"role": "user", "content": text})
        want = srv.chat(messages)
        check(answer == want, f"turn {i + 1}: the page shows {answer!r}, the API answers {want!r}")
        messages.append({"role": "assistant", "content": answer})
        answers.append(answer)
    meta = page.eval("Array.from(document.querySelectorAll('.meta'), (e) => e.textContent)")
    print("meta:", meta)
    check(len(meta) == 2 and all("KV held" in m for m in meta), "KV bytes shown per turn")
    cached = re.search(r"\((\d+) from the session's cache\)", meta[1])
    check(cached and int(cached.group(1)) > 0, "the second turn continued the session: %r" % meta)
    png = base64.b64decode(page.call("Page.captureScreenshot", {"format": "png"})["data"])
    check(png[:8] == b"\x89PNG\r\n\x1a\n", "a PNG screenshot")
    with open(shot, "wb") as f:
        f.write(png)


if __name__ == "__main__":
    main()
