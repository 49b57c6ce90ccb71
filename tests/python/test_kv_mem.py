"""kv_mem_per_seq: the budget that fits a KV memory, the one `d2o run --kv-mem-per-seq` chooses;
a full cache capped at it; the CLI's errors."""
import re
import subprocess

import pytest

import d2o
from conftest import CTX, THREADS, d2o_bin, kjv, model_path


def cli_run(tmp_path, prompt, n, *args):
    f = tmp_path / "prompt.txt"
    f.write_text(prompt, encoding="utf-8")
    return subprocess.run([d2o_bin(), "run", "-m", model_path(), "-f", str(f), "-n", str(n),
                           "-t", str(THREADS), "-c", str(CTX), *args],
                          capture_output=True, text=True, timeout=300)


def cli_error(*args):
    p = subprocess.run([d2o_bin(), "run", "-m", model_path(), "-p", "Hi", "-n", "2", *args],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    return p.stderr


@pytest.mark.parametrize("kv,kv_type,mem", [("h2o", "f16", "1M"), ("d2o", "q8_0", "3M"),
                                            ("snapkv:window=16", "f16", "1.5M")])
def test_budget_and_text_equal_d2o_run(model, tmp_path, kv, kv_type, mem):
    prompt = kjv(1500) + "\n\nIn one sentence, the passage above says that"
    p = cli_run(tmp_path, prompt, 16, "--kv", kv, "--kv-type", kv_type, "--kv-mem-per-seq", mem,
                "--kv-report")
    assert p.returncode == 0, p.stderr
    note = re.search(r"^  from (--kv-mem-per-seq .*)$", p.stderr, re.M)
    assert note, p.stderr
    slots = int(re.search(r"(\d+) slots per KV head and layer fit", note.group(1)).group(1))
    spec = re.search(r"^\[kv (.*), stop: ", p.stderr, re.M).group(1)

    s = model.session(kv=kv, kv_type=kv_type, kv_mem_per_seq=mem)
    rep = s.kv_report()["kv_mem_per_seq"]
    assert rep["slots"] == slots
    assert rep["note"] == note.group(1)
    assert rep["asked"] == mem and not rep["full_cap"]
    assert rep["bytes"] == int(float(mem[:-1]) * 2**20)
    assert s.spec == spec and ("budget=%d" % slots) in spec
    # The same policy gives the same greedy text, one-shot and in a session.
    r = model.generate(prompt, 16, kv=kv, kv_type=kv_type, kv_mem_per_seq=mem)
    assert p.stdout == prompt + r.text + "\n"
    assert s.generate(prompt, 16).tokens == r.tokens
    # Without it the same spec is another policy (no budget of its own).
    assert d2o.canonical_spec(kv) != spec


def test_full_cache_slots_equal_d2o_run_and_cap_it(model, tmp_path):
    p = cli_run(tmp_path, "Hi", 2, "--kv", "full", "--kv-mem-per-seq", "2M", "--kv-report")
    assert p.returncode == 0, p.stderr
    slots = int(re.search(r"(\d+) slots per KV head and layer fit[^\n]*the full cache's cap",
                          p.stderr).group(1))
    s = model.session(kv="full", kv_mem_per_seq=2 * 2**20)  # bytes as an int
    rep = s.kv_report()
    assert rep["spec"] == "full"
    assert rep["kv_mem_per_seq"]["slots"] == slots and rep["kv_mem_per_seq"]["full_cap"]
    assert rep["kv_mem_per_seq"]["asked"] == str(2 * 2**20)

    # A feed that fills the cap exactly fits, and every byte the cache allocated on the way
    # (key and value rows, slot metadata) stayed within the bytes asked.
    ids = model.tokenize(kjv(20000))
    assert len(ids) > slots + 10
    s.feed(ids[:slots - 3])
    s.feed(ids[slots - 3:slots])
    rep = s.kv_report()
    assert rep["n_past"] == slots and rep["slots"] == slots * 30  # (30 layers)
    assert 0 < rep["kv_bytes_peak"] <= 2 * 2**20
    # One more token does not fit: refused before any is fed, and the session goes on.
    with pytest.raises(MemoryError, match="kv_mem_per_seq"):
        s.feed(ids[slots:slots + 1])
    with pytest.raises(MemoryError, match="kv_mem_per_seq"):
        s.logits(ids[slots:slots + 5])
    with pytest.raises(MemoryError, match="kv_mem_per_seq"):
        s.generate(ids[slots:slots + 2], 4)
    assert s.n_past == slots
    # One-shot calls too; below the cap they equal the uncapped cache's.
    with pytest.raises(MemoryError):
        model.logits(ids[:slots + 1], kv_mem_per_seq="2M")
    a = model.logits(ids[:64], kv_mem_per_seq="2M")
    b = model.logits(ids[:64])
    assert (a == b).all()


def test_a_generation_that_reaches_the_cap_fails_as_d2o_run_does(model, tmp_path):
    s = model.session(kv="full", kv_mem_per_seq="512K")
    slots = s.kv_report()["kv_mem_per_seq"]["slots"]
    prompt = model.tokenize(kjv(3000))[:slots - 4]
    with pytest.raises(MemoryError, match="above its limit"):
        s.generate(prompt, 16, ignore_eos=True)
    p = cli_run(tmp_path, model.detokenize(prompt), 16, "--kv", "full", "--kv-mem-per-seq",
                "512K", "--ignore-eos")
    assert p.returncode != 0 and "above its limit" in p.stderr
    # What the session was fed is not known token by token: it refuses further calls.
    with pytest.raises(ValueError, match="failed partway"):
        s.generate([1, 2], 2)


def test_peak_of_a_long_feed_under_a_budget(model):
    # A fixed budget compacts after every pass: fed token by token, the cache never allocates
    # more key and value rows and slot metadata than the bytes asked (it holds the budget plus
    # the one token about to be compacted away); in passes of 32, at most one pass more. Without
    # a bound on its growth it would allocate in steps of 256 slots.
    ids = model.tokenize(kjv(3000))[:600]
    s = model.session(kv="h2o", kv_mem_per_seq="1M")
    budget = s.kv_report()["kv_mem_per_seq"]["slots"]
    assert len(ids) > 10 * budget
    s.feed(ids, chunk=1)
    rep = s.kv_report()
    assert all(l["slots"] == budget for l in rep["layers"])
    assert rep["kv_bytes_allocated"] <= 2**20
    assert 0 < rep["kv_bytes_peak"] <= 2**20

    s = model.session(kv="h2o", kv_mem_per_seq="1M")
    s.feed(ids, chunk=32)
    rep = s.kv_report()
    row_bytes = rep["kv_bytes"] / rep["slots"]  # key and value rows of one slot of one layer
    assert 2**20 < rep["kv_bytes_peak"] <= 2**20 + 32 * 30 * row_bytes * 1.1
    r = s.generate(model.tokenize(" And", add_special=False), 8, ignore_eos=True)
    assert len(r.tokens) == 8
    assert s.kv_report()["kv_bytes_peak"] == rep["kv_bytes_peak"]


@pytest.mark.parametrize("mem,needle", [("lots", "not a byte size"), ("1K", "holds no slot"),
                                        ("0", "at least 1 byte"), ("-5", "not a byte size"),
                                        ("2X", "not a byte size")])
def test_bad_sizes_are_value_errors_with_the_cli_message(model, mem, needle):
    with pytest.raises(ValueError) as e:
        model.generate("Hi", 2, kv="d2o", kv_mem_per_seq=mem)
    msg = str(e.value)
    assert needle in msg and msg.startswith("--kv-mem-per-seq")
    assert msg in cli_error("--kv", "d2o", "--kv-mem-per-seq", mem)
    for call in (lambda: model.session(kv="full", kv_mem_per_seq=mem),
                 lambda: model.logits([1, 2, 3], kv_mem_per_seq=mem),
                 lambda: model.nll([1, 2, 3], kv="h2o", kv_mem_per_seq=mem)):
        with pytest.raises(ValueError, match="--kv-mem-per-seq"):
            call()


@pytest.mark.parametrize("spec,needle", [("h2o:ratio=0.2", "leave out its ratio= / budget="),
                                         ("d2o:budget=64", "leave out its ratio= / budget="),
                                         ("d2o:prefill=bounded", "leave out its prefill="),
                                         ("nope", "unknown KV policy")])
def test_specs_that_set_their_own_size_are_refused(model, spec, needle):
    with pytest.raises(ValueError) as e:
        d2o.Session(model, kv=spec, kv_mem_per_seq="4M")
    msg = str(e.value)
    assert needle in msg
    assert msg in cli_error("--kv", spec, "--kv-mem-per-seq", "4M")
    with pytest.raises(ValueError, match=re.escape(needle)):
        model.generate("Hi", 2, kv=spec, kv_mem_per_seq="4M")


def test_wrong_types(model):
    for bad in (1.5, True, [1], b"4M"):
        with pytest.raises(TypeError, match="kv_mem_per_seq"):
            model.generate("Hi", 2, kv_mem_per_seq=bad)
    with pytest.raises(ValueError, match="empty byte size"):
        model.session(kv_mem_per_seq="")
    # Not given: no choice in the report.
    assert model.session(kv="h2o:budget=8").kv_report()["kv_mem_per_seq"] is None
