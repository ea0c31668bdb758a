"""The server's OpenAI wire format: a request body checked and turned into a
:class:`Request`, and the JSON bodies, stream chunks and error bodies of the
answers. The HTTP handling and the generations are in :mod:`.server`."""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, List, Optional

if TYPE_CHECKING:  # hints only: the server imports this module
    from .server import Outcome, Served


class ApiError(Exception):
    """A request the server refuses, with its HTTP status and OpenAI error fields."""

    def __init__(self, message, param=None, status=400, code=None, kind="invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


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


def parse_request(served: "Served", body, chat: bool) -> Request:
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


def _prompt_ids(served: "Served", prompt) -> List[int]:
    from ..engine.checks import prompt_ids as encode

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


def _chat_ids(served: "Served", body) -> List[int]:
    from ..engine.checks import prompt_ids as encode

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


# ---------------------------------------------------------------- answers

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


def usage(req: Request, out: "Outcome") -> dict:
    n = out.last.generation_tokens if out.last is not None else 0
    return {"prompt_tokens": len(req.ids), "completion_tokens": n, "total_tokens": len(req.ids) + n,
            "prompt_tokens_details": {"cached_tokens": out.cached}}


def stats(out: "Outcome") -> dict:
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


def model_list(served: "Served") -> dict:
    """The body of ``GET /v1/models``: the one model served."""
    return {"object": "list", "data": [
        {"id": served.model_id, "object": "model", "created": served.created, "owned_by": "dflash_mlx"}]}


def _envelope(served: "Served", req: Request, rid: str, created: int, chunk=False) -> dict:
    kind = ("chat.completion" if req.chat else "text_completion") + (".chunk" if chunk and req.chat else "")
    return {"id": rid, "object": kind, "created": created, "model": served.model_id}


def completion(served: "Served", req: Request, rid: str, created: int, text: str, out: "Outcome") -> dict:
    """The whole answer, as one JSON body."""
    choice = _choice(req, text, out.finish, records=out.sent_logprobs())
    return dict(_envelope(served, req, rid, created), choices=[choice], usage=usage(req, out), dflash=stats(out))


def chunks(served: "Served", req: Request, rid: str, created: int, pieces, out: "Outcome"):
    """The answer as stream chunks, one per piece of text as it comes (made
    lazily: each piece's log-probabilities are taken when its chunk is)."""
    base = _envelope(served, req, rid, created, chunk=True)
    if req.chat:
        yield dict(base, choices=[_choice(req, "", None, True, True)])
    for piece in pieces:
        if piece:
            yield dict(base, choices=[_choice(req, piece, None, True, records=out.sent_logprobs())])
    yield dict(base, choices=[_choice(req, "", out.finish, True, records=out.sent_logprobs())],
               dflash=stats(out))
    if req.include_usage:
        yield dict(base, choices=[], usage=usage(req, out))
