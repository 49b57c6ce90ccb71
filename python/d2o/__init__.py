"""d2o: a C++ inference engine for GGUF models whose KV cache stays small, from Python.

    >>> import d2o
    >>> model = d2o.Model("SmolLM2-135M-Instruct.Q4_1.gguf", threads=2)
    >>> model.generate("Once upon a time", max_tokens=32, kv="d2o:ratio=0.2").text
    >>> for piece in model.stream("Once upon a time", max_tokens=32):
    ...     print(piece, end="")
    >>> model.chat([{"role": "user", "content": "Hi"}]).text
    >>> model.logits(model.tokenize("The cat sat"), kv="h2o:ratio=0.5", context_end=2)
    >>> model.generate("Once upon a time", kv="d2o", kv_mem_per_seq="4M").text

Every KV policy spec (``kv=``) is the grammar of ``d2o run --kv`` and the server's ``"kv"``;
:func:`policies` lists the presets and keys. ``kv_mem_per_seq=`` ("4M", "64MiB" or a number of
bytes) is ``d2o run --kv-mem-per-seq``: the policy's budget is the slots that fit in that memory,
and a full cache is capped at them. The model runs with Python's GIL released; one call
runs on a model at a time. Errors are exceptions: ``ValueError`` for bad arguments, specs, token
ids and malformed model files, ``TypeError`` for wrong types, ``FileNotFoundError`` for a missing
file.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from . import _d2o

__all__ = [
    "Model",
    "Session",
    "GenerateResult",
    "Stream",
    "policies",
    "canonical_spec",
    "__version__",
]

__version__: str = _d2o.__version__

Prompt = Union[str, Sequence[int]]


@dataclass
class GenerateResult:
    """What a generation produced.

    text: the generated text (a stop string excluded); tokens: the generated token ids (an
    end-of-generation token excluded); stop_reason: "eog", "stop", "length" or "context";
    n_prompt: the prompt's tokens; prompt_seconds, decode_seconds: wall time of the prompt's
    passes and of the decode steps.
    """

    text: str
    tokens: List[int]
    stop_reason: str
    n_prompt: int = 0
    prompt_seconds: float = 0.0
    decode_seconds: float = 0.0

    @staticmethod
    def _from(d: Dict[str, Any]) -> "GenerateResult":
        return GenerateResult(d["text"], list(d["tokens"]), d["stop_reason"], d["n_prompt"],
                              d["prompt_seconds"], d["decode_seconds"])


_DONE = object()


class Stream:
    """An iterator over the text of a generation as it becomes final (never a partial UTF-8
    character, never text that may still turn out to start a stop string).

    The model runs on a thread of its own; ``result`` holds the :class:`GenerateResult` once the
    iterator is exhausted. Closing the iterator early (``close()``, ``break`` out of a ``for``
    loop that then drops it) stops the generation at its next token.
    """

    def __init__(self, run: Callable[[Callable[[str], bool]], Dict[str, Any]]):
        self.result: Optional[GenerateResult] = None
        self._queue: "queue.Queue[object]" = queue.Queue()
        self._stop = threading.Event()
        self._error: Optional[BaseException] = None
        self._out: Optional[Dict[str, Any]] = None
        self._thread = threading.Thread(target=self._work, args=(run,), daemon=True)
        self._thread.start()

    def _on_text(self, text: str) -> bool:
        self._queue.put(text)
        return not self._stop.is_set()

    def _work(self, run: Callable[[Callable[[str], bool]], Dict[str, Any]]) -> None:
        try:
            self._out = run(self._on_text)
        except BaseException as e:  # raised again in the consumer's thread
            self._error = e
        finally:
            self._queue.put(_DONE)

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> str:
        if self._thread is None:
            raise StopIteration
        item = self._queue.get()
        if item is _DONE:
            self._finish()
            raise StopIteration
        assert isinstance(item, str)
        return item

    def _finish(self) -> None:
        if self._thread is None:
            return
        self._thread.join()
        self._thread = None
        if self._error is not None:
            raise self._error
        if self._out is not None and "tokens" in self._out:
            self.result = GenerateResult._from(self._out)

    def close(self) -> None:
        """Stops the generation (at its next token) and waits for it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _ids(x: Sequence[int], what: str) -> List[int]:
    if isinstance(x, (str, bytes)) or not hasattr(x, "__iter__"):
        raise TypeError(f"{what} must be a sequence of token ids (ints), got {type(x).__name__}")
    out = []
    for t in x:
        if isinstance(t, bool) or not hasattr(t, "__index__"):
            raise TypeError(f"{what} must hold ints, got {type(t).__name__}")
        t = t.__index__()
        if t < -(2**31) or t >= 2**31:
            raise ValueError(f"{what}: token id {t} is out of range")
        out.append(t)
    return out


