"""The OpenAI-compatible server, driven over 127.0.0.1 by the official openai client."""

import http.client
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time

import openai
import pytest

from dflash_mlx import load_draft, stream_generate
from dflash_mlx.serve.server import Served, make_server
from tiny import make_draft
from util import free_port, mlx_run, openai_client

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = 4


@pytest.fixture(scope="module")
def pair(loaded, tmp_path_factory):
    model, tok, folder = loaded("qwen3")
    draft_dir = make_draft(tmp_path_factory.mktemp("sdraft") / "d", folder)
    return model, load_draft(str(draft_dir)), tok, folder, draft_dir


@pytest.fixture(scope="module")
def server(pair):
    model, draft, tok, folder, _ = pair
    served = Served(model, draft, tok, "tiny", block_size=BLOCK, max_tokens=16)
    srv = make_server(served, "127.0.0.1", 0)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv, served
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def client(server):
    port = server[0].server_address[1]
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)


def fresh(pair, prompt, n, **kw):
    """The text stream_generate writes from scratch (greedy unless told)."""
    model, draft, tok = pair[:3]
    return "".join(r.text for r in stream_generate(model, draft, tok, prompt, block_size=BLOCK, max_tokens=n, **kw))


def templated(tok, messages):
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def raw(server, method, path, body=None):
    conn = http.client.HTTPConnection("127.0.0.1", server[0].server_address[1], timeout=30)
    conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    out = r.status, json.loads(r.read())
    conn.close()
    return out


def test_completions_greedy_equal_mlx_lm(pair, client):
    model, _, tok = pair[:3]
    _, want = mlx_run(model, tok, "def main(", 20)
    r = client.completions.create(model="tiny", prompt="def main(", max_tokens=20)
    assert r.choices[0].text == want == fresh(pair, "def main(", 20)
    assert r.object == "text_completion" and r.model == "tiny"
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens == len(tok.encode("def main(")) and r.usage.completion_tokens <= 20
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.model_extra["dflash"]["rounds"] >= 1 and r.model_extra["dflash"]["mean_accepted"] >= 1
    chunks = list(client.completions.create(model="default", prompt="def main(", max_tokens=20, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_chat_greedy_streamed_and_not(pair, client):
    model, _, tok = pair[:3]
    msgs = [{"role": "user", "content": "Write a loop"}]
    _, want = mlx_run(model, tok, templated(tok, msgs), 24)
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=24)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.object == "chat.completion"
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=24,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_stop_strings(pair, client):
    full = fresh(pair, "import os\n", 30)
    stop = full[6:9]
    want = full[: full.find(stop)]
    r = client.completions.create(model="tiny", prompt="import os\n", max_tokens=30, stop=[stop, "\x00never"])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model="tiny", prompt="import os\n", max_tokens=30, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs_are_the_targets(server, pair, client):
    """Completions (logprobs=N) and chat (logprobs, top_logprobs), streamed
    and not: each token's log-probability and best alternatives are mlx-lm's."""
    import mlx_lm
    import numpy as np

    model, _, tok = pair[:3]
    msgs = [{"role": "user", "content": "Write a loop"}]
    for prompt, chat in (("def main(", False), (templated(tok, msgs), True)):
        ref = [r for r in mlx_lm.stream_generate(model, tok, prompt, max_tokens=20)
               if r.token not in tok.eos_token_ids]
        want = [float(r.logprobs[r.token]) for r in ref]
        best = [int(np.argmax(np.array(r.logprobs))) for r in ref]
        for stream in (False, True):
            if chat:
                r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=20, stream=stream,
                                                   logprobs=True, top_logprobs=3)
                parts = [c.choices[0].logprobs for c in r if c.choices and c.choices[0].logprobs] if stream \
                    else [r.choices[0].logprobs]
                got = [e for p in parts for e in p.content]
                assert [e.token for e in got] == [tok.decode([r.token]) for r in ref]
                lps, tops = [e.logprob for e in got], [e.top_logprobs for e in got]
                assert all(len(t) == 3 and t[0].token == tok.decode([b]) for t, b in zip(tops, best))
            else:
                r = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, stream=stream, logprobs=2)
                parts = [c.choices[0].logprobs for c in r] if stream else [r.choices[0].logprobs]
                lps = [x for p in parts if p for x in p.token_logprobs]
                tops = [x for p in parts if p for x in p.top_logprobs]
                # Best first; alternatives that decode alike (byte pieces) share a key.
                assert all(len(t) in (1, 2) and next(iter(t)) == tok.decode([b]) for t, b in zip(tops, best))
            assert len(lps) == len(want) and np.allclose(lps, want, atol=1e-4), (chat, stream)
    status, err = raw(server, "POST", "/v1/chat/completions",
                      json.dumps({"messages": msgs, "top_logprobs": 2}).encode())
    assert status == 400 and err["error"]["param"] == "top_logprobs"
    for path, body in (("/v1/completions", {"prompt": "hi", "logprobs": False}),
                       ("/v1/chat/completions", {"messages": msgs, "top_logprobs": 0})):
        status, r = raw(server, "POST", path, json.dumps(dict(body, max_tokens=2)).encode())
        assert status == 200 and r["choices"][0]["logprobs"] is None  # neutral values


