"""`python -m dflash_mlx.server`: an OpenAI-compatible HTTP server for DFlash.

Endpoints: ``GET /v1/models``, ``GET /health``, ``POST /v1/completions`` and
``POST /v1/chat/completions`` (also without ``/v1``), as JSON or as server-sent
events (``stream: true``). Every answer is produced by :func:`stream_generate`,
so it is exactly the target's own output. Besides the OpenAI fields a response
carries ``"dflash": {"mean_accepted", "rounds", "generation_tps", "prompt_tps"}``.
``logprobs`` (and chat's ``top_logprobs``) report the target's own
log-probabilities, in OpenAI's shapes. That wire format (request bodies
checked into parameters, answer bodies and stream chunks) is :mod:`.wire`.

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
import functools
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

from ..engine import saved
from ..engine.decoding import DraftCache
from ..models.distributed import group
from ..errors import DFlashError, exit_now, run_command
from . import wire
from .scheduler import Scheduler
from .wire import ApiError, Request, parse_request
from ..engine.target import Target, model_args

log = logging.getLogger("dflash_mlx.server")


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


class Served:
    """The loaded pair, the server's defaults and its shared state."""

    def __init__(self, model, draft, tokenizer, model_id, block_size="auto", temp=0.0, top_p=0.0,
                 top_k=0, min_p=0.0, max_tokens=512, chat_template_args=None, prompt_cache_size=4,
                 concurrency=4, prompt_cache_bytes=None, idle=None):
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
        self.scheduler = Scheduler(model, draft, tokenizer, block_size, concurrency, sticky=group() is not None,
                                   idle=idle)


def _context_length(model) -> Optional[int]:
    n = model_args(model).get("max_position_embeddings")
    return n if isinstance(n, int) else None


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
            return self._json(200, wire.model_list(self.served))
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
                self._json(200, wire.completion(s, req, rid, created, text, out))
            else:
                self._sse(wire.chunks(s, req, rid, created, itertools.chain([first], pieces), out))
        finally:
            pieces.close()  # a disconnected client stops its generation
        log.info("%s: %d+%d tokens, %s, cached %d, tau %.2f", rid, len(req.ids),
                 wire.usage(req, out)["completion_tokens"], out.finish, out.cached,
                 wire.stats(out)["mean_accepted"])

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
    p.add_argument("--fresh", action="store_true",
                   help="Start auto afresh: do not read or keep what earlier servers with this target and draft learnt.")
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
    # What auto learnt is kept whenever the server goes idle, so a restart starts from it.
    key = saved.start(draft, model_path, draft_path, args.block_size, args.fresh, server=True,
                      bits=args.draft_bits)
    served = Served(model, draft, tokenizer, args.model, args.block_size, args.temp, args.top_p, args.top_k,
                    args.min_p, args.max_tokens, args.chat_template_args, args.prompt_cache_size,
                    args.decode_concurrency, args.prompt_cache_bytes,
                    idle=functools.partial(saved.keep, draft, key))
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
