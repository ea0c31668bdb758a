"""`python -m dflash_mlx.chat`: a multi-turn chat in the terminal, with DFlash.

Each reply is streamed, then its speed and mean acceptance length are shown.
The target's cache is kept between turns, so a turn only prefills its new
tokens. Commands: ``/reset`` forgets the conversation, ``/quit`` (or end of
input) leaves.
"""

import argparse
import sys
from typing import List, Optional

from .errors import exit_now, run_command


def build_parser() -> argparse.ArgumentParser:
    from .generate import DEFAULT_MODEL, block_size_arg

    p = argparse.ArgumentParser(prog="python -m dflash_mlx.chat", description="Chat with a model, using DFlash.")
    p.add_argument("--model", default=DEFAULT_MODEL, help="Target (default: smollm2, with its embedded draft).")
    p.add_argument("--draft", help="DFlash draft (default: the published draft for --model).")
    p.add_argument("--system", help="A system message.")
    p.add_argument("--max-tokens", "-m", type=int, default=512, help="The most tokens of one reply.")
    p.add_argument("--temp", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--block-size", type=block_size_arg, default="auto")
    p.add_argument("--fresh", action="store_true",
                   help="Start auto afresh: do not read or keep what earlier runs with this target and draft learnt.")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    exit_now(run_command(lambda: _run(args)))  # never returns: see exit_now


def _run(args) -> int:
    from .engine import saved
    from .generate import _resolve, _settings
    from .models.loading import load, load_draft
    from .serve.server import ApiError, Served, parse_request

    model_path, draft_path = _resolve(args)
    model, tokenizer = load(model_path)
    draft = None if args.block_size == 1 else load_draft(draft_path)
    served = Served(model, draft, tokenizer, args.model, args.block_size, args.temp, args.top_p,
                    args.top_k, args.min_p, args.max_tokens, prompt_cache_size=1, concurrency=1)
    key = saved.start(draft, model_path, draft_path, args.block_size, args.fresh, **_settings(args), bits=None)
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    print("Type a message; /reset starts over, /quit leaves.", flush=True)
    while True:
        print(">> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/quit":
            return 0
        text = line.strip()
        if text == "/reset":
            messages = list(start)
            served.cache.clear()
            print("(conversation reset)", flush=True)
            continue
        if not text:
            continue
        messages.append({"role": "user", "content": text})
        try:
            req = parse_request(served, {"messages": messages, "seed": args.seed}, chat=True)
        except ApiError as e:
            messages.pop()
            print(f"error: {e}", flush=True)
            continue
        messages.append({"role": "assistant", "content": _reply(served, req)})
        saved.keep(draft, key)


def _reply(served, req) -> str:
    """Stream one reply and print its statistics; return its text."""
    from .serve.server import Outcome, generate

    out, reply = Outcome(), ""
    for piece in generate(served, req, out):
        print(piece, end="", flush=True)
        reply += piece
    r = out.last
    print(f"\n[{r.generation_tokens} tokens, {r.generation_tps:.1f} tok/s, "
          f"{r.mean_accepted:.2f} tokens per round, {out.cached} prompt tokens cached]", flush=True)
    return reply


if __name__ == "__main__":
    from .blas import preload

    preload("dflash_mlx.chat", sys.argv[1:])
    main()