def test_seeded_sampling_is_reproducible(pair, client):
    kw = dict(temperature=1.0, top_p=0.9, seed=7)
    want = fresh(pair, "class A", 20, **kw)
    rs = [client.completions.create(model="tiny", prompt="class A", max_tokens=20, **kw) for _ in range(2)]
    assert [r.choices[0].text for r in rs] == [want, want]
    # The second reused the first's cache: draws depend on positions only.
    assert rs[1].usage.prompt_tokens_details.cached_tokens > 0


def test_full_prompt_cached_follow_up_identical(pair, client):
    prompt = "for i in range(10):"
    a = client.completions.create(model="tiny", prompt=prompt, max_tokens=12)
    b = client.completions.create(model="tiny", prompt=prompt, max_tokens=12)
    assert a.choices[0].text == b.choices[0].text == fresh(pair, prompt, 12)
    assert b.usage.prompt_tokens_details.cached_tokens == b.usage.prompt_tokens - 1


def test_second_chat_turn_reuses_the_cache(pair, client):
    tok = pair[2]
    msgs = [{"role": "user", "content": "Hello there, write some code"}]
    first = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And more"}]
    second = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.choices[0].message.content == fresh(pair, templated(tok, msgs), 10)


def test_three_concurrent_clients(server, pair, client):
    prompts = ["import sys", "x = [", "while True:"]
    want = {p: fresh(pair, p, 16) for p in prompts}
    got = {}

    def run(p):
        got[p] = client.completions.create(model="tiny", prompt=p, max_tokens=16).choices[0].text

    scheduler = server[1].scheduler
    batch = scheduler.batch
    batch.widest = 0
    started = threading.Event()

    def hold():  # on the model thread, until all three requests are queued: they start together
        started.set()
        deadline = time.monotonic() + 60
        while len(scheduler._waiting) < len(prompts) and time.monotonic() < deadline:
            time.sleep(0.01)

    holder = threading.Thread(target=scheduler.call, args=(hold,))
    holder.start()
    assert started.wait(60)
    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads + [holder]:
        t.join(60)
    assert got == want
    assert batch.widest > 1  # they were decoded together


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_mid_stream_frees_the_model(server, pair, client, stream, caplog):
    caplog.set_level(logging.INFO, logger="dflash_mlx.serve.scheduler")
    srv, served = server
    served.cache.clear()
    body = json.dumps({"prompt": "print(", "max_tokens": 4000, "stream": stream}).encode()
    s = socket.create_connection(("127.0.0.1", srv.server_address[1]))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    if stream:
        assert b"200" in s.recv(200)  # generation has started
    else:
        time.sleep(0.3)
    s.close()
    deadline = time.time() + 10
    while len(served.scheduler.batch) and time.time() < deadline:
        time.sleep(0.05)
    assert not len(served.scheduler.batch)
    left = [r.args[0] for r in caplog.records if r.name == "dflash_mlx.serve.scheduler"]
    assert len(left) == 1 and left[0] < 3000  # stopped well before 4000 tokens
    r = client.completions.create(model="tiny", prompt="def f(", max_tokens=8)
    assert r.choices[0].text == fresh(pair, "def f(", 8)


