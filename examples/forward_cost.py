"""Time one target forward of B requests x L tokens against B separate ones.

    python examples/forward_cost.py [--model smollm2] [--context 256]

What batching several requests' verify blocks (or plain steps) into one
forward would save on this machine: cost in plain decode steps, per request,
and batched / serial. Numbers are medians of a few repetitions.
"""

import argparse
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from dflash_mlx import load


def cost(model, batch: int, length: int, context: int, reps: int = 12) -> float:
    """Median seconds of a forward of [batch, length] tokens after ``context`` cached ones."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.random.randint(0, 1000, (batch, context)), cache=cache))
    y = mx.random.randint(0, 1000, (batch, length))
    times = []
    for i in range(reps + 3):
        tic = time.perf_counter()
        mx.eval(model(y, cache=cache))
        if i >= 3:  # warm-up
            times.append(time.perf_counter() - tic)
        for c in cache:
            c.trim(length)
    return sorted(times)[len(times) // 2]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--context", type=int, default=256)
    args = p.parse_args()
    model, _ = load(args.model)
    step = cost(model, 1, 1, args.context)
    print(f"context {args.context}: 1 decode step = {step * 1e3:.1f} ms")
    for b, n in [(4, 1), (1, 8), (4, 8), (1, 16), (2, 16), (4, 16)]:
        c, one = cost(model, b, n, args.context), cost(model, 1, n, args.context)
        print(f"[{b}, {n:2d}]: {c * 1e3:7.1f} ms = {c / step:5.2f} steps, per request {c / b / step:5.2f}; "
              f"batched / serial = {c / (b * one):.2f}")


if __name__ == "__main__":
    main()
