"""How well `block_size="auto"` chooses, judged without this machine's noise.

    python examples/auto_modelled.py [--pair demo|smollm2] [--noise X | --random]
        [--pace flat|phases|jitter|both] [--prompts 8] [--tokens 128] [--seed 0]
        [--seeds 1] [--draft PATH --draft-ms MS] [--trace FILE]

The real target and draft run (so the acceptance is real), but the loop's
clock is a modelled one: a target forward of L tokens and a draft pass cost
what they cost on this machine (fit to fixed-block runs; see COSTS). What the
policy sees is that cost times a pace: flat, two-speed phases (1x and 2x,
alternating every 0.5 s of modelled time), a random jitter per call, or both,
as this machine swings. What is reported is tokens per unpaced cost, so `auto`
is judged against plain steps and every fixed block by its choices alone:
one run gives the same numbers as the next. It also prints what the best
fixed choice for each prompt would make: how much choosing per prompt can
gain over the best fixed block, at most.

``--draft`` takes another draft for the pair's target (a draft pass then
costs ``--draft-ms``). ``--noise X`` adds X standard deviations of Gaussian
noise to the draft's weights (a weaker draft); ``--random`` replaces them (a
useless draft).
`auto` runs the prompts twice (what it learnt carries over) and counts the
second time; the first time through (a fresh policy learning, as in a one-shot
generation) is reported apart. Its choices feed back on what it learns, so a small change to
the policy (or another ``--seed``: the jitter, and the prompts' order if not
0) can take another path: one seed is one path (on the toy pairs auto / best
moved 0.82-1.00 with the prompts' order alone); judge over ``--seeds``.
"""

import argparse
import json
import math
import random
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_map

from dflash_mlx import load, load_draft, stream_generate
from dflash_mlx.errors import DFlashError
from dflash_mlx.engine import decoding, policy
from dflash_mlx.engine.draft import DFlashDraft
from dflash_mlx.engine.target import Target

PKG = Path(__file__).resolve().parents[1] / "dflash_mlx"
# ms: a plain step, a draft pass, and a forward of L tokens in plain steps.
COSTS = {
    "demo": (5.5, 4.4, lambda L: 1 + 0.05 * (L - 1)),
    "smollm2": (80.0, 20.0, lambda L: 1 + 0.225 * math.log2(L)),  # 1.2 at 2, 1.45 at 4, 1.9 at 16
}