@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    (b"[1, 2]", None),
    (b'{"prompt": 5}', "prompt"),
    (b'{"prompt": "hi", "max_tokens": 0}', "max_tokens"),
    (b'{"prompt": "hi", "max_tokens": "7"}', "max_tokens"),
    (b'{"prompt": "hi", "temperature": -1}', "temperature"),
    (b'{"prompt": "hi", "top_p": 2}', "top_p"),
    (b'{"prompt": "hi", "stop": 3}', "stop"),
    (b'{"prompt": [1, 999999]}', "prompt"),
    (b'{"prompt": "hi", "presence_penalty": 0.5}', "presence_penalty"),
    (b'{"prompt": "hi", "logprobs": 9}', "logprobs"),
    (b'{"prompt": ' + json.dumps([5] * 5000).encode() + b"}", "prompt"),
])
def test_bad_requests_get_openai_errors(server, body, param):
    status, r = raw(server, "POST", "/v1/completions", body)
    assert status == 400
    assert set(r["error"]) == {"message", "type", "param", "code"} and r["error"]["param"] == param


def test_bad_chat_and_model_and_path(server, client):
    assert raw(server, "POST", "/v1/chat/completions", b'{"messages": "hi"}')[0] == 400
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert raw(server, "POST", "/v1/nothing", b"{}")[0] == 404
    assert raw(server, "GET", "/health")[1] == {"status": "ok"}
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_short_load_loses_nothing(server, pair, client):
    prompts = ["a = 1", "b = 2", "def g(", "return"]
    want = {p: fresh(pair, p, 4) for p in prompts}
    results, errors = [], []

    def worker(i):
        for j in range(5):
            p = prompts[(i + j) % 4]
            try:
                results.append(client.completions.create(model="tiny", prompt=p, max_tokens=4).choices[0].text == want[p])
            except Exception as e:  # counted below
                errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and results == [True] * 20
    assert raw(server, "GET", "/health")[0] == 200  # and the server is alive


