"""Every error is a Python exception with a message that says what was wrong."""
import os
import subprocess

import pytest

import d2o
from conftest import d2o_bin, model_path


def cli_error(*args):
    p = subprocess.run([d2o_bin(), *args], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    return p.stderr


@pytest.mark.parametrize("spec", ["nope", "d2o:ratio=2", "h2o:sinks=-1", "d2o:bogus=1",
                                  "full:ratio=0.5", "snapkv:window=x"])
def test_bad_spec_is_a_value_error_with_the_cli_message(model, spec):
    with pytest.raises(ValueError) as e:
        model.generate("Hi", 2, kv=spec)
    msg = str(e.value)
    assert msg.startswith("--kv: ")
    assert msg in cli_error("run", "-m", model_path(), "-p", "Hi", "-n", "2", "--kv", spec)
    with pytest.raises(ValueError) as e2:
        d2o.canonical_spec(spec)
    assert str(e2.value) == msg
    with pytest.raises(ValueError):
        model.logits([1, 2, 3], kv=spec)
    with pytest.raises(ValueError):
        model.session(kv=spec)


def test_bad_kv_type(model):
    with pytest.raises(ValueError, match="--kv-type"):
        model.generate("Hi", 2, kv_type="f64")


def test_token_ids_out_of_range(model):
    for bad in ([model.n_vocab], [-1], [1, 2, 10**6]):
        with pytest.raises(ValueError, match="out of range"):
            model.generate(bad, 2)
        with pytest.raises(ValueError, match="out of range"):
            model.logits(bad)
        with pytest.raises(ValueError, match="out of range"):
            model.detokenize(bad)
    with pytest.raises(ValueError, match="out of range"):
        model.logits([1, 2**40])


def test_wrong_types(model):
    with pytest.raises(TypeError, match="text must be a str"):
        model.tokenize(b"bytes")
    with pytest.raises(TypeError, match="must hold ints"):
        model.logits([1, "2"])
    with pytest.raises(TypeError, match="must hold ints"):
        model.logits([1.5, 2.0])
    with pytest.raises(TypeError, match="sequence of token ids"):
        model.logits("hello")
    with pytest.raises(TypeError, match="max_tokens must be an int"):
        model.generate("Hi", "3")
    with pytest.raises(TypeError, match="kv must be a str"):
        model.generate("Hi", 2, kv=0.2)
    with pytest.raises(TypeError):
        model.generate("Hi", 2, bogus=1)
    with pytest.raises(TypeError, match="messages"):
        model.chat("Hi")
    with pytest.raises(TypeError, match="content"):
        model.chat([{"role": "user", "content": 3}])


def test_bad_values(model):
    with pytest.raises(ValueError, match="max_tokens must be within"):
        model.generate("Hi", 0)
    with pytest.raises(ValueError, match="no tokens"):
        model.generate("", 2)
    with pytest.raises(ValueError, match="no tokens to score"):
        model.logits([])
    with pytest.raises(ValueError, match="context must end before"):
        model.logits([1, 2, 3], context_end=3)
    with pytest.raises(ValueError, match="context_end must be within"):
        model.logits([1, 2, 3], context_end=0)
    with pytest.raises(ValueError, match="do not fit in the context"):
        model.logits([1] * (model.n_ctx + 1))
    with pytest.raises(ValueError, match="temperature"):
        model.generate("Hi", 2, temperature=-1.0)
    with pytest.raises(ValueError, match="role"):
        model.chat([{"role": "robot", "content": "Hi"}])
    with pytest.raises(ValueError, match="empty"):
        model.chat([])
    with pytest.raises(ValueError, match="has no 'content'"):
        model.chat([{"role": "user"}])


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        d2o.Model(str(tmp_path / "nothing.gguf"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(200))
    with pytest.raises(ValueError):
        d2o.Model(str(bad))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all")
    with pytest.raises(ValueError):
        d2o.Model(str(junk))
    # A real model's first half.
    half = tmp_path / "half.gguf"
    with open(model_path(), "rb") as f:
        half.write_bytes(f.read(os.path.getsize(model_path()) // 2))
    with pytest.raises(ValueError):
        d2o.Model(str(half))
    with pytest.raises(ValueError, match="threads"):
        d2o.Model(model_path(), threads=-1)
    with pytest.raises(TypeError):
        d2o.Model(3)
