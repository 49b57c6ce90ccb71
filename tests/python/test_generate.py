"""Generation through the package is `d2o run`'s, token for token; streaming, chat, sessions."""
import subprocess

import pytest

import d2o
from conftest import CTX, THREADS, d2o_bin, kjv, model_path


def cli_run(tmp_path, prompt, n, kv, *extra):
    f = tmp_path / "prompt.txt"
    f.write_text(prompt, encoding="utf-8")
    p = subprocess.run([d2o_bin(), "run", "-m", model_path(), "-f", str(f), "-n", str(n), "--kv",
                        kv, "-t", str(THREADS), "-c", str(CTX), *extra],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return p.stdout


@pytest.mark.parametrize("kv", ["full", "d2o:ratio=0.2"])
def test_greedy_text_equals_d2o_run(model, tmp_path, kv):
    prompt = kjv(1500) + "\n\nIn one sentence, the passage above says that"
    out = cli_run(tmp_path, prompt, 24, kv)
    r = model.generate(prompt, 24, kv=kv)
    assert out == prompt + r.text + "\n"
    assert r.stop_reason in ("length", "eog")
    assert r.n_prompt == len(model.tokenize(prompt))
    assert r.tokens and model.detokenize(r.tokens) == r.text


def test_chat_equals_d2o_run_chat(model, tmp_path):
    out = cli_run(tmp_path, "Name three colours.", 24, "full", "--chat")
    r = model.chat([{"role": "user", "content": "Name three colours."}], 24)
    assert out == r.text + "\n"


def test_stream_pieces_make_the_text(model):
    whole = model.generate("Once upon a time", 16)
    s = model.stream("Once upon a time", 16)
    pieces = list(s)
    assert "".join(pieces) == whole.text
    assert s.result is not None and s.result.tokens == whole.tokens
    s2 = model.generate("Once upon a time", 16, stream=True)
    assert "".join(s2) == whole.text


def test_stream_closed_early_stops(model):
    s = model.stream("Once upon a time", 200, ignore_eos=True)
    first = next(iter(s))
    assert isinstance(first, str)
    s.close()
    # The model is free again at once.
    assert model.generate("Once upon a time", 4).stop_reason in ("length", "eog")


def test_token_id_prompt_equals_text_prompt(model):
    ids = model.tokenize("The capital of France is")
    assert model.generate(ids, 8).tokens == model.generate("The capital of France is", 8).tokens


def test_sampling_is_seeded(model):
    a = model.generate("Once upon a time", 16, temperature=0.8, seed=7)
    b = model.generate("Once upon a time", 16, temperature=0.8, seed=7)
    assert a.tokens == b.tokens


def test_stop_string(model):
    r = model.generate("1, 2, 3, 4, 5,", 32, stop=[" 8"])
    assert " 8" not in r.text
    assert r.stop_reason in ("stop", "eog", "length")


def test_session_keeps_its_cache(model):
    text = kjv(2000)
    ids = model.tokenize(text)
    s = model.session(kv="d2o:ratio=0.2")
    s.logits(ids[:300])
    rep = s.kv_report()
    assert rep["n_past"] == 300 and rep["spec"].startswith("d2o:ratio=0.2")
    assert rep["slots"] < 300 * len(rep["layers"])  # compressed
    assert rep["kv_bytes"] < rep["full_kv_bytes"]
    r = s.generate(ids[300:340], 8)
    assert s.n_past == 340 + len(r.tokens) - (1 if r.stop_reason != "eog" else 0)
    assert s.tokens == ids[:340] + r.tokens
    # The full cache: a session's calls score as one call would.
    f = model.session()
    a = f.logits(ids[:100])
    b = f.logits(ids[100:160])
    one = model.logits(ids[:160], chunk=0)
    assert abs(a - one[:100]).max() < 1e-3 and abs(b - one[100:]).max() < 1e-3


def test_session_tokens_after_generations(model):
    # The last token a generation samples is fed with the next call's tokens, and listed once.
    s = model.session()
    a = s.generate("The capital of France is", 3)
    b = s.generate(" And", 3)
    assert s.tokens == model.tokenize("The capital of France is") + a.tokens + \
        model.tokenize(" And", add_special=False) + b.tokens
    assert s.n_past == len(s.tokens) - (1 if b.stop_reason != "eog" else 0)


def test_session_chat_renders_the_whole_conversation(model):
    # A session's second turn feeds what the whole conversation's rendering adds to what it
    # holds: the template's default system prompt once, and the answer the one-call chat gives.
    first = [{"role": "user", "content": "Name three colours."}]
    second = [{"role": "user", "content": "And three animals?"}]
    s = model.session()
    r1 = s.chat(first, 12)
    r2 = s.chat(second, 12)
    text = model.detokenize(s.tokens)
    assert text.count("You are a helpful AI assistant") == 1
    whole = model.chat(first + [{"role": "assistant", "content": r1.text}] + second, 12)
    assert r2.text == whole.text
    # Streamed, the reply joins the conversation once the stream is done.
    t = model.session()
    "".join(t.chat(first, 12, stream=True))
    assert t.chat(second, 12).text == r2.text


def test_perplexity(model):
    text = kjv(1200)
    full = model.perplexity(text)
    assert 1.0 < full < 100.0
    squeezed = model.perplexity(text, kv="d2o:ratio=0.2", context_end=200)
    assert squeezed > 1.0
    assert model.perplexity(text, context_end=200) == pytest.approx(
        model.perplexity(model.tokenize(text), context_end=200))


def test_policies_lists_the_registry():
    p = d2o.policies()
    names = [x["name"] for x in p["presets"]]
    assert names[0] == "full" and "d2o" in names and "snapkv" in names
    for x in p["presets"]:
        assert x["doc"], x["name"]
        assert d2o.canonical_spec(x["spec"]) == x["spec"]
    keys = {k["name"]: k for k in p["keys"]}
    assert "ratio" in keys and "heavy_recent" in keys and keys["heavy_recent"]["old_name"] == "nm"
    assert all(k["doc"] for k in p["keys"]), [k["name"] for k in p["keys"] if not k["doc"]]
    for x in p["presets"]:
        assert set(x["keys"]) <= set(keys), x["name"]
        # A composed preset says what it is made of; full has no parts.
        assert bool(x["parts"]) == (x["name"] != "full"), x["name"]
