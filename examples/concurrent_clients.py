"""What one `python -m dflash_mlx.server` (default pair) holds under load: this
script starts it, sends the same chat questions one after another, then from
N clients at once (each streams, so the time to its first token is seen), and
prints requests per second, aggregate tokens per second, time to first token,
whether the texts were identical and how many requests failed.

    python examples/concurrent_clients.py [--clients 4] [--requests 16] [--max-tokens 64]
        [--block-size auto] [--decode-concurrency N (default: --clients)]
"""

import argparse
import statistics
import threading
import time

from served import served

QUESTIONS = [
    "What is the capital of France? Answer in two sentences.",
    "Write a Python function that reverses a string.",
    "Give me three tips for sleeping better.",
    "Explain what a prime number is to a child.",
    "How do I boil an egg?",
    "Name the planets of the solar system.",
    "What is 17 times 23? Show the steps.",
    "Write a haiku about autumn.",
]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--requests", type=int, default=16, help="Requests in all, shared by the clients.")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--block-size", default="auto")
    p.add_argument("--decode-concurrency", type=int, default=None)
    p.add_argument("--port", type=int, default=8091)
    args = p.parse_args()
    width = args.decode_concurrency or args.clients
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.requests)]
    with served(args.port, "--prompt-cache-size", "0", "--block-size", args.block_size,
                "--decode-concurrency", str(width)) as client:

        def ask(q):
            """(text, tokens, seconds to the first token, seconds in all), or an exception."""
            tic, first, text, n = time.perf_counter(), None, "", 0
            try:
                stream = client.chat.completions.create(
                    model="default", messages=[{"role": "user", "content": q}], max_tokens=args.max_tokens,
                    temperature=0, stream=True, stream_options={"include_usage": True})
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        first = first or time.perf_counter() - tic
                        text += chunk.choices[0].delta.content
                    if chunk.usage:
                        n = chunk.usage.completion_tokens
            except Exception as e:
                return e
            return text, n, first or 0.0, time.perf_counter() - tic

        ask("Hello")  # warm-up: loading, the cost calibration
        tic = time.perf_counter()
        serial = [ask(q) for q in questions]
        t_serial = time.perf_counter() - tic

        together, queue, lock = [None] * len(questions), list(range(len(questions))), threading.Lock()

        def client_loop():
            while True:
                with lock:
                    if not queue:
                        return
                    i = queue.pop(0)
                together[i] = ask(questions[i])

        threads = [threading.Thread(target=client_loop) for _ in range(args.clients)]
        tic = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        t_together = time.perf_counter() - tic

    print(f"{len(questions)} requests of up to {args.max_tokens} tokens, block size {args.block_size}, "
          f"decode concurrency {width}:")
    for name, runs, took in (("one after another", serial, t_serial),
                             (f"{args.clients} clients at once", together, t_together)):
        ok = [r for r in runs if not isinstance(r, Exception)]
        tokens = sum(r[1] for r in ok)
        ttft = sorted(r[2] for r in ok)
        print(f"  {name}: {len(ok) / took:.2f} requests/s, {tokens / took:.1f} tok/s, "
              f"time to first token median {statistics.median(ttft):.2f} s, worst {ttft[-1]:.2f} s, "
              f"failed {len(runs) - len(ok)}")
    same = [r[0] for r in serial if not isinstance(r, Exception)] == \
        [r[0] for r in together if not isinstance(r, Exception)]
    print(f"  identical texts: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