def _str(x: Any, what: str) -> str:
    if not isinstance(x, str):
        raise TypeError(f"{what} must be a str, got {type(x).__name__}")
    return x


def _int(x: Any, what: str, lo: int, hi: int) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{what} must be an int, got {type(x).__name__}")
    if not lo <= x <= hi:
        raise ValueError(f"{what} must be within {lo}..{hi}, got {x}")
    return x


def _float(x: Any, what: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"{what} must be a number, got {type(x).__name__}")
    return float(x)


_INT32 = 2**31 - 1


def _options(max_tokens: int, temperature: float = 0.0, top_k: int = 40, top_p: float = 0.95,
             min_p: float = 0.05, repeat_penalty: float = 1.0, repeat_last_n: int = 64,
             seed: int = 0, stop: Optional[Sequence[str]] = None, ignore_eos: bool = False,
             chunk: int = 512) -> "_d2o._GenOptions":
    o = _d2o._GenOptions()
    o.max_tokens = _int(max_tokens, "max_tokens", 1, _INT32)
    o.temperature = _float(temperature, "temperature")
    o.top_k = _int(top_k, "top_k", -_INT32, _INT32)
    o.top_p = _float(top_p, "top_p")
    o.min_p = _float(min_p, "min_p")
    o.repeat_penalty = _float(repeat_penalty, "repeat_penalty")
    o.repeat_last_n = _int(repeat_last_n, "repeat_last_n", 0, _INT32)
    o.seed = _int(seed, "seed", 0, 2**64 - 1)
    if stop is None:
        stop = []
    if isinstance(stop, str):
        stop = [stop]
    o.stop = [_str(s, "a stop string") for s in stop]
    if not isinstance(ignore_eos, bool):
        raise TypeError(f"ignore_eos must be a bool, got {type(ignore_eos).__name__}")
    o.ignore_eos = ignore_eos
    o.chunk = _int(chunk, "chunk", 0, 1 << 24)
    return o


def _kv_mem(x: Union[None, str, int]) -> str:
    # "" is "not given" to the extension, so an empty string is refused here.
    if x is None:
        return ""
    if isinstance(x, bool) or not isinstance(x, (str, int)):
        raise TypeError(f"kv_mem_per_seq must be a byte size (str or int), got {type(x).__name__}")
    x = str(x)
    if not x:
        raise ValueError("kv_mem_per_seq: empty byte size (examples: 512M, 2G, 1048576)")
    return x


def _context_end(x: Optional[int]) -> int:
    if x is None:
        return 0
    return _int(x, "context_end", 1, 2**62)


