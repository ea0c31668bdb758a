"""A soak of the server over 127.0.0.1: many clients at once sending mixed
requests (streamed or not, chat and completions, greedy and seeded,
log-probabilities, stop strings, long prompts sharing prefixes, clients that
hang up, malformed bodies), on checkpoints stored in float16, bfloat16 and
float32; then 64 requests at once. No answer may be 5xx, every greedy answer
must be the target's own text, and the server must answer afterwards exactly
as before."""

import http.client
import json
import random
import threading
import time

import mlx.core as mx
import pytest

from dflash_mlx import load, load_draft, stream_generate
from dflash_mlx.serve.server import Served, make_server
from tiny import make_draft, make_target

THREADS, PER_THREAD = 8, 17  # 136 requests a checkpoint, 408 in all
MAX_TOKENS = 12
PREFIX = "def total(items):\n    result = 0\n    for item in items:\n"
PROMPTS = [PREFIX + s for s in ("        result +=", "        if item:", "        print(", "    return")]
LONG = "# " + "the quick brown fox jumps over the lazy dog; " * 12 + "\n" + PREFIX
KINDS = ["greedy", "stream", "chat", "seeded", "logprobs", "stop", "long", "hangup_stream", "hangup",
         "garbage", "bad_field"]


def _request(port, body, raw=False, hang_up=False):
    """(status, text, done) of one POST to /v1/completions or chat; a
    hang-up closes the connection after the first bytes of the answer."""
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, body=body if raw else json.dumps(body),
                     headers={"Content-Type": "application/json"})
        if hang_up:
            conn.sock.recv(1) if body.get("stream") else None
            return None, "", True
        r = conn.getresponse()
        data = r.read().decode()
    finally:
        conn.close()
    if r.status != 200 or not (isinstance(body, dict) and body.get("stream")):
        return r.status, data, True
    text, done = "", False
    for line in data.splitlines():
        if line == "data: [DONE]":
            done = True
        elif line.startswith("data: "):
            for c in json.loads(line[6:]).get("choices", []):
                text += c.get("text") or (c.get("delta") or {}).get("content") or ""
    return r.status, text, done


def _body(kind, rng, tok):
    p = rng.choice(PROMPTS)
    if kind == "greedy":
        return {"prompt": p, "max_tokens": MAX_TOKENS}
    if kind == "stream":
        return {"prompt": p, "max_tokens": MAX_TOKENS, "stream": True}
    if kind == "chat":
        return {"messages": [{"role": "user", "content": p}], "max_tokens": MAX_TOKENS,
                "stream": rng.random() < 0.5}
    if kind == "seeded":
        return {"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0.8, "seed": rng.randrange(100),
                "stream": rng.random() < 0.5}
    if kind == "logprobs":
        return {"messages": [{"role": "user", "content": p}], "max_tokens": MAX_TOKENS, "logprobs": True,
                "top_logprobs": 2, "stream": rng.random() < 0.5}
    if kind == "stop":
        return {"prompt": p, "max_tokens": MAX_TOKENS, "stop": ["(", "\n"], "logprobs": 1}
    if kind == "long":
        return {"prompt": LONG, "max_tokens": MAX_TOKENS, "stream": rng.random() < 0.5}
    if kind.startswith("hangup"):
        return {"prompt": p, "max_tokens": 64, "stream": kind == "hangup_stream"}
    if kind == "garbage":
        return rng.choice([b"{not json", b"[1, 2]", b'{"prompt": 5}', b"\xff\xfe", b""])
    return {"prompt": p, "max_tokens": "many"}


def _expected(kind, body, want):
    """The text a greedy request must get, or None (anything is fine)."""
    if kind in ("greedy", "stream", "long"):
        return want[body["prompt"]]
    if kind == "chat":
        return want[body["messages"][0]["content"], "chat"]
    if kind == "stop":
        text = want[body["prompt"]]
        cuts = [i for i in (text.find(s) for s in body["stop"]) if i >= 0]
        return text[: min(cuts)] if cuts else text
    return None


def _storm(port, tok, want, seed):
    """Run the storm; return the problems seen (empty: none)."""
    problems, lock = [], threading.Lock()

    def client(i):
        rng = random.Random(seed * 100 + i)
        for _ in range(PER_THREAD):
            kind = rng.choice(KINDS)
            body = _body(kind, rng, tok)
            try:
                status, text, done = _request(port, body, raw=kind == "garbage", hang_up=kind.startswith("hangup"))
            except (OSError, http.client.HTTPException) as e:
                status, text, done = "no answer", repr(e), True
            expected = 400 if kind in ("garbage", "bad_field") else (None if kind.startswith("hangup") else 200)
            bad = []
            if status != expected:
                bad.append(f"status {status}: {text[:200]}")
            elif status == 200:
                if not done:
                    bad.append("a stream that did not end with [DONE]")
                got = text if isinstance(body, dict) and body.get("stream") else _text(text)
                if _expected(kind, body, want) not in (None, got):
                    bad.append(f"text {got!r} != {_expected(kind, body, want)!r}")
            if bad:
                with lock:
                    problems.append((kind, bad))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "the storm did not end within 2 minutes"
    return problems


def _text(data):
    c = json.loads(data)["choices"][0]
    return c["text"] if "text" in c else c["message"]["content"]


@pytest.mark.parametrize("dtype, width, block", [("float16", 4, "auto"), ("bfloat16", 1, "auto"), ("float32", 4, "auto")])
def test_soak(tmp_path_factory, dtype, width, block):
    root = tmp_path_factory.mktemp(f"soak_{dtype}")
    folder = make_target(root / "target", "qwen3", dtype=getattr(mx, dtype))
    model, tok = load(str(folder))
    draft = load_draft(str(make_draft(root / "draft", folder)))
    chat = {p: tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                       add_generation_prompt=True) for p in PROMPTS}

    def alone(prompt):
        return "".join(r.text for r in stream_generate(model, draft, tok, prompt, block_size=block,
                                                       max_tokens=MAX_TOKENS))

    want = {p: alone(p) for p in PROMPTS + [LONG]}
    want.update({(p, "chat"): alone(chat[p]) for p in PROMPTS})
    served = Served(model, draft, tok, "tiny", block_size=block, max_tokens=64, concurrency=width)
    srv = make_server(served, "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    try:
        probe = {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS}
        before = _text(_request(port, probe)[1])
        tic = time.monotonic()
        problems = _storm(port, tok, want, seed=width)
        took = time.monotonic() - tic
        assert not problems, problems[:5]
        # 64 requests at once: all answered, each with its own greedy text.
        burst = [None] * 64

        def one(i):
            p = PROMPTS[i % len(PROMPTS)]
            status, data, _ = _request(port, {"prompt": p, "max_tokens": 4})
            burst[i] = status == 200 and want[p].startswith(_text(data))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert all(burst), burst.count(False)
        assert _text(_request(port, probe)[1]) == before == want[PROMPTS[0]]
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        assert took < 60
    finally:
        srv.shutdown()
        srv.server_close()
