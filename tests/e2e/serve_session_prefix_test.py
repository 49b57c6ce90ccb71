#!/usr/bin/env python3
"""End-to-end test of `d2o serve` sessions cut back to a common prefix.

Usage: serve_session_prefix_test.py PATH_TO_D2O
Needs $D2O_MODEL (SmolLM2-135M-Instruct); exits 77 (skipped) without it.

A conversation of about 1,500 tokens (a document, an answer, a question) is held in a session
with the full cache; then its last user message is edited. The edited request keeps the common
prefix of its tokens and the session's (`session.truncated`, `cached_tokens`, `dropped_tokens`,
and the /metrics counters say so) and answers, greedily, exactly as a fresh request of the edited
conversation without a session. The same holds for `d2o:budget=4096`, a compressing policy whose
cache has not been compacted yet. Under `d2o:ratio=0.2`, compacted after the first turn, the
session keeps at most what that compaction left intact: rebuilt (`prefix_not_held`), or cut to
fewer tokens than the first turn, and either way the response's counts add up. Each time also
prints how long the edited turn took against the fresh request (a figure, not a check). The
server compresses from the first turn (`--compress always`): under `when-needed` with room to
spare every session is still full and keeps all its tokens.
"""
import json
import sys
import time
import urllib.error
import urllib.request

from serve_common import check, require_model, start_server


D2O = sys.argv[1]
MODEL = require_model()

N = 16  # tokens per greedy answer
TEXT = ("The harbour town kept its lamps burning through the winter. Every morning the baker "
        "opened the shutters at six, the ferry left for the island at seven, and the old clock "
        "on the customs house struck eight a little late, as it had done for forty years. In "
        "the afternoons fishermen mended their nets on the quay and argued about the weather, "
        "while children ran between the stacked crates and the gulls waited for scraps. ")
DOC = TEXT * 16


class Server:
    def __init__(self):
        self.proc, self.port, self.log, self.reader = start_server(
            [D2O, "serve", "-m", MODEL, "--port", "0", "-t", "2", "-c", "4096", "--kv-mem",
             "512M", "--parallel", "2", "--compress", "always"])
        self.base = f"http://127.0.0.1:{self.port}"

    def chat(self, messages, session=None, kv="full"):
        body = {"messages": messages, "max_tokens": N, "temperature": 0, "kv": kv}
        if session:
            body["session"] = session
        req = urllib.request.Request(self.base + "/v1/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t0 = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                out = json.loads(r.read())
        except urllib.error.HTTPError as e:
            check(False, "HTTP %d: %s" % (e.code, e.read()[:300]))
        out["seconds"] = time.monotonic() - t0
        return out

    def metric(self, name):
        with urllib.request.urlopen(self.base + "/metrics", timeout=60) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[-1])
        check(False, "metric %s missing" % name)

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=60)


def text_of(r):
    return r["choices"][0]["message"]["content"]


def cached(r):
    return r["usage"]["prompt_tokens_details"]["cached_tokens"]


def conversation(srv, kv, session):
    """Turn 1 (the document), turn 2 (a question) in `session`; returns the messages so far
    without the last question, turn 1's response and turn 2's."""
    msgs = [{"role": "user", "content": DOC + "\nWhat does the baker do every morning?"}]
    one = srv.chat(msgs, session, kv)
    msgs.append({"role": "assistant", "content": text_of(one)})
    two = srv.chat(msgs + [{"role": "user", "content": "When does the ferry leave?"}], session, kv)
    check(two["session"]["rebuilt"] is False and not two["session"]["truncated"],
          "%s: the second turn continues the session: %s" % (kv, two["session"]))
    check(cached(two) == one["session"]["n_past"], "%s: it prefills only itself" % kv)
    return msgs, one, two


def main():
    srv = Server()
    try:
        kept_before = srv.metric("d2o_session_truncation_kept_tokens_total")
        for i, kv in enumerate(["full", "d2o:budget=4096"]):
            msgs, one, two = conversation(srv, kv, "edit-%d" % i)
            edited = msgs + [{"role": "user", "content": "When does the clock strike?"}]
            cut = srv.chat(edited, "edit-%d" % i, kv)
            info = cut["session"]
            prompt = cut["usage"]["prompt_tokens"]
            check(prompt >= 1400, "%s: a conversation of about 1,500 tokens (%d)" % (kv, prompt))
            check(info["rebuilt"] is False and info["truncated"] is True and
                  cut["session_rebuilt"] is False, "%s: cut, not rebuilt: %s" % (kv, info))
            # The prefix: turn 1 and its answer, and the edited message's opening template tokens.
            check(one["session"]["n_past"] < cached(cut) < prompt,
                  "%s: cached %d between turn 1's %d and the prompt's %d" %
                  (kv, cached(cut), one["session"]["n_past"], prompt))
            check(info["dropped_tokens"] == two["session"]["n_past"] - cached(cut),
                  "%s: dropped %d = held %d - kept %d" %
                  (kv, info["dropped_tokens"], two["session"]["n_past"], cached(cut)))
            check(info["n_past"] == prompt + cut["usage"]["completion_tokens"] - 1 or
                  info["n_past"] == prompt + cut["usage"]["completion_tokens"],
                  "%s: the session holds the edited conversation" % kv)
            fresh = srv.chat(edited, None, kv)
            check(cached(fresh) == 0, "a request without a session prefills everything")
            check(text_of(cut) == text_of(fresh),
                  "%s: the edited turn answers as a fresh request: %r vs %r" %
                  (kv, text_of(cut), text_of(fresh)))
            print("%s: %d-token conversation, last message edited: %d tokens kept, %d dropped, "
                  "%d prefilled; %.2f s against %.2f s for a fresh request" %
                  (kv, prompt, cached(cut), info["dropped_tokens"], prompt - cached(cut),
                   cut["seconds"], fresh["seconds"]))
            kept_before += cached(cut)
        check(srv.metric("d2o_session_truncations_total") == 2, "two cuts counted")
        check(srv.metric("d2o_session_truncation_kept_tokens_total") == kept_before,
              "the kept tokens counted")

        # Compacted at the end of its first turn: at most what that compaction left intact.
        kv = "d2o:ratio=0.2"
        msgs, one, two = conversation(srv, kv, "edit-ratio")
        rebuilds = srv.metric('d2o_session_rebuilds_total{reason="prefix_not_held"}')
        cut = srv.chat(msgs + [{"role": "user", "content": "When does the clock strike?"}],
                       "edit-ratio", kv)
        info = cut["session"]
        if info["rebuilt"]:
            check(cached(cut) == 0 and not info["truncated"], "rebuilt: nothing cached")
            check(srv.metric('d2o_session_rebuilds_total{reason="prefix_not_held"}') ==
                  rebuilds + 1, "the rebuild counted with its reason")
        else:
            check(info["truncated"] and cached(cut) < one["usage"]["prompt_tokens"],
                  "%s: no more than the compaction left intact (%d)" % (kv, cached(cut)))
        check(info["dropped_tokens"] + cached(cut) == two["session"]["n_past"],
              "kept and dropped add up to what was held")
        print("%s: edited after compaction: rebuilt %s, %d tokens kept" %
              (kv, info["rebuilt"], cached(cut)))
    finally:
        srv.stop()
    print("ok")


if __name__ == "__main__":
    main()
