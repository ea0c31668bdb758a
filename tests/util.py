"""Reference decoding with mlx-lm alone, for comparisons."""

from typing import List

import mlx_lm

from dflash_mlx import stream_generate


def mlx_tokens(model, tokenizer, prompt, max_tokens: int, **kw) -> List[int]:
    """Token ids of mlx-lm's own generation (a final EOS included)."""
    return mlx_run(model, tokenizer, prompt, max_tokens, **kw)[0]


def mlx_run(model, tokenizer, prompt, max_tokens: int, **kw):
    """(token ids, streamed text) of mlx-lm's own generation."""
    rs = list(mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, **kw))
    return [r.token for r in rs], "".join(r.text for r in rs)


def dflash_tokens(model, draft, tokenizer, prompt, **kw):
    """(token ids, responses) of dflash_mlx's generation."""
    out, responses = [], []
    for r in stream_generate(model, draft, tokenizer, prompt, **kw):
        out += r.tokens
        responses.append(r)
    return out, responses


def count_pq(monkeypatch) -> List[int]:
    """A one-item list counting the calls of the p/q rule in decoding."""
    import dflash_mlx.engine.decoding as decoding

    calls, rule = [0], decoding.speculative

    def counted(*a):
        calls[0] += 1
        return rule(*a)

    monkeypatch.setattr(decoding, "speculative", counted)
    return calls


def runs(tokens: List[int], length: int = 3) -> List[int]:
    """Tokens that repeat at least ``length`` times in a row."""
    found, n = [], 1
    for prev, t in zip(tokens, tokens[1:]):
        n = n + 1 if t == prev else 1
        if n == length and t not in found:
            found.append(t)
    return found


def default_sigint() -> None:
    """A child's ``preexec_fn``: a suite started in the background (``cmd &``)
    inherits an ignored SIGINT, and so would the child; give it a terminal's
    default, so the tests that send it SIGINT see it stop."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def openai_client(port: int, wait: float = 60.0):
    """An openai client of the server on ``port``, once it answers (or after ``wait`` seconds)."""
    import time

    import openai

    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
    end = time.monotonic() + wait
    while time.monotonic() < end:
        try:
            c.models.list()
            break
        except openai.APIConnectionError:
            time.sleep(0.1)
    return c
