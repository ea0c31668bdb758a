"""`python -m dflash_mlx.server`: an OpenAI-compatible HTTP server for DFlash.

Endpoints: ``GET /v1/models``, ``GET /health``, ``POST /v1/completions`` and
``POST /v1/chat/completions`` (also without ``/v1``), as JSON or as server-sent
events (``stream: true``). Every answer is produced by :func:`stream_generate`,
so it is exactly the target's own output. Besides the OpenAI fields a response
carries ``"dflash": {"mean_accepted", "rounds", "generation_tps", "prompt_tps"}``.
``logprobs`` (and chat's ``top_logprobs``) report the target's own
log-probabilities, in OpenAI's shapes.

Up to ``--decode-concurrency`` generations are decoded together in one batch
(the others wait in arrival order); a client that disconnects stops its
generation. The caches of recent conversations (the
target's and the draft's context) are kept in a small LRU: a prompt that shares
a cached token prefix only prefills its new tokens (reported as
``usage.prompt_tokens_details.cached_tokens``), with the same output as a fresh
run (seeded sampling included: a token's draw depends on the seed and its position
only, up to the target's rounding).
"""

import argparse
import collections
import itertools
import json
import logging
import queue
import re
import select
import socket
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import List, Optional

import mlx.core as mx

from ..engine.decoding import DraftCache
from ..models.distributed import group
from ..errors import DFlashError, exit_now, run_command
from .scheduler import Scheduler
from ..engine.target import Target, model_args

log = logging.getLogger("dflash_mlx.server")


