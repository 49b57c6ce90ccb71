"""log_softmax(model.logits(...)) is what `d2o serve` echoes as `logprobs` for the same tokens:
under the full cache, and under a compressing policy with the context's end marked."""
import numpy as np
import pytest

from conftest import kjv

# Measured once: the largest difference printed by -s (the JSON's decimal rounding is below it).
TOL = 1e-5


def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=1, keepdims=True))


def server_logprobs(server, ids, **kw):
    body = {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0, "temperature": 0}
    body.update(kw)
    st, r = server.post("/v1/completions", body)
    assert st == 200, r
    lp = r["choices"][0]["logprobs"]["token_logprobs"]
    assert lp[0] is None and len(lp) == len(ids)
    return np.array(lp[1:], dtype=np.float64)


def package_logprobs(model, ids, **kw):
    lp = log_softmax(model.logits(ids, **kw))
    return lp[np.arange(len(ids) - 1), ids[1:]]


@pytest.mark.parametrize("kv,context_end", [("full", None), ("full", 300),
                                            ("d2o:ratio=0.2", 300), ("h2o:ratio=0.3", 300)])
def test_logits_equal_server_logprobs(model, server, kv, context_end):
    ids = model.tokenize(kjv(3000), add_special=False)[:600]  # three of the server's passes
    kw = {"kv": kv} if context_end is None else {"kv": kv, "context_end": context_end}
    theirs = server_logprobs(server, ids, **kw)
    mine = package_logprobs(model, ids, **kw)
    diff = float(np.abs(theirs - mine).max())
    print("kv=%s context_end=%s: max |logprob difference| %.3g over %d tokens"
          % (kv, context_end, diff, len(ids) - 1))
    assert diff <= TOL
    if kv != "full":  # the rest was scored against the compressed context
        full = package_logprobs(model, ids)
        assert np.abs(full[:context_end - 1] - mine[:context_end - 1]).max() <= TOL
        assert np.abs(full[context_end:] - mine[context_end:]).mean() > 1e-3


def test_nll_is_minus_the_logprobs(model):
    ids = model.tokenize(kjv(800))
    lp = package_logprobs(model, ids, kv="h2o:ratio=0.5", context_end=50)
    nll = np.array(model.nll(ids, kv="h2o:ratio=0.5", context_end=50))
    assert len(nll) == len(ids) - 50
    assert np.abs(-lp[49:] - nll).max() < 1e-9


def test_logits_shape_and_type(model):
    ids = model.tokenize("Hello world")
    x = model.logits(ids)
    assert x.dtype == np.float32 and x.shape == (len(ids), model.n_vocab)
    assert x.flags["C_CONTIGUOUS"]


def test_session_turns_equal_context_end(model):
    """A session fed the context, then the rest, scores the rest as context_end does."""
    ids = model.tokenize(kjv(2000), add_special=False)[:400]
    whole = model.logits(ids, kv="d2o:ratio=0.2", context_end=300)
    s = model.session(kv="d2o:ratio=0.2")
    s.feed(ids[:300])
    rest = s.logits(ids[300:])
    assert rest.shape == (100, model.n_vocab)
    assert np.abs(rest - whole[300:]).max() <= TOL
    assert s.kv_report()["n_past"] == 400