def _messages(messages: Any) -> List[tuple]:
    if isinstance(messages, (str, bytes, dict)) or not hasattr(messages, "__iter__"):
        raise TypeError("messages must be a list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TypeError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        for k in ("role", "content"):
            if k not in m:
                raise ValueError(f"messages[{i}] has no '{k}'")
            if not isinstance(m[k], str):
                raise TypeError(f"messages[{i}]['{k}'] must be a str, got {type(m[k]).__name__}")
        if m["role"] not in ("system", "user", "assistant"):
            raise ValueError(f"messages[{i}]['role'] is '{m['role']}'; "
                             "allowed: system, user, assistant")
        out.append((m["role"], m["content"]))
    if not out:
        raise ValueError("messages is empty")
    return out


class Model:
    """A GGUF model loaded for generation and scoring.

    path: the GGUF file; threads: 0 for every core; ctx: the context in tokens (0: the model's
    trained context); ubatch: rows per micro-batch. Raises FileNotFoundError for a missing file,
    ValueError for a malformed or unsupported one.
    """

    def __init__(self, path: str, *, threads: int = 0, ctx: int = 0, ubatch: int = 512):
        import errno
        import os

        path = os.fspath(path)
        if isinstance(path, str) and not os.path.exists(path):
            raise FileNotFoundError(errno.ENOENT, "no such model file", path)
        self._m = _d2o._Model(_str(path, "path"), _int(threads, "threads", 0, 1024),
                              _int(ctx, "ctx", 0, 1 << 24), _int(ubatch, "ubatch", 1, 1 << 16))

    @property
    def n_vocab(self) -> int:
        """The vocabulary's size (the logits' second dimension)."""
        return self._m.n_vocab

    @property
    def n_ctx(self) -> int:
        """The context in tokens: no sequence holds more positions."""
        return self._m.n_ctx

    @property
    def path(self) -> str:
        return self._m.path

    def tokenize(self, text: str, *, add_special: bool = True,
                 parse_special: bool = False) -> List[int]:
        """Token ids of ``text``: with add_special the BOS/EOS the model's metadata asks for;
        with parse_special, special-token text such as "<|im_start|>" becomes that token."""
        return self._m.tokenize(_str(text, "text"), bool(add_special), bool(parse_special))

    def detokenize(self, ids: Sequence[int], *, render_special: bool = False) -> str:
        """The text of token ids (special tokens rendered only with render_special)."""
        return self._m.detokenize(_ids(ids, "ids"), bool(render_special))

    def _prompt(self, prompt: Prompt) -> List[int]:
        if isinstance(prompt, str):
            ids = self.tokenize(prompt)
        else:
            ids = _ids(prompt, "prompt")
        if not ids:
            raise ValueError("the prompt produced no tokens")
        return ids

    def generate(self, prompt: Prompt, max_tokens: int = 128, *, kv: str = "full",
                 kv_type: str = "f16", kv_mem_per_seq: Union[None, str, int] = None,
                 stream: bool = False, **sampling: Any) -> Union[GenerateResult, Stream]:
        """Generates from ``prompt`` (text or token ids) with a fresh cache under policy ``kv``
        (e.g. "d2o:ratio=0.2") stored as ``kv_type`` ("f16", "q8_0", "q4_0r", "k:q8_0,v:q4_0").

        ``kv_mem_per_seq`` ("4M", or bytes): the policy's budget is the slots per KV head and
        layer that fit in it (``kv`` then sets no ratio=, budget= or prefill=); a full cache is
        capped at them, and a prompt or generation that needs more raises MemoryError.

        Greedy by default, exactly what ``d2o run -p PROMPT -n MAX_TOKENS --kv KV`` prints.
        Sampling keywords: temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n,
        seed; also stop (strings), ignore_eos, chunk (prompt tokens per pass, 512). With
        stream=True returns a :class:`Stream` of text pieces instead.
        """
        ids = self._prompt(prompt)
        opts = _options(max_tokens, **sampling)
        kv, kv_type, mem = _str(kv, "kv"), _str(kv_type, "kv_type"), _kv_mem(kv_mem_per_seq)
        run = lambda cb: self._m.generate(ids, kv, kv_type, mem, opts, cb)
        if stream:
            return Stream(run)
        return GenerateResult._from(run(None))

    def stream(self, prompt: Prompt, max_tokens: int = 128, **kw: Any) -> Stream:
        """``generate(..., stream=True)``: an iterator over the text as it is generated."""
        s = self.generate(prompt, max_tokens, stream=True, **kw)
        assert isinstance(s, Stream)
        return s

    def chat_prompt(self, messages: Sequence[Dict[str, str]]) -> List[int]:
        """The token ids of ``messages`` in the model's chat template with the assistant's turn
        opened, as ``d2o serve`` renders a chat request."""
        text = self._m.chat_text(_messages(messages))
        return self.tokenize(text, parse_special=True)

    def chat(self, messages: Sequence[Dict[str, str]], max_tokens: int = 128,
             **kw: Any) -> Union[GenerateResult, Stream]:
        """Answers a conversation ([{"role": "user", "content": "Hi"}, ...]; roles system,
        user, assistant) in the model's chat template, stopping at the end of the assistant's
        turn; keywords as :meth:`generate`."""
        ids = self.chat_prompt(messages)
        stop = kw.pop("stop", None)
        stop = [stop] if isinstance(stop, str) else list(stop or [])
        return self.generate(ids, max_tokens, stop=stop + self._m.chat_stops(), **kw)

    def logits(self, tokens: Sequence[int], *, kv: str = "full", kv_type: str = "f16",
               kv_mem_per_seq: Union[None, str, int] = None, context_end: Optional[int] = None,
               chunk: int = 256) -> "Any":
        """The logits of every token as a NumPy float32 array [len(tokens), n_vocab]: row i
        scores the token after tokens[i].

        With ``context_end=N`` (0 < N < len(tokens)) the first N tokens are fed as a prompt of
        their own, which a ratio policy compresses at its end, and the rest are scored on the
        compressed cache: the server's ``context_end`` field. ``chunk``: tokens per pass, cut as
        the server cuts a prompt (its ``--chunk``, 256), so that the logits equal its echoed
        ``logprobs`` (0: one pass). ``kv_mem_per_seq`` as :meth:`generate`.
        """
        return self._m.logits(_ids(tokens, "tokens"), _str(kv, "kv"), _str(kv_type, "kv_type"),
                              _kv_mem(kv_mem_per_seq), _context_end(context_end),
                              _int(chunk, "chunk", 0, 1 << 24))

    def nll(self, tokens: Sequence[int], *, kv: str = "full", kv_type: str = "f16",
            kv_mem_per_seq: Union[None, str, int] = None, context_end: Optional[int] = None,
            chunk: int = 256) -> List[float]:
        """Negative log-likelihood (natural log) of every token from the second on given those
        before it (from context_end on, with context_end); as :meth:`logits` without holding the
        logits."""
        return self._m.nll(_ids(tokens, "tokens"), _str(kv, "kv"), _str(kv_type, "kv_type"),
                           _kv_mem(kv_mem_per_seq), _context_end(context_end),
                           _int(chunk, "chunk", 0, 1 << 24))

    def perplexity(self, text: Union[str, Sequence[int]], **kw: Any) -> float:
        """exp(mean NLL) of ``text`` (or token ids) in one sequence under policy ``kv``; keywords
        as :meth:`nll` (with context_end, of the tokens after the context only). For llama.cpp's
        chunked protocol use ``d2o perplexity``."""
        import math

        ids = self.tokenize(text) if isinstance(text, str) else _ids(text, "text")
        nll = self.nll(ids, **kw)
        return math.exp(sum(nll) / len(nll))

    def session(self, kv: str = "full", kv_type: str = "f16",
                kv_mem_per_seq: Union[None, str, int] = None) -> "Session":
        """A :class:`Session`: a sequence whose compressed cache persists across calls."""
        return Session(self, kv=kv, kv_type=kv_type, kv_mem_per_seq=kv_mem_per_seq)


class Session:
    """One sequence whose (compressed) KV cache is kept across calls, as a ``d2o serve``
    session's is between turns: each call feeds only its own tokens after everything before.
    ``kv``, ``kv_type`` and ``kv_mem_per_seq`` as :meth:`Model.generate`; with a capped full
    cache, a call whose tokens go past the cap raises MemoryError (before feeding any of them,
    except when decoding reaches it, which leaves the session unusable).
    """

    def __init__(self, model: Model, *, kv: str = "full", kv_type: str = "f16",
                 kv_mem_per_seq: Union[None, str, int] = None):
        if not isinstance(model, Model):
            raise TypeError(f"model must be a d2o.Model, got {type(model).__name__}")
        self._model = model
        self._s = _d2o._Session(model._m, _str(kv, "kv"), _str(kv_type, "kv_type"),
                                _kv_mem(kv_mem_per_seq))
        self._history: List[tuple] = []  # the conversation chat() has fed, replies included
        self._pending: Optional[tuple] = None  # a streamed reply not yet in _history

    @property
    def spec(self) -> str:
        """The policy's canonical spec."""
        return self._s.spec

    @property
    def n_past(self) -> int:
        """Positions fed so far."""
        return self._s.n_past

    @property
    def tokens(self) -> List[int]:
        """Every token given or generated so far."""
        return list(self._s.tokens)

    def generate(self, prompt: Prompt, max_tokens: int = 128, *, stream: bool = False,
                 **sampling: Any) -> Union[GenerateResult, Stream]:
        """Feeds ``prompt`` after everything before and generates; keywords as
        :meth:`Model.generate`. A stream closed early leaves the session unusable."""
        ids = self._model._prompt(prompt)
        opts = _options(max_tokens, **sampling)
        run = lambda cb: self._s.generate(ids, opts, cb)
        if stream:
            return Stream(run)
        return GenerateResult._from(run(None))

    def chat(self, messages: Sequence[Dict[str, str]], max_tokens: int = 128,
             **kw: Any) -> Union[GenerateResult, Stream]:
        """The next turn: ``messages`` (the new ones only) appended to the conversation, then the
        answer. The whole conversation is rendered in the chat template and only its tokens after
        those the session holds are fed (so a template's default system prompt comes once);
        where the session holds other tokens (fed by other calls), the new messages are rendered
        alone."""
        new = _messages(messages)
        self._settle_reply()
        history = self._history + new
        held = self._s.tokens
        ids = self._model.tokenize(self._model._m.chat_text(history), add_special=True,
                                   parse_special=True)
        if held and ids[:len(held)] == list(held) and len(ids) > len(held):
            ids = ids[len(held):]
        elif held:
            history = []
            ids = self._model.tokenize(self._model._m.chat_text(new), add_special=False,
                                       parse_special=True)
        stop = kw.pop("stop", None)
        stop = [stop] if isinstance(stop, str) else list(stop or [])
        out = self.generate(ids, max_tokens, stop=stop + self._model._m.chat_stops(), **kw)
        if isinstance(out, Stream):
            self._pending = (history, out)
        else:
            self._history = history + [("assistant", out.text)] if history else []
        return out

    def _settle_reply(self) -> None:
        # A streamed reply joins the conversation once its stream has finished.
        if self._pending is None:
            return
        history, stream = self._pending
        self._pending = None
        done = stream.result is not None and history
        self._history = history + [("assistant", stream.result.text)] if done else []

    def logits(self, tokens: Sequence[int], *, context_end: Optional[int] = None,
               chunk: int = 256) -> "Any":
        """Feeds ``tokens`` after everything before and returns their logits [n, n_vocab]
        (float32); context_end as :meth:`Model.logits`, counted within ``tokens``."""
        return self._s.logits(_ids(tokens, "tokens"), _context_end(context_end),
                              _int(chunk, "chunk", 0, 1 << 24))

    def feed(self, tokens: Sequence[int], *, context_end: Optional[int] = None,
             chunk: int = 256) -> None:
        """Feeds ``tokens`` after everything before as :meth:`logits` does, computing no logits
        (a document to ask about in the next call: a ratio policy compresses it at its end)."""
        self._s.feed(_ids(tokens, "tokens"), _context_end(context_end),
                     _int(chunk, "chunk", 0, 1 << 24))

    def kv_report(self) -> Dict[str, Any]:
        """The cache as it stands: spec, kv_type, n_past, slots (per KV head over the layers),
        kv_bytes (keys and values in the slots held), kv_bytes_allocated, kv_bytes_peak (the most
        key and value rows and slot metadata allocated at once), full_kv_bytes and
        full_f16_kv_bytes (a full cache of the same / F16 type for n_past tokens), kv_mem_per_seq
        (None without it, else {asked, bytes, slots, full_cap, note}: the slots per KV head and
        layer that fit, the policy's budget or the full cache's cap, and the note ``d2o run
        --kv-report`` prints), and per layer its slots, budget, evicted and merged counts."""
        return self._s.kv_report()


def policies() -> Dict[str, List[Dict[str, Any]]]:
    """The KV policy registry: {"presets": [{name, doc, spec, keys, parts}], "keys": [{name,
    old_name, values, doc}]}. ``spec`` is the preset's canonical spec with every default."""
    return {"presets": _d2o._presets(), "keys": _d2o._keys()}


def canonical_spec(spec: str) -> str:
    """The canonical form of a policy spec; ValueError (with the CLI's message) for a bad one."""
    return _d2o._canonical_spec(_str(spec, "spec"))