class ApiError(Exception):
    """A request the server refuses, with its HTTP status and OpenAI error fields."""

    def __init__(self, message, param=None, status=400, code=None, kind="invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


class PromptCache:
    """(target cache, draft cache or None) pairs keyed by the tokens they hold,
    at most ``size`` of them and ``max_bytes`` in all (None: no bound), the
    least recently used dropped first."""

    def __init__(self, size: int, max_bytes: Optional[int] = None):
        self.size, self.max_bytes = size, max_bytes
        self.entries = collections.OrderedDict()
        self.sizes = {}  # key -> bytes held
        self.lock = threading.Lock()  # batched requests take and put concurrently

    @property
    def nbytes(self) -> int:
        return sum(self.sizes.values())

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()
            self.sizes.clear()

    def take(self, ids: List[int]):
        """(cache, reused) for ``ids``: the entry sharing the longest prefix,
        removed and cut to at most ``len(ids) - 1`` tokens, or (None, 0)."""
        with self.lock:
            return self._take(ids)

    def _take(self, ids: List[int]):
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        best, best_n = None, 0
        for key, (cache, _) in self.entries.items():
            n = min(_common(key, ids), len(ids) - 1)
            if n > best_n and (n == len(key) or can_trim_prompt_cache(cache)):
                best, best_n = key, n
        if best is None:
            return None, 0
        entry = self.entries.pop(best)
        self.sizes.pop(best)
        if len(best) > best_n:
            trim_prompt_cache(entry[0], len(best) - best_n)
            if entry[1] is not None:
                entry[1].trim(len(best) - best_n)
        return entry, best_n

    def put(self, key: tuple, entry: tuple) -> None:
        n = _nbytes(entry)
        if self.size <= 0 or not key or (self.max_bytes is not None and n > self.max_bytes):
            return
        with self.lock:
            self.entries[key], self.sizes[key] = entry, n
            self.entries.move_to_end(key)
            while len(self.entries) > self.size or (self.max_bytes is not None and self.nbytes > self.max_bytes):
                self.sizes.pop(self.entries.popitem(last=False)[0])


def _nbytes(entry: tuple) -> int:
    """Bytes held by a (target cache, draft cache or None) entry."""
    cache, dcache = entry
    layers = list(cache) + (list(dcache.cache) if dcache is not None else [])
    n = sum(c.nbytes for c in layers)
    pending = dcache.pending if dcache is not None else None
    return n + (pending.nbytes if pending is not None else 0)


def parse_size(text: str) -> int:
    """Bytes from ``"2GB"``, ``"500M"``, ``"1.5G"`` or a plain number."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([KMG]?)B?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GB, 500MB, 1000000)")
    return int(Decimal(m.group(1)) * 1000 ** " KMG".index(m.group(2).upper() or " "))


def _common(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Request:
    """One parsed completion request."""

    chat: bool
    ids: List[int]
    max_tokens: int
    sampling: dict
    stop: List[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    logprobs: Optional[int] = None  # None: not asked; else how many top alternatives


class Served:
    """The loaded pair, the server's defaults and its shared state."""

    def __init__(self, model, draft, tokenizer, model_id, block_size="auto", temp=0.0, top_p=0.0,
                 top_k=0, min_p=0.0, max_tokens=512, chat_template_args=None, prompt_cache_size=4,
                 concurrency=4, prompt_cache_bytes=None):
        self.model, self.draft, self.tokenizer, self.model_id = model, draft, tokenizer, model_id
        self.block_size = block_size
        self.defaults = dict(temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p, seed=None)
        self.max_tokens = max_tokens
        self.chat_template_args = chat_template_args or {}
        self.cache = PromptCache(prompt_cache_size, prompt_cache_bytes)
        self.context = _context_length(model)
        self.vocab = Target(model).vocab_rows
        self.created = int(time.time())
        # The one thread that runs the model; a sharded target's ranks run
        # every generation to its end.
        self.scheduler = Scheduler(model, draft, tokenizer, block_size, concurrency, sticky=group() is not None)


def _context_length(model) -> Optional[int]:
    n = model_args(model).get("max_position_embeddings")
    return n if isinstance(n, int) else None


# ---------------------------------------------------------------- requests

def _number(body, name, default, kind=float, low=None, high=None):
    v = body.get(name)
    if v is None:
        return default
    ok = (int,) if kind is int else (int, float)
    if isinstance(v, bool) or not isinstance(v, ok):
        raise ApiError(f"'{name}' must be {'an integer' if kind is int else 'a number'}, got {v!r}.", name)
    if (low is not None and v < low) or (high is not None and v > high):
        raise ApiError(f"'{name}' is out of range: {v!r}.", name)
    return v


UNSUPPORTED = {"frequency_penalty": (0,), "presence_penalty": (0,), "repetition_penalty": (1,),
               "logit_bias": ({},), "tools": ([],), "best_of": (1,)}


def parse_request(served: Served, body, chat: bool) -> Request:
    """Check a request body and turn it into a :class:`Request` (ApiError if bad)."""
    if not isinstance(body, dict):
        raise ApiError("The request body must be a JSON object.")
    name = body.get("model")
    if name not in (None, "", "default", served.model_id):
        raise ApiError(f"The model '{name}' is not served here; use '{served.model_id}'.", "model",
                       404, "model_not_found")
    if _number(body, "n", 1, int) != 1:
        raise ApiError("Only n = 1 is supported.", "n")
    for name, neutral in UNSUPPORTED.items():  # refused rather than silently ignored
        if body.get(name) not in (None, *neutral):
            raise ApiError(f"'{name}' is not supported by this server.", name)
    d = served.defaults
    sampling = dict(
        temperature=_number(body, "temperature", d["temperature"], float, 0),
        top_p=_number(body, "top_p", d["top_p"], float, 0, 1),
        top_k=_number(body, "top_k", d["top_k"], int, 0),
        min_p=_number(body, "min_p", d["min_p"], float, 0, 1),
        seed=_number(body, "seed", None, int),
    )
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = _number({"max_tokens": limit}, "max_tokens", served.max_tokens, int)
    if max_tokens < 1:
        raise ApiError(f"'max_tokens' must be at least 1, got {max_tokens}.", "max_tokens")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError("'stop' must be a string or a list of non-empty strings.", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError("'stream' must be true or false.", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError("'stream_options' must be an object.", "stream_options")
    ids = _chat_ids(served, body) if chat else _prompt_ids(served, body.get("prompt"))
    if served.context and len(ids) >= served.context:
        raise ApiError(f"The prompt has {len(ids)} tokens; this model's context is {served.context}.",
                       "messages" if chat else "prompt", code="context_length_exceeded")
    if served.context:
        max_tokens = min(max_tokens, served.context - len(ids))
    return Request(chat, ids, max_tokens, sampling, stop, stream, bool(options.get("include_usage")),
                   _logprobs_asked(body, chat))


def _logprobs_asked(body, chat: bool) -> Optional[int]:
    """Chat: ``logprobs`` true and ``top_logprobs`` (0-20); completions:
    ``logprobs`` = the number of alternatives (0-5). None when not asked."""
    if not chat:
        return None if body.get("logprobs") is False else _number(body, "logprobs", None, int, 0, 5)
    asked = body.get("logprobs")
    if asked not in (None, True, False):
        raise ApiError("'logprobs' must be true or false.", "logprobs")
    top = _number(body, "top_logprobs", None, int, 0, 20)
    if top and not asked:
        raise ApiError("'top_logprobs' needs 'logprobs': true.", "top_logprobs")
    return (top or 0) if asked else None


def _prompt_ids(served: Served, prompt) -> List[int]:
    from ..engine.decoding import _prompt_ids as encode

    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    ok = isinstance(prompt, str) or (
        isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt))
    if not ok or not prompt:
        raise ApiError("'prompt' must be a non-empty string or list of token ids.", "prompt")
    ids = encode(served.tokenizer, prompt)
    if min(ids) < 0 or max(ids) >= served.vocab:
        raise ApiError("'prompt' holds token ids outside the vocabulary.", "prompt")
    return ids


def _content(m) -> str:
    c = m.get("content")
    if c is None or isinstance(c, str):
        return c or ""
    if isinstance(c, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in c):
        return "".join(str(p.get("text", "")) for p in c)
    raise ApiError("A message's 'content' must be a string or a list of text parts.", "messages")


def _chat_ids(served: Served, body) -> List[int]:
    from ..engine.decoding import _prompt_ids as encode

    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise ApiError("'messages' must be a non-empty list of objects with a 'role'.", "messages")
    tok = served.tokenizer
    if not getattr(tok, "chat_template", None):
        raise ApiError("This model's tokenizer has no chat template; use /v1/completions.", "messages")
    messages = [dict(m, content=_content(m)) for m in messages]
    extra = dict(served.chat_template_args)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ApiError("'chat_template_kwargs' must be an object.", "chat_template_kwargs")
    extra.update(kwargs)
    try:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
    except Exception as e:  # a template that rejects these messages
        raise ApiError(f"The chat template failed: {e}", "messages") from None
    return encode(tok, text)


# ---------------------------------------------------------------- generation

@dataclass
class Piece:
    """What the model thread sends a request's HTTP thread: plain Python values."""

    text: str
    records: list  # log-probability records of that text
    finish: Optional[str]
    last: object  # the latest GenerationResponse (its statistics are read)
    cached: int


@dataclass
class Outcome:
    """What a finished (or stopped) generation reports."""

    finish: Optional[str] = None
    last: object = None
    cached: int = 0
    logprobs: list = field(default_factory=list)  # records of the text yielded so far, not yet sent

    def sent_logprobs(self) -> list:
        """The log-probability records not sent yet (and forget them)."""
        out, self.logprobs = self.logprobs, []
        return out


def generate(served: Served, req: Request, out: Outcome, lead: bool = True):
    """Yield the text of ``req`` piece by piece (stop strings applied), made
    on the model thread; ``out`` gets the finish reason and statistics.
    Closing the generator stops the generation.

    On a target sharded over ranks (``mlx.launch``) rank 0 (``lead``) first
    shares the request with the other ranks, which run it too, and every rank
    runs each generation to the same end: a client that leaves only stops
    being written to."""
    reply = Reply(served, req, lead)
    served.scheduler.submit(reply)
    try:
        while (p := reply.queue.get()) is not None:
            if isinstance(p, BaseException):
                raise p
            out.finish, out.last, out.cached = p.finish, p.last, p.cached
            out.logprobs += p.records
            yield p.text
    finally:
        reply.gone.set()
        served.scheduler.wake()


def follow(served: Served) -> None:
    """A follower rank of a sharded server: run every request rank 0 shares,
    until it shares None (it is shutting down)."""
    from ..models.distributed import share

    while (shared := share()) is not None:
        try:
            for _ in generate(served, Request(**shared), Outcome(), lead=False):
                pass
        except ApiError:
            pass  # rank 0 answers it


class Reply:
    """One request as the model thread runs it (a :class:`.scheduler.Job`):
    it takes the longest cached prefix, turns responses into text pieces
    (stop strings, log-probabilities) and keeps the cache of a clean end."""

    def __init__(self, served: Served, req: Request, lead: bool = True):
        self.served, self.req, self.lead = served, req, lead
        self.gone = threading.Event()
        self.queue: queue.Queue = queue.Queue()
        self.entry, self.cached, self.last = None, 0, None
        self.tokens, self.text, self.sent = list(req.ids), "", 0
        self.held: list = []  # records of text not sent yet
        self.hold = max((len(s) for s in req.stop), default=1) - 1

    def start(self) -> dict:
        from mlx_lm.models.cache import make_prompt_cache

        from ..models.distributed import group, share

        s, req = self.served, self.req
        if self.lead and group() is not None:
            share(asdict(req))
        self.entry, self.cached = s.cache.take(req.ids)
        if self.entry is None:
            drafting = s.draft is not None and s.block_size != 1
            self.entry = (make_prompt_cache(s.model), DraftCache(s.draft) if drafting else None)
        return dict(prompt=req.ids[self.cached:], max_tokens=req.max_tokens, prompt_cache=self.entry[0],
                    draft_cache=self.entry[1], **req.sampling)

    def feed(self, r) -> bool:
        req, self.last = self.req, r
        self.tokens += r.tokens
        if req.logprobs is not None:
            self.held += _records(self.served, r, req.logprobs, len(self.text))
        self.text += r.text
        cut = min((i for i in (self.text.find(s, self.sent) for s in req.stop) if i >= 0), default=-1)
        if cut >= 0:
            self._send(cut, "stop", at_stop_string=True)
            return False
        end = len(self.text) if r.finish_reason else max(self.sent, len(self.text) - self.hold)
        if end > self.sent or r.finish_reason:
            self._send(end, r.finish_reason)
        return r.finish_reason is None

    def _send(self, end: int, finish: Optional[str], at_stop_string: bool = False) -> None:
        # Cut at a stop string: the records that start before it; else those that end by ``end``.
        records = [h for h in self.held if (h["offset"] < end if at_stop_string else h["end"] <= end)]
        self.held = self.held[len(records):]
        self.queue.put(Piece(self.text[self.sent:end], records, finish, self.last, self.cached))
        self.sent = end

    def end(self, clean: bool) -> None:
        if clean and self.last is not None:
            _keep(self.served, self.entry, self.tokens, len(self.req.ids) + self.last.committed)
        self.queue.put(None)

    def fail(self, e: BaseException) -> None:
        self.queue.put(ApiError(str(e)) if isinstance(e, (DFlashError, ValueError)) else e)


def _records(served: Served, r, top: int, start: int) -> List[dict]:
    """One record per token of response ``r`` (an ending EOS left out):
    its text, log-probability and ``top`` best alternatives, and where its
    text starts and ends in the reply (``start``: the reply's length before it)."""
    import numpy as np

    tok, eos = served.tokenizer, set(served.tokenizer.eos_token_ids)
    rows = r.logprobs
    rows = np.array(rows if rows.dtype == mx.float32 else rows.astype(mx.float32))
    tokens = [t for t in r.tokens if t not in eos]
    out, at, stop = [], start, start + len(r.text)
    for i, (t, row) in enumerate(zip(tokens, rows)):
        # Where the round's text so far ends (decoding tokens together keeps
        # the spaces and multi-byte characters that single tokens lose).
        end = stop if i == len(tokens) - 1 else min(start + len(tok.decode(tokens[: i + 1])), stop)
        best = sorted(np.argpartition(-row, top)[:top] if top else [], key=lambda j: -row[j])
        out.append({"token": tok.decode([t]), "logprob": float(row[t]), "offset": at, "end": max(end, at),
                    "top": [(tok.decode([int(j)]), float(row[j])) for j in best]})
        at = out[-1]["end"]
    return out


def _logprobs(req: Request, records: List[dict]):
    """A choice's ``logprobs`` field, in OpenAI's shape for chat or completions."""
    if req.logprobs is None:
        return None
    if not req.chat:
        return {"tokens": [r["token"] for r in records], "token_logprobs": [r["logprob"] for r in records],
                "top_logprobs": [dict(r["top"]) for r in records], "text_offset": [r["offset"] for r in records]}

    def entry(s, lp):
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return {"content": [dict(entry(r["token"], r["logprob"]), top_logprobs=[entry(*t) for t in r["top"]])
                        for r in records], "refusal": None}


def _keep(served: Served, entry: tuple, tokens: List[int], held: int) -> None:
    """Store ``entry`` (holding ``held`` tokens, the first of ``tokens``)."""
    from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

    cache, dcache = entry
    if held > len(tokens):  # drafts accepted after an EOS
        if not can_trim_prompt_cache(cache):
            return
        trim_prompt_cache(cache, held - len(tokens))
        if dcache is not None:
            dcache.trim(held - len(tokens))
        held = len(tokens)
    if dcache is not None and dcache.size != held:  # never expected; stay exact
        dcache = None
    # Evaluated now: the graph behind them is freed while the entry waits.
    arrays = [c.state for c in cache]
    if dcache is not None:
        arrays += [c.state for c in dcache.cache if c.keys is not None] + [dcache.pending]
    mx.eval(arrays)
    served.cache.put(tuple(tokens[:held]), (cache, dcache))


def _usage(req: Request, out: Outcome) -> dict:
    n = out.last.generation_tokens if out.last is not None else 0
    return {"prompt_tokens": len(req.ids), "completion_tokens": n, "total_tokens": len(req.ids) + n,
            "prompt_tokens_details": {"cached_tokens": out.cached}}


def _stats(out: Outcome) -> dict:
    r = out.last
    if r is None:
        return {"mean_accepted": 0.0, "rounds": 0}
    return {"mean_accepted": round(r.mean_accepted, 4), "rounds": r.rounds,
            "generation_tps": round(r.generation_tps, 3), "prompt_tps": round(r.prompt_tps, 3)}


def _choice(req: Request, text, finish, delta=False, first=False, records=()) -> dict:
    lp = _logprobs(req, list(records))
    if not req.chat:
        return {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}
    if delta:
        d = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": 0, "delta": d, "logprobs": lp, "finish_reason": finish}
    return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lp,
            "finish_reason": finish}


def _envelope(served: Served, req: Request, rid: str, created: int, chunk=False) -> dict:
    kind = ("chat.completion" if req.chat else "text_completion") + (".chunk" if chunk and req.chat else "")
    return {"id": rid, "object": kind, "created": created, "model": served.model_id}


def _completion(served: Served, req: Request, rid: str, created: int, text: str, out: Outcome) -> dict:
    """The whole answer, as one JSON body."""
    choice = _choice(req, text, out.finish, records=out.sent_logprobs())
    return dict(_envelope(served, req, rid, created), choices=[choice], usage=_usage(req, out), dflash=_stats(out))


def _chunks(served: Served, req: Request, rid: str, created: int, pieces, out: Outcome):
    """The answer as stream chunks, one per piece of text as it comes (made
    lazily: each piece's log-probabilities are taken when its chunk is)."""
    base = _envelope(served, req, rid, created, chunk=True)
    if req.chat:
        yield dict(base, choices=[_choice(req, "", None, True, True)])
    for piece in pieces:
        if piece:
            yield dict(base, choices=[_choice(req, piece, None, True, records=out.sent_logprobs())])
    yield dict(base, choices=[_choice(req, "", out.finish, True, records=out.sent_logprobs())],
               dflash=_stats(out))
    if req.include_usage:
        yield dict(base, choices=[], usage=_usage(req, out))


# ---------------------------------------------------------------- HTTP

class Handler(BaseHTTPRequestHandler):
    served: Served = None  # set by make_server
    server_version = "dflash_mlx"

    def log_message(self, fmt, *args):
        log.debug("%s " + fmt, self.address_string(), *args)

    def do_GET(self):
        path = self.path.split("?")[0].rstrip("/")
        if path == "/health":
            return self._json(200, {"status": "ok"})
        if path in ("/v1/models", "/models"):
            s = self.served
            return self._json(200, {"object": "list", "data": [
                {"id": s.model_id, "object": "model", "created": s.created, "owned_by": "dflash_mlx"}]})
        self._json(404, ApiError(f"Unknown path {path!r}.", status=404, code="not_found").body())

    def do_POST(self):
        path, self.streaming = self.path.split("?")[0].rstrip("/"), False
        routes = {"/v1/completions": False, "/completions": False,
                  "/v1/chat/completions": True, "/chat/completions": True}
        try:
            if path not in routes:
                raise ApiError(f"Unknown path {path!r}.", status=404, code="not_found")
            req = parse_request(self.served, self._body(), routes[path])
            self._answer(req)
        except ApiError as e:
            log.warning("%s %s -> %d: %s", self.command, path, e.status, e)
            self._json(e.status, e.body())
        except (BrokenPipeError, ConnectionResetError):
            log.info("%s %s: the client went away", self.command, path)
        except Exception as e:  # never let one request take the server down
            log.exception("%s %s failed", self.command, path)
            if getattr(self, "streaming", False):  # a stream had started: just end it
                return
            self._json(500, ApiError(f"Internal error: {e}", status=500, kind="server_error").body())

    def _body(self):
        try:
            n = int(self.headers.get("Content-Length") or 0)
            return json.loads(self.rfile.read(n) or b"null")
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(f"The request body is not valid JSON: {e}") from None

    def _json(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _answer(self, req: Request) -> None:
        s, out = self.served, Outcome()
        rid = ("chatcmpl-" if req.chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        pieces = generate(s, req, out)
        try:
            first = next(pieces, "")  # errors before any output are still 4xx answers
            if not req.stream:
                text = first
                for piece in pieces:
                    if self._gone():
                        log.info("%s: the client went away", rid)
                        return
                    text += piece
                self._json(200, _completion(s, req, rid, created, text, out))
            else:
                self._sse(_chunks(s, req, rid, created, itertools.chain([first], pieces), out))
        finally:
            pieces.close()  # a disconnected client stops its generation
        log.info("%s: %d+%d tokens, %s, cached %d, tau %.2f", rid, len(req.ids),
                 _usage(req, out)["completion_tokens"], out.finish, out.cached, _stats(out)["mean_accepted"])

    def _gone(self) -> bool:
        """Whether the client closed its connection (it sends nothing more)."""
        try:
            ready = select.select([self.connection], [], [], 0)[0]
            return bool(ready) and not self.connection.recv(1, socket.MSG_PEEK)
        except OSError:
            return True

    def _sse(self, chunks) -> None:
        """Send ``chunks`` as server-sent events, each as soon as it is made."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        self.close_connection = self.streaming = True
        for chunk in chunks:
            self._event(chunk)
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def _event(self, obj: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        self.wfile.flush()


def make_server(served: Served, host: str = "127.0.0.1", port: int = 8080) -> ThreadingHTTPServer:
    """An HTTP server for ``served`` (call ``serve_forever``; port 0 picks a free one)."""
    handler = type("BoundHandler", (Handler,), {"served": served})
    # A backlog of 5 (the default) makes a burst of clients wait on TCP retries.
    server = type("Server", (ThreadingHTTPServer,), {"request_queue_size": 128})((host, port), handler)
    server.daemon_threads = True
    return server


# ---------------------------------------------------------------- command line

def build_parser() -> argparse.ArgumentParser:
    from ..generate import DEFAULT_MODEL, add_pipeline_arg, block_size_arg

    p = argparse.ArgumentParser(prog="python -m dflash_mlx.server",
                                description="OpenAI-compatible HTTP server with DFlash speculative decoding.")
    p.add_argument("--model", default=DEFAULT_MODEL, help="Target (default: smollm2, with its embedded draft).")
    p.add_argument("--draft", help="DFlash draft (default: the published draft for --model).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--temp", type=float, default=0.0, help="Default sampling temperature.")
    p.add_argument("--top-p", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--max-tokens", type=int, default=512, help="Default max_tokens of a request.")
    p.add_argument("--block-size", type=block_size_arg, default="auto")
    p.add_argument("--draft-bits", type=int, choices=(4, 8), default=None,
                   help="Quantize the draft's linear layers to this many bits at load.")
    add_pipeline_arg(p)
    p.add_argument("--chat-template-args", type=json.loads, default={},
                   help='JSON object passed to the chat template, e.g. \'{"enable_thinking": false}\'.')
    p.add_argument("--prompt-cache-size", type=int, default=4, help="Conversations whose cache is kept.")
    p.add_argument("--prompt-cache-bytes", type=parse_size, default=None,
                   help="The most memory those caches may hold, e.g. 2GB (default: no bound).")
    p.add_argument("--decode-concurrency", type=int, default=4,
                   help="Requests decoded together in one batch (1: one at a time).")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(message)s")
    exit_now(run_command(lambda: _run(args)))  # never returns: see exit_now


def _run(args) -> int:
    from ..models.distributed import group, rank, share
    from ..generate import _resolve
    from ..models.loading import load, load_draft

    if not isinstance(args.chat_template_args, dict):
        raise ValueError("--chat-template-args must be a JSON object.")
    model_path, draft_path = _resolve(args)
    model, tokenizer = load(model_path, pipeline=args.pipeline)
    draft = None if args.block_size == 1 else load_draft(draft_path, bits=args.draft_bits)
    served = Served(model, draft, tokenizer, args.model, args.block_size, args.temp, args.top_p, args.top_k,
                    args.min_p, args.max_tokens, args.chat_template_args, args.prompt_cache_size,
                    args.decode_concurrency, args.prompt_cache_bytes)
    if rank() != 0:  # a follower: no HTTP, it runs what rank 0 shares
        follow(served)
        return 0
    server = make_server(served, args.host, args.port)
    log.info("Serving %s on http://%s:%d/v1", args.model, args.host, server.server_address[1])
    try:
        server.serve_forever()
    finally:
        server.server_close()
        if group() is not None:
            served.scheduler.call(lambda: share(None))  # the followers stop
    return 0
