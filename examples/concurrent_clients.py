"""Aggregate tok/s of N clients at once against the same N one after another,
on one `python -m dflash_mlx.server` (default pair) that this script starts.

    python examples/concurrent_clients.py [--clients 4] [--max-tokens 96] [--block-size auto]
        [--decode-concurrency N (default: --clients; 1 serves one request at a time)]
"""

import argparse
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
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--block-size", default="auto")
    p.add_argument("--decode-concurrency", type=int, default=None)
    p.add_argument("--port", type=int, default=8091)
    args = p.parse_args()
    width = args.decode_concurrency or args.clients
    with served(args.port, "--prompt-cache-size", "0", "--block-size", args.block_size,
                "--decode-concurrency", str(width)) as client:
        questions = (QUESTIONS * args.clients)[: args.clients]

        def ask(q):
            r = client.chat.completions.create(model="default", messages=[{"role": "user", "content": q}],
                                               max_tokens=args.max_tokens, temperature=0)
            return r.choices[0].message.content, r.usage.completion_tokens

        ask("Hello")  # warm-up: loading, the cost calibration
        tic = time.perf_counter()
        serial = [ask(q) for q in questions]
        t_serial = time.perf_counter() - tic
        together = [None] * len(questions)

        def run(i):
            together[i] = ask(questions[i])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(questions))]
        tic = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        t_together = time.perf_counter() - tic
        n_serial = sum(n for _, n in serial)
        n_together = sum(n for _, n in together)
        print(f"{args.clients} clients, {args.max_tokens} tokens each, block size {args.block_size}, "
              f"decode concurrency {width}:")
        print(f"  one after another: {n_serial} tokens in {t_serial:.1f} s = {n_serial / t_serial:.1f} tok/s")
        print(f"  all at once:       {n_together} tokens in {t_together:.1f} s = {n_together / t_together:.1f} tok/s")
        print(f"  speed-up {n_together / t_together / (n_serial / t_serial):.2f}x, "
              f"identical texts: {'yes' if [s for s, _ in serial] == [s for s, _ in together] else 'NO'}")


if __name__ == "__main__":
    main()