def pair(name: str, noise: float, rand: bool, other: str = None):
    if name == "smollm2":
        model, tok = load("smollm2")
        draft = load_draft(other or str(PKG / "smollm2/draft"))
        lines = (PKG / "smollm2/heldout.jsonl").read_text().splitlines()
        prompts = [
            tok.apply_chat_template([{"role": "user", "content": json.loads(l)["prompt"]}],
                                    add_generation_prompt=True, tokenize=False)
            for l in lines
        ]
    else:
        model, tok = load(str(PKG / "demo/target"))
        draft = load_draft(other or str(PKG / "demo/draft"))
        prompts = [json.loads(l)["prompt"] for l in (PKG / "demo/prompts.jsonl").read_text().splitlines()]
    mx.random.seed(1)
    if rand:
        draft.update(tree_map(lambda p: mx.random.normal(p.shape).astype(p.dtype) * 0.02 if p.ndim > 1 else p, draft.parameters()))
    elif noise:
        draft.update(tree_map(
            lambda p: p + mx.random.normal(p.shape).astype(p.dtype) * noise * mx.std(p) if p.ndim > 1 else p,
            draft.parameters()))
    return model, tok, draft, prompts


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", choices=sorted(COSTS), default="demo")
    ap.add_argument("--noise", type=float, default=0.0)
    ap.add_argument("--random", action="store_true")
    ap.add_argument("--pace", choices=("flat", "phases", "jitter", "both"), default="both")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", type=int, default=1,
                    help="Judge auto over this many seeds from --seed (the fixed blocks run once: "
                         "what they cost depends on neither the order nor the pace).")
    ap.add_argument("--draft", help="Another draft for the pair's target.")
    ap.add_argument("--draft-ms", type=float, help="What its pass costs (default: the pair's draft's).")
    ap.add_argument("--trace", type=argparse.FileType("w"),
                    help="Write each counted round of auto as a JSON line: seed, prompt, the length "
                         "chosen, each length's expected tokens and tokens per second then, and the "
                         "probes' budget (lost_ms, spent_ms).")
    args = ap.parse_args()
    if args.draft_ms is not None and args.draft_ms <= 0:
        ap.error(f"--draft-ms must be positive, got {args.draft_ms}")
    if args.seeds < 1:
        ap.error(f"--seeds must be at least 1, got {args.seeds}")
    model, tok, draft, prompts = pair(args.pair, args.noise, args.random, args.draft)
    prompts = prompts[: args.prompts]
    step, draft_pass, verify = COSTS[args.pair]
    draft_pass = args.draft_ms or draft_pass

    rng = [random.Random(args.seed)]  # the pace's jitter
    seen, true = [0.0], [0.0]  # seconds the policy sees; unpaced seconds

    def spend(ms: float) -> None:
        f = 2.0 if args.pace in ("phases", "both") and int(seen[0] / 0.5) % 2 else 1.0
        if args.pace in ("jitter", "both"):
            f *= math.exp(rng[0].gauss(0, 0.25))
        seen[0] += ms * f / 1e3
        true[0] += ms / 1e3

    forward, propose, clock = Target.forward, DFlashDraft.propose, policy.clock

    def timed_forward(self, tokens, *a, **k):
        spend(step * verify(tokens.shape[-1]))
        return forward(self, tokens, *a, **k)

    def timed_propose(self, *a, **k):
        spend(draft_pass)
        return propose(self, *a, **k)

    choose, where = policy.Policy.choose, [None]  # (seed, prompt) of a counted run of auto

    def traced_choose(self, limit=None, width=1):
        n = choose(self, limit, width)
        if where[0]:
            est = {m: (self.tokens(m), self.seconds(m, width)) for m in self.lengths}
            args.trace.write(json.dumps({
                "seed": where[0][0], "prompt": where[0][1], "length": n,
                "tokens": {m: round(t, 3) for m, (t, _) in est.items()},
                "per_s": {m: s and round(t / s, 1) for m, (t, s) in est.items()},
                # the probes' budget: what the rounds lost, their decaying ms
                "lost_ms": round(self.lost * 1e3, 2), "spent_ms": round(self.spent * 1e3, 1)}) + "\n")
        return n

    Target.forward, DFlashDraft.propose, policy.clock = timed_forward, timed_propose, lambda: seen[0]
    decoding.PIPELINE = False  # each plain step charged in its own round, as computed there
    if args.trace:
        policy.Policy.choose = traced_choose
    try:
        def rate(bs, order, counts, seed=None, each=None):
            made, cost = 0, 0.0
            for p in order:
                where[0] = None if seed is None else (seed, prompts.index(p))
                start = None
                for r in stream_generate(model, draft if bs != 1 else None, tok, p, block_size=bs,
                                         max_tokens=args.tokens):
                    if start is None:  # from the first token on
                        start, first = true[0], r.generation_tokens
                    else:
                        counts[r.verified] = counts.get(r.verified, 0) + 1
                made, cost = made + r.generation_tokens - first, cost + true[0] - start
                if each is not None:
                    each[p] = true[0] - start
            return made / cost

        each = {}  # bs -> prompt -> seconds (the same tokens at every bs)
        rates = {bs: rate(bs, prompts, {}, each=each.setdefault(bs, {}))
                 for bs in [1] + [b for b in (2, 4, 8, 16, 32) if b <= draft.block_size]}
        autos = []
        for seed in range(args.seed, args.seed + args.seeds):
            order = list(prompts)
            if seed:
                random.Random(seed).shuffle(order)
            rng[0], rounds = random.Random(seed), {}
            policy.Policy.forget(draft)
            first = rate("auto", order, {})  # learns the draft
            autos.append((seed, rate("auto", order, rounds, seed), rounds, first))
    finally:
        Target.forward, DFlashDraft.propose, policy.clock = forward, propose, clock
        decoding.PIPELINE = True
        policy.Policy.choose = choose
    best = max(rates.values())
    name = f"{args.pair}{' + ' + args.draft if args.draft else ''} noise={args.noise} random={args.random} pace={args.pace}"
    print(f"{name}: against plain steps: " + " ".join(f"{k}={v / rates[1]:.3f}" for k, v in rates.items()))
    # What choosing per prompt could gain at most (the same tokens, each prompt at its best fixed choice).
    picks = [min(each, key=lambda bs: each[bs][p]) for p in prompts]
    oracle = sum(each[1].values()) * rates[1] / sum(each[bs][p] for bs, p in zip(picks, prompts))
    print(f"{name}: the best fixed choice per prompt ({' '.join(map(str, picks))}) makes {oracle / best:.3f} of best")
    for seed, auto, rounds, _ in autos:
        print(f"{name} seed={seed}: auto / best = {auto / best:.3f} (auto={auto / rates[1]:.3f} of plain steps); "
              f"its rounds by tokens verified: {dict(sorted(rounds.items()))}")
    if len(autos) > 1:
        got = [a / best for _, a, _, _ in autos]
        print(f"{name}: auto / best over {len(got)} seeds: mean {sum(got) / len(got):.3f}, min {min(got):.3f}")
    got = [f / best for _, _, _, f in autos]  # what a fresh policy makes, learning (one-shot generations)
    print(f"{name}: first time through, auto / best over {len(got)} seeds: mean {sum(got) / len(got):.3f}, "
          f"min {min(got):.3f}")


if __name__ == "__main__":
    try:
        main()
    except DFlashError as e:  # e.g. a --draft that is not a draft for this target
        raise SystemExit(f"error: {e}")
