#!/usr/bin/env python3
"""End-to-end test of `d2o serve` driven by the official `openai` Python package.

Usage: serve_openai_test.py PATH_TO_D2O
Needs $D2O_MODEL (SmolLM2-135M-Instruct) and the `openai` package on the path (scripts/setup.sh
--test-data installs it into $D2O_CACHE_DIR/pylib-openai); exits 77 (skipped) without them.

Checks: greedy chat answers equal `d2o run --chat` for the same message and policy, one at a
time and with 16 requests in flight; streaming gives the same text and ends with [DONE]; stop
strings; seeds; errors surface as the package's exception types (400, 401, 413, invalid UTF-8);
sessions prefill only the new turn and answer as a fresh request would, are cut back to the
prefix they share with a diverging request (rebuilt under another policy), and keep their KV
bytes flat under a budget policy; a client that goes away
mid-stream frees its sequence; SIGTERM lets a request in flight finish. The server compresses
as `d2o run` does (`--compress always`), so that their answers can be compared.
"""
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from serve_common import SKIP, check, fail, require_model, start_server


_cache = os.environ.get("D2O_CACHE_DIR") or os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "cache")
sys.path.insert(0, os.path.join(_cache, "pylib-openai"))
try:
    import openai
except ImportError:
    print("skipped: the openai package is not installed (scripts/setup.sh --test-data)")
    sys.exit(SKIP)

D2O = sys.argv[1]
MODEL = require_model()

KEY = "test-key"
CTX = 512
N = 24  # tokens per greedy answer
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three colours.",
    "Explain what a prime number is.",
]
POLICIES = ["full", "d2o:ratio=0.2"]


class Server:
    def __init__(self, kv_mem="256M", parallel=16, *extra):
        self.proc, self.port, self.log, self.reader = start_server(
            [D2O, "serve", "-m", MODEL, "--port", "0", "-t", "2", "-c", str(CTX), "--kv-mem", kv_mem,
             "--parallel", str(parallel), "--api-key", KEY, "--max-body", "64K",
             "--compress", "always", *extra])
        self.base = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.base + "/v1", api_key=KEY, max_retries=0,
                                    timeout=120)

    def raw(self, path, body=None, headers=None, method=None):
        """(status, headers, body bytes) of a plain HTTP request."""
        h = {"Authorization": "Bearer " + KEY}
        h.update(headers or {})
        req = urllib.request.Request(self.base + path, data=body, headers=h, method=method)
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, dict(r.headers), r.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read()

    def metric(self, name):
        _, _, body = self.raw("/metrics")
        for line in body.decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        fail("metric %s missing" % name)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def cli_answer(prompt, kv):
    out = subprocess.run([D2O, "run", "--chat", "-m", MODEL, "-p", prompt, "-n", str(N), "--kv", kv,
                          "-t", "1", "-c", str(CTX)],
                         capture_output=True, text=True, timeout=120)
    check(out.returncode == 0, "d2o run failed: " + out.stderr)
    check(out.stdout.endswith("\n"), "d2o run output should end with a newline")
    return out.stdout[:-1]


def chat(srv, prompt, kv, **kw):
    return srv.client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": prompt}], max_tokens=N, temperature=0,
        extra_body={"kv": kv}, **kw)


def main():
    # The command line's answers, computed while the server starts.
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        want_f = {(p, kv): ex.submit(cli_answer, p, kv) for p in PROMPTS for kv in POLICIES}
        srv = Server()
        want = {k: f.result() for k, f in want_f.items()}
    try:
        run_checks(srv, want)
    finally:
        srv.stop()
    small = Server("8M", 1, "--queue", "1")
    try:
        run_limit_checks(small)
    finally:
        small.stop()
    print("ok")


