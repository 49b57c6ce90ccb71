"""1,000 random calls (random types, token ids, specs, sizes): each returns or raises TypeError or
ValueError, and the process never crashes. Seeded, so a failure repeats."""
import random

import pytest

ALLOWED = (TypeError, ValueError)
SPECS = ["full", "d2o:ratio=0.2", "h2o:budget=16", "snapkv:ratio=0.5", "streaming:budget=8",
         "keydiff:ratio=0.3", "cam:budget=12", "pyramidkv:ratio=0.4", "d2o:cold=memory,ratio=0.3",
         "d2o:ratio=0", "d2o:ratio=1.5", "h2o:budget=0", "x", "", ":", "d2o:", "d2o:ratio",
         "d2o:ratio=0.2,ratio=0.3", "snapkv:window=100000", "\x00", "d2o:ratio=nan",
         "roco:heads=ada,ratio=0.2", "d2o:reading=paper,budget=32"]


def rand_value(rng, n_vocab):
    kind = rng.randrange(12)
    if kind == 0:
        return rng.randrange(-5, n_vocab + 5)
    if kind == 1:
        return rng.choice([0, -1, 2**31, -(2**63), 10**30])
    if kind == 2:
        return rng.random() * rng.choice([1, -1, 1e9])
    if kind == 3:
        return rng.choice(SPECS)
    if kind == 4:
        return "".join(chr(rng.randrange(1, 0x3000)) for _ in range(rng.randrange(12)))
    if kind == 5:
        return [rng.randrange(-3, n_vocab + 3) for _ in range(rng.randrange(0, 40))]
    if kind == 6:
        return None
    if kind == 7:
        return [rng.randrange(0, n_vocab) for _ in range(rng.randrange(1, 40))]
    if kind == 8:
        return b"bytes"
    if kind == 9:
        return {"role": "user", "content": "x"}
    if kind == 10:
        return [{"role": rng.choice(["user", "system", "x"]), "content": "hi"}]
    return rng.choice([True, 3.5, object(), [1.5], ["a"]])


def one_call(rng, model, session):
    v = lambda: rand_value(rng, model.n_vocab)  # noqa: E731
    calls = [
        lambda: model.tokenize(v()),
        lambda: model.detokenize(v()),
        lambda: model.generate(v(), rng.choice([1, 2, 3, v()]), kv=rng.choice(SPECS + [v()])),
        lambda: model.generate(v(), 2, kv_type=rng.choice(["f16", "q8_0", "q4_0r", "k:q8_0,v:f16",
                                                           "bad", v()])),
        lambda: model.logits(v(), kv=rng.choice(SPECS), context_end=rng.choice([None, 1, 5, v()])),
        lambda: model.nll(v(), kv=rng.choice(SPECS), chunk=rng.choice([0, 1, 16, 256, v()])),
        lambda: model.chat(v(), 2),
        lambda: model.generate("Hi", 2, temperature=v(), top_k=v(), top_p=v(), seed=v()),
        lambda: model.generate("Hi", 2, stop=v()),
        lambda: session.logits(v(), context_end=rng.choice([None, 2, v()])),
        lambda: session.kv_report(),
        lambda: model.perplexity(v(), kv=rng.choice(SPECS)),
    ]
    try:
        rng.choice(calls)()
        return "returned"
    except ALLOWED as e:
        return type(e).__name__


def test_thousand_random_calls(model):
    rng = random.Random(51)
    session = model.session(kv="h2o:budget=32")
    outcomes = {}
    for _ in range(1000):
        if session.n_past > 1500:
            session = model.session(kv=rng.choice(["full", "h2o:budget=32", "d2o:ratio=0.5"]))
        o = one_call(rng, model, session)
        outcomes[o] = outcomes.get(o, 0) + 1
    print("1,000 random calls:", outcomes)
    assert sum(outcomes.values()) == 1000
    assert outcomes.get("returned", 0) >= 100  # the calls reach the engine, not only the checks
    # Still serving afterwards.
    assert model.generate("Once upon a time", 4).stop_reason in ("length", "eog")