def test_server_command_line(pair, tmp_path):
    _, _, tok, folder, draft_dir = pair
    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.Popen([sys.executable, "-m", "dflash_mlx.server", "--model", str(folder), "--draft",
                          str(draft_dir), "--port", str(port), "--block-size", "4", "--log-level", "WARNING"],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        c = openai_client(port, wait=30)
        r = c.completions.create(model=str(folder), prompt="def main(", max_tokens=20)
        assert r.choices[0].text == fresh(pair, "def main(", 20)
    finally:
        p.terminate()
        p.wait(10)


def test_cached_entries_hold_their_keys(server):
    entries = server[1].cache.entries
    assert entries and all(c[0].offset == len(k) and d.size == len(k) for k, (c, d) in entries.items())


def test_prompt_cache_bounded_by_bytes(pair):
    """--prompt-cache-bytes: the least recently used entries go until the
    rest fit; an entry larger than the bound is not kept."""
    from mlx_lm.models.cache import make_prompt_cache

    from dflash_mlx import DraftCache
    from dflash_mlx.serve.server import PromptCache, _nbytes, build_parser, parse_size

    model, draft, tok = pair[:3]

    def entry(text):
        cache, dcache = make_prompt_cache(model), DraftCache(draft)
        list(stream_generate(model, draft, tok, text, block_size=BLOCK, max_tokens=3, prompt_cache=cache,
                             draft_cache=dcache))
        return cache, dcache

    entries = {k: entry(k) for k in ("import os", "def f(", "while x:")}
    one = _nbytes(entries["import os"])
    assert one > 0
    pc = PromptCache(10, max_bytes=int(2.5 * one))
    for i, (k, e) in enumerate(entries.items()):
        pc.put((i,), e)
    assert list(pc.entries) == [(1,), (2,)] and pc.nbytes <= 2.5 * one
    small = PromptCache(10, max_bytes=one // 2)
    small.put((0,), entries["def f("])
    assert not small.entries
    assert parse_size("2GB") == 2 * 10**9 and parse_size("1.5m") == 1_500_000 and parse_size("4096") == 4096
    assert build_parser().parse_args(["--prompt-cache-bytes", "500MB"]).prompt_cache_bytes == 500 * 10**6
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--prompt-cache-bytes", "lots"])


def test_chat_command_through_stdin(pair):
    import re

    model, _, tok, folder, draft_dir = pair
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-m", "dflash_mlx.chat", "--model", str(folder), "--draft", str(draft_dir),
                        "--max-tokens", "12", "--block-size", "4"],
                       input="Write a loop\nAnd another\n/reset\nWrite a loop\n/quit\n",
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    turns = r.stdout.split(">> ")[1:]
    stats = [re.search(r"\[(\d+) tokens, .* tok/s, .* tokens per round, (\d+) prompt tokens cached\]", t) for t in turns[:4]]
    _, want = mlx_run(model, tok, templated(tok, [{"role": "user", "content": "Write a loop"}]), 12)
    assert turns[0].rpartition("\n[")[0] == want == turns[3].rpartition("\n[")[0]
    assert stats[0] and stats[1] and stats[3]
    assert int(stats[0].group(2)) == 0 and int(stats[1].group(2)) > 0 and int(stats[3].group(2)) == 0
    assert "reset" in turns[2] and turns[4] == ""


def test_draft_cache_keeps_the_drafts_context(pair):
    """A conversation continued with a DraftCache leaves the draft proposing
    as after a fresh prefill of the whole text; without it, it does not."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from dflash_mlx import DraftCache
    from dflash_mlx.engine.target import Target

    model, draft, tok = pair[:3]
    t = Target(model)
    first = tok.encode("def main(x):")
    cache, dcache = make_prompt_cache(model), DraftCache(draft)
    gen = [x for r in stream_generate(model, draft, tok, first, block_size=BLOCK, max_tokens=9,
                                      prompt_cache=cache, draft_cache=dcache) for x in r.tokens]
    assert cache[0].offset == dcache.size == len(first) + len(gen) - 1
    more = tok.encode(" return x")

    def proposal(cache, state, ids):
        """The draft's block after prefilling ``ids`` onto the caches."""
        r = next(stream_generate(model, draft, tok, ids, block_size=BLOCK, max_tokens=1,
                                 prompt_cache=cache, draft_cache=state))
        return draft.propose(mx.array([r.token]), state.pending, state.cache, t.embed, t.head, draft.block_size)

    kept = proposal(cache, dcache, [gen[-1]] + more)
    fresh_ = proposal(make_prompt_cache(model), DraftCache(draft), first + gen + more)
    assert mx.allclose(kept, fresh_, atol=1e-4).item()
    # The draft seeing only the new tokens (no DraftCache kept) proposes otherwise.
    cache = make_prompt_cache(model)
    list(stream_generate(model, draft, tok, first + gen[:-1], block_size=BLOCK, max_tokens=1, prompt_cache=cache))
    blind = proposal(cache, DraftCache(draft), [gen[-1]] + more)
    assert not mx.allclose(blind, fresh_, atol=1e-4).item()