def run_limit_checks(srv):
    """A request that can never fit is a 400 with both sizes; a full queue is a 503."""
    try:
        srv.client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=CTX - 64, temperature=0)
        fail("a request larger than the KV cap should fail")
    except openai.BadRequestError as e:
        check("MiB" in str(e) and "cap" in str(e), "the refusal gives both sizes: %s" % e)
    body = json.dumps({"messages": [{"role": "user", "content": "Count to ten."}],
                       "max_tokens": 32, "temperature": 0}).encode()
    with concurrent.futures.ThreadPoolExecutor(6) as ex:
        got = list(ex.map(lambda _: srv.raw("/v1/chat/completions", body,
                                            {"Content-Type": "application/json"}), range(6)))
    statuses = sorted(st for st, _, _ in got)
    check(set(statuses) <= {200, 503} and 200 in statuses and 503 in statuses,
          "a full queue answers 503, the rest complete: %s" % statuses)
    for st, hdrs, b in got:
        if st == 503:
            check(hdrs.get("Retry-After") == "1", "503 carries Retry-After")
            check(json.loads(b)["error"]["code"] == "queue_full", "queue_full code")


def run_checks(srv, want):
    c = srv.client
    check(c.models.list().data[0].id != "", "/v1/models lists the model")

    # Greedy parity, one at a time.
    for (p, kv), text in want.items():
        r = chat(srv, p, kv)
        check(r.choices[0].message.content == text,
              f"greedy answer differs from d2o run --chat ({kv}, {p!r}):\n"
              f"  server: {r.choices[0].message.content!r}\n  cli:    {text!r}")
        check(r.choices[0].finish_reason in ("stop", "length"), "finish_reason")
        check(r.usage.completion_tokens <= N and r.usage.prompt_tokens > 0, "usage")

    # 16 in flight at once: the same answers.
    jobs = [(p, kv) for p in PROMPTS for kv in POLICIES] * 2
    with concurrent.futures.ThreadPoolExecutor(16) as ex:
        got = list(ex.map(lambda j: chat(srv, *j).choices[0].message.content, jobs))
    for j, text in zip(jobs, got):
        check(text == want[j], f"answer with 16 in flight differs for {j}: {text!r} vs {want[j]!r}")

    # Streaming: same text, finish_reason on the last chunk, usage when asked for.
    p, kv = PROMPTS[0], "full"
    pieces, finish, usage = [], None, None
    for ch in chat(srv, p, kv, stream=True, stream_options={"include_usage": True}):
        if ch.usage:
            usage = ch.usage
        for choice in ch.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            if choice.finish_reason:
                finish = choice.finish_reason
    check("".join(pieces) == want[(p, kv)], "streamed text differs: %r" % "".join(pieces))
    check(finish in ("stop", "length"), "stream finish_reason")
    check(usage is not None and usage.completion_tokens > 0, "stream usage")
    _, hdrs, body = srv.raw("/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": p}], "max_tokens": 3, "stream": True}).encode(),
        {"Content-Type": "application/json"})
    check(body.decode().rstrip().endswith("data: [DONE]"), "SSE ends with data: [DONE]")

    # Stop strings: the answer cut before the first occurrence.
    full = want[(PROMPTS[1], "full")]
    stop = full[len(full) // 2:len(full) // 2 + 3]
    check(len(stop) == 3, "a stop string from the answer")
    r = chat(srv, PROMPTS[1], "full", stop=[stop])
    check(r.choices[0].message.content == full[:full.index(stop)],
          "stop string: %r (stop %r)" % (r.choices[0].message.content, stop))
    check(r.choices[0].finish_reason == "stop", "finish_reason stop")

    # Seeds: the same seed draws the same text; different seeds differ somewhere.
    def sampled(seed):
        return c.chat.completions.create(
            model="m", messages=[{"role": "user", "content": PROMPTS[3]}], max_tokens=N,
            temperature=1.0, seed=seed).choices[0].message.content
    a = sampled(7)
    check(a == sampled(7), "same seed, same text")
    check(len({a, sampled(8), sampled(9)}) > 1, "different seeds give different texts")

    # Errors as the package's exception types, and the server keeps serving.
    def expect(exc, fn, needle):
        try:
            fn()
        except exc as e:
            check(needle in str(e), f"{exc.__name__} should mention {needle!r}: {e}")
            return
        fail(f"expected {exc.__name__} ({needle})")
    msgs = [{"role": "user", "content": "hi"}]
    expect(openai.BadRequestError,
           lambda: c.chat.completions.create(model="m", messages=msgs, max_tokens=0), "max_tokens")
    expect(openai.BadRequestError,
           lambda: c.chat.completions.create(model="m", messages=msgs, max_tokens=CTX + 1),
           "context")
    expect(openai.BadRequestError,
           lambda: c.chat.completions.create(model="m", messages=msgs,
                                             extra_body={"kv": "d2o:ratio=7"}), "ratio")
    expect(openai.BadRequestError,
           lambda: c.chat.completions.create(model="m", messages=msgs,
                                             extra_body={"session": "bad id!"}), "session")
    expect(openai.BadRequestError,
           lambda: c.chat.completions.create(model="m", messages=msgs, temperature="hot"),
           "temperature")
    long_text = "word " * (CTX + 50)
    expect(openai.BadRequestError,
           lambda: c.chat.completions.create(
               model="m", messages=[{"role": "user", "content": long_text}]), "context")
    bad = openai.OpenAI(base_url=srv.base + "/v1", api_key="wrong", max_retries=0)
    expect(openai.AuthenticationError,
           lambda: bad.chat.completions.create(model="m", messages=msgs), "API key")
    st, _, body = srv.raw("/v1/models", headers={"Authorization": ""})
    check(st == 401 and b"error" in body, "missing key: 401")
    for payload, status, needle in [
            (b"", 400, "empty"), (b"{", 400, "JSON"), (b'{"messages": "\xff"}', 400, "UTF-8"),
            (b"x" * (70 << 10), 413, "limit")]:
        st, _, body = srv.raw("/v1/chat/completions", payload, {"Content-Type": "application/json"})
        check(st == status, f"{payload[:20]!r}: status {st}, want {status}")
        err = json.loads(body)["error"]
        check(needle in err["message"], f"{payload[:20]!r}: {err}")
    st, _, body = srv.raw("/health")
    check(st == 200, "still serving after bad input")

    # Tokenize / detokenize round trip.
    st, _, body = srv.raw("/tokenize", json.dumps({"content": "Hello world"}).encode())
    toks = json.loads(body)["tokens"]
    st, _, body = srv.raw("/detokenize", json.dumps({"tokens": toks}).encode())
    check(json.loads(body)["content"] == "Hello world", "tokenize round trip")

    # Sessions: the second turn prefills only itself and answers as a fresh request would.
    turn1 = [{"role": "user", "content": PROMPTS[0]}]
    r1 = c.chat.completions.create(model="m", messages=turn1, max_tokens=N, temperature=0,
                                   extra_body={"session": "conv-1"})
    check(r1.model_extra["session"]["rebuilt"] is False, "new session not rebuilt")
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "And of Germany?"}]
    r2 = c.chat.completions.create(model="m", messages=turn2, max_tokens=N, temperature=0,
                                   extra_body={"session": "conv-1"})
    cached = r2.usage.prompt_tokens_details.cached_tokens
    check(cached > r1.usage.prompt_tokens, f"the second turn reuses the first ({cached} cached)")
    fresh = c.chat.completions.create(model="m", messages=turn2, max_tokens=N, temperature=0)
    check(r2.choices[0].message.content == fresh.choices[0].message.content,
          "a continued session answers as a fresh request")
    # Back to the first turn (a regenerated answer): the full cache keeps what the prompts share.
    r3 = c.chat.completions.create(model="m", messages=turn1, max_tokens=N, temperature=0,
                                   extra_body={"session": "conv-1"})
    info3 = r3.model_extra["session"]
    check(info3["rebuilt"] is False and info3["truncated"] is True,
          "a diverging conversation is cut back to the common prefix: %s" % info3)
    check(r3.usage.prompt_tokens_details.cached_tokens == r1.usage.prompt_tokens - 1,
          "all of the first turn but its last token kept")
    check(r3.choices[0].message.content == r1.choices[0].message.content,
          "and it answers as the first turn did")
    # Another policy cannot use the kept cache: rebuilt.
    r4 = c.chat.completions.create(model="m", messages=turn1, max_tokens=N, temperature=0,
                                   extra_body={"session": "conv-1", "kv": "h2o:budget=64"})
    check(r4.model_extra["session"]["rebuilt"] is True and r4.model_extra["session_rebuilt"],
          "another policy rebuilds the session")
    check(r4.usage.prompt_tokens_details.cached_tokens == 0, "nothing cached when rebuilt")
    check(srv.metric('d2o_session_rebuilds_total{reason="policy"}') == 1, "the rebuild counted")
    check(srv.metric("d2o_session_truncations_total") == 1, "the cut counted")
    check(srv.metric("d2o_sessions") >= 1, "sessions gauge")

    # A session under d2o:budget=B keeps its KV bytes flat once the budget is reached, and each
    # turn prefills only itself.
    conv, seen = [], []
    for turn in range(5):
        conv.append({"role": "user", "content": "Say something about number %d." % turn})
        r = c.chat.completions.create(model="m", messages=conv, max_tokens=16, temperature=0,
                                      extra_body={"session": "budget", "kv": "d2o:budget=32"})
        info = r.model_extra["session"]
        check(not info["rebuilt"], "budget session continues")
        if seen:
            check(r.usage.prompt_tokens_details.cached_tokens == seen[-1]["n_past"],
                  "turn %d prefills only itself" % turn)
        seen.append(info)
        conv.append({"role": "assistant", "content": r.choices[0].message.content})
    check(seen[-1]["n_past"] > 3 * 32, "the conversation outgrew the budget")
    check(seen[-1]["kv_bytes"] == seen[-2]["kv_bytes"] == seen[-3]["kv_bytes"],
          "KV bytes flat past the budget: %s" % [x["kv_bytes"] for x in seen])
    check(seen[-1]["kv_bytes"] < seen[-1]["full_kv_bytes"] / 2, "compressed against full")

    # A client that goes away mid-stream frees its sequence. (ignore_eos: an answer that ended
    # by itself before the server saw the client go would be counted ok, not cancelled.)
    before = srv.metric('d2o_requests_total{outcome="cancelled"}')
    stream = c.chat.completions.create(model="m", messages=msgs, max_tokens=CTX - 100,
                                       temperature=0, stream=True,
                                       extra_body={"kv": "streaming:budget=32",
                                                   "ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    deadline = time.monotonic() + 30  # a bound against hanging, not a timing check
    while srv.metric("d2o_sequences_running") > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    check(srv.metric("d2o_sequences_running") == 0, "the abandoned stream's sequence is freed")
    check(srv.metric('d2o_requests_total{outcome="cancelled"}') == before + 1, "counted cancelled")
    check(srv.metric("d2o_kv_reserved_bytes") == srv.metric("d2o_kv_session_bytes"),
          "only kept sessions hold memory when idle")

    # SIGTERM: the request in flight finishes, then the server exits cleanly.
    result = {}
    t = threading.Thread(target=lambda: result.update(r=chat(srv, PROMPTS[2], "full")))
    t.start()
    deadline = time.monotonic() + 30
    while srv.metric("d2o_sequences_running") == 0 and t.is_alive() and \
            time.monotonic() < deadline:
        time.sleep(0.01)
    srv.proc.send_signal(signal.SIGTERM)
    t.join(60)
    check("r" in result and result["r"].choices[0].message.content == want[(PROMPTS[2], "full")],
          "the request in flight at SIGTERM completes")
    check(srv.proc.wait(timeout=30) == 0, "exit status 0 after SIGTERM")


if __name__ == "__main__":
    main()
