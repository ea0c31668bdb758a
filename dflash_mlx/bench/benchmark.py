"""`python -m dflash_mlx.benchmark`: DFlash against plain mlx-lm decoding.

For every prompt, after a short warm-up, plain ``mlx_lm.stream_generate`` and
DFlash ``stream_generate`` (and, with ``--baseline-draft-model``, mlx-lm's own
speculative decoding) run on the same token ids, in an order that changes
from one prompt to the next (see :func:`order`). Each temperature of
``--temp`` (default 0 and 0.7) is a full pass over the prompts; sampled
passes are seeded (``--seed``, default 0) so they repeat exactly
(``--seed none``: DFlash samples unseeded, from MLX's
generator seeded alike). At temperature 0 the outputs must be token-identical;
any difference is a failure (exit code 3).

Reported per prompt and in aggregate: decode tok/s (prefill excluded, from
the first generated token to the last), end-to-end tok/s (prefill included),
speedup, tau (mean tokens committed per DFlash round), the acceptance-length
histogram, peak memory, and the mean round split into draft forward, verify
forward, acceptance + rollback and the rest. The split comes from a profiled
DFlash run (``profile=True`` synchronises after each phase): by default a
separate run after the measured ones, so the measured speed is not slowed by
the extra synchronisation. Draft and verify costs are also given in plain
decode steps (1 step = 1 / plain decode tok/s), with the ideal speedup
tau / (c_draft + c_verify) next to the measured one. Decode speeds, speedup
and tau are also pooled per prompt category (the ``category`` of a JSONL row).

    python -m dflash_mlx.benchmark                      # smollm2 + its draft, held-out set
    python -m dflash_mlx.benchmark --model dflash_mlx/demo/target \
        --draft dflash_mlx/demo/draft --dataset demo --temp 0
    python -m dflash_mlx.benchmark --model Qwen/Qwen3-4B --dataset gsm8k \\
        --max-samples 10 --max-tokens 256 --out results.json \\
        --baseline-draft-model Qwen/Qwen3-0.6B
"""

import argparse
import datetime
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Union

from ..errors import run_command
from .report import PHASES, Progress, fmt, format_summary, ratio, write_chart

DEMO = Path(__file__).parent.parent / "demo"
DEFAULT_MODEL = "smollm2"
MISMATCH_EXIT = 3


class BenchmarkError(ValueError):
    """Bad benchmark input."""


@dataclass
class Run:
    """One timed generation.

    Args:
        tokens: Generated ids (a final EOS included, as mlx-lm reports it).
        prompt_tokens: Prompt length.
        prefill_s: Seconds from the call to the first generated token.
        decode_s: Seconds from the first generated token to the last.
        peak_memory: Peak MLX memory of the run, in GB.
        finish_reason: "stop" or "length".
        text: The generated text.
        accepted: DFlash: tokens committed per round (bonus included).
        phases: DFlash, profiled runs only: per round seconds of each phase.
    """

    tokens: List[int]
    prompt_tokens: int
    prefill_s: float
    decode_s: float
    peak_memory: float
    finish_reason: Optional[str]
    text: str = ""
    accepted: List[int] = field(default_factory=list)
    phases: List[Dict[str, float]] = field(default_factory=list)

    @property
    def decode_tokens(self) -> int:
        """Tokens made by decoding (all but the prefill's first)."""
        return max(len(self.tokens) - 1, 0)

    @property
    def decode_tps(self) -> Optional[float]:
        return self.decode_tokens / self.decode_s if self.decode_tokens and self.decode_s > 0 else None

    @property
    def e2e_tps(self) -> float:
        return len(self.tokens) / max(self.prefill_s + self.decode_s, 1e-9)

    @property
    def tau(self) -> Optional[float]:
        return sum(self.accepted) / len(self.accepted) if self.accepted else None

    def to_dict(self) -> dict:
        d = dict(
            generated_tokens=len(self.tokens),
            prompt_tokens=self.prompt_tokens,
            prefill_s=self.prefill_s,
            decode_s=self.decode_s,
            prompt_tps=self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else None,
            decode_tps=self.decode_tps,
            e2e_tps=self.e2e_tps,
            peak_memory_gb=self.peak_memory,
            finish_reason=self.finish_reason,
        )
        if self.accepted:
            d.update(rounds=len(self.accepted), tau=self.tau)
        return d


@dataclass
class Settings:
    """What every run of one benchmark shares."""

    max_tokens: int
    temp: float
    block_size: Optional[int]
    seed: Optional[int]
    num_draft_tokens: int
    processors: Optional[list] = None
    perturb: Optional[list] = None
    keyed: bool = True  # DFlash gets the seed (else MLX's generator, seeded alike)


@dataclass
class Column:
    """One DFlash configuration of a side-by-side run. ``key`` names it in
    the run dicts: "dflash" for the main column, "dflash@<label>" for each
    other one, which differs from the main column in one option."""

    key: str
    label: str
    block: Union[int, str]
    draft: object
    options: Dict = field(default_factory=dict)  # accept_threshold, denoise_steps, proposal

    @property
    def exact(self) -> bool:
        """Whether the output must equal the target's (no relaxed acceptance)."""
        return self.options.get("accept_threshold") is None


@dataclass
class Models:
    """The loaded target, tokenizer, DFlash draft and optional baseline draft."""

    model: object
    tokenizer: object
    draft: object
    baseline: object = None
    demo: bool = False
    paths: Dict[str, Optional[str]] = field(default_factory=dict)


# ---------------------------------------------------------------- running


def _drive(responses, ids_of: Callable, n_prompt: int) -> tuple:
    """Consume a response stream into a Run; also return each response's
    arrival time and its (rounds, accepted, timing)."""
    tic = time.perf_counter()
    stamps, tokens, text, items, last = [], [], [], [], None
    for r in responses:
        stamps.append(time.perf_counter())
        tokens.extend(ids_of(r))
        text.append(r.text)
        items.append((getattr(r, "rounds", 0), getattr(r, "accepted", 0), getattr(r, "timing", None)))
        last = r
    run = Run(
        tokens=tokens,
        prompt_tokens=n_prompt,
        prefill_s=stamps[0] - tic,
        decode_s=stamps[-1] - stamps[0],
        peak_memory=last.peak_memory,
        finish_reason=last.finish_reason,
        text="".join(text),
    )
    return run, stamps, items


def run_mlx(models: Models, ids: List[int], s: Settings, max_tokens=None, speculative=False) -> Run:
    """Plain ``mlx_lm.stream_generate`` (or with ``speculative``, mlx-lm's
    speculative decoding with the baseline draft model)."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    if s.seed is not None:
        mx.random.seed(s.seed)
    extra = dict(draft_model=models.baseline, num_draft_tokens=s.num_draft_tokens) if speculative else {}
    mx.reset_peak_memory()
    gen = mlx_lm.stream_generate(
        models.model, models.tokenizer, mx.array(ids),
        max_tokens=max_tokens or s.max_tokens,
        sampler=make_sampler(temp=s.temp),
        logits_processors=s.processors,
        **extra,
    )
    return _drive(gen, lambda r: [r.token], len(ids))[0]


def run_dflash(models: Models, ids: List[int], s: Settings, max_tokens=None, profile=False,
               col: Optional[Column] = None) -> Run:
    """DFlash ``stream_generate`` (as ``col`` says, by default the main draft
    at ``s.block_size``); with ``profile`` also the per-round phases."""
    import mlx.core as mx

    from ..engine.decoding import stream_generate

    procs = (s.processors or []) + (s.perturb or []) or None
    if s.seed is not None:
        mx.random.seed(s.seed)
    mx.reset_peak_memory()
    gen = stream_generate(
        models.model, col.draft if col else models.draft, models.tokenizer, ids,
        block_size=col.block if col else s.block_size, max_tokens=max_tokens or s.max_tokens,
        temperature=s.temp, seed=s.seed if s.keyed else None, logits_processors=procs, profile=profile,
        **(col.options if col else {}),
    )
    run, stamps, items = _drive(gen, lambda r: r.tokens, len(ids))
    for i, (rounds, acc, timing) in enumerate(items):
        if not rounds:  # the prefill's first token is not a round
            continue
        run.accepted.append(acc)
        if timing:
            split = {k: timing.get(k, 0.0) for k in PHASES[:3]}
            split["other"] = max(stamps[i] - stamps[i - 1] - sum(split.values()), 0.0)
            run.phases.append(split)
    return run


def first_difference(a: List[int], b: List[int]) -> Optional[int]:
    """Index of the first differing token (length included), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# -------------------------------------------------------------- statistics


def histogram(accepted: List[int], size: int) -> List[int]:
    """Counts of acceptance lengths 1..size (index 0 is length 1)."""
    h = [0] * max(size, max(accepted, default=1))
    for a in accepted:
        h[a - 1] += 1
    return h


def round_split(phases: List[Dict[str, float]]) -> Optional[Dict[str, float]]:
    """Mean seconds per round of each phase, and of the whole round."""
    if not phases:
        return None
    m = {k: sum(p[k] for p in phases) / len(phases) for k in PHASES}
    m["round"] = sum(m.values())
    return m


def cost_model(tau, split, step) -> dict:
    """Phase costs in plain decode steps and the ideal speedup
    tau / (c_draft + c_verify)."""
    if not split or not step or not tau:
        return {"costs": None, "ideal_speedup": None}
    costs = {k: split[k] / step for k in PHASES}
    denom = costs["draft"] + costs["verify"]
    return {"costs": costs, "ideal_speedup": tau / denom if denom > 0 else None}


def prompt_result(
    pid: str, runs: Dict[str, Run], prof: Optional[Run], block: int, exact: bool, category=None,
    profs: Optional[Dict[str, Run]] = None, cols: Optional[List[Column]] = None,
) -> dict:
    """The JSON record of one prompt; the token ids too when sampled or when
    the outputs differ. With several DFlash columns, ``columns`` holds each
    one's speedup, tau and identity; ``identical`` covers the exact ones, and
    a relaxed column reports its ``agreement`` (the share of the plain output
    it reproduced before its first difference)."""
    plain, fl = runs["plain"], runs["dflash"]
    cols = cols or [Column("dflash", "", None, None)]
    diff, columns = None, {}
    for c in cols:
        d = first_difference(plain.tokens, runs[c.key].tokens)
        p = (profs or {}).get(c.key)
        columns[c.key] = dict(
            speedup=ratio(runs[c.key].decode_tps, plain.decode_tps), tau=runs[c.key].tau, identical=d is None,
            first_difference=d, round_time_s=round_split(p.phases) if p else None,
        )
        if not c.exact:
            columns[c.key]["agreement"] = (len(plain.tokens) if d is None else d) / max(len(plain.tokens), 1)
        elif diff is None:
            diff = d
    split = round_split(prof.phases) if prof else None
    step = 1 / plain.decode_tps if plain.decode_tps else None
    r = dict(
        id=pid,
        category=category,
        prompt_tokens=plain.prompt_tokens,
        identical=diff is None,
        checked=exact,
        first_difference=diff,
        speedup=ratio(fl.decode_tps, plain.decode_tps),
        e2e_speedup=ratio(fl.e2e_tps, plain.e2e_tps),
        tau=fl.tau,
        acceptance_histogram=histogram(fl.accepted, block),
        round_time_s=split,
        plain_step_s=step,
        **cost_model(fl.tau, split, step),
        runs={k: v.to_dict() for k, v in runs.items()},
        profiled_decode_tps=prof.decode_tps if prof else None,
        output=plain.text,
    )
    if "baseline" in runs:
        b = runs["baseline"]
        bdiff = first_difference(plain.tokens, b.tokens)
        r.update(
            baseline_speedup=ratio(b.decode_tps, plain.decode_tps),
            baseline_identical=bdiff is None,
        )
    if len(columns) > 1:
        r["columns"] = columns
    if diff is not None or not exact:
        r["tokens"] = {"plain": plain.tokens, **{k: runs[k].tokens for k in columns}}
    return r


def _pool(runs: List[Run]) -> dict:
    dec_t = sum(r.decode_tokens for r in runs)
    dec_s = sum(r.decode_s for r in runs if r.decode_tokens)
    tot_t = sum(len(r.tokens) for r in runs)
    tot_s = sum(r.prefill_s + r.decode_s for r in runs)
    d = dict(
        generated_tokens=tot_t,
        decode_tps=dec_t / dec_s if dec_s > 0 else None,
        e2e_tps=tot_t / tot_s if tot_s > 0 else None,
        peak_memory_gb=max(r.peak_memory for r in runs),
    )
    acc = [a for r in runs for a in r.accepted]
    if acc:
        d.update(rounds=len(acc), tau=sum(acc) / len(acc))
    return d


def summarize(records: List[dict], runs: List[Dict[str, Run]], profs: Dict[str, List[Run]], block: int) -> dict:
    """Aggregate over prompts: pooled speeds (total tokens / total time);
    with several DFlash columns, ``columns`` gives each one's speedup, tau,
    round split (and mean agreement, for a relaxed one)."""
    methods = {k: _pool([r[k] for r in runs]) for k in runs[0]}
    plain, fl = methods["plain"], methods["dflash"]
    acc = [a for r in runs for a in r["dflash"].accepted]
    split = round_split([p for r in profs.get("dflash", []) for p in r.phases])
    step = 1 / plain["decode_tps"] if plain["decode_tps"] else None
    speedups = [r["speedup"] for r in records if r["speedup"]]
    s = dict(
        prompts=len(records),
        identical=sum(r["identical"] for r in records),
        speedup=ratio(fl["decode_tps"], plain["decode_tps"]),
        e2e_speedup=ratio(fl["e2e_tps"], plain["e2e_tps"]),
        mean_prompt_speedup=sum(speedups) / len(speedups) if speedups else None,
        tau=fl.get("tau"),
        acceptance_histogram=histogram(acc, block),
        round_time_s=split,
        plain_step_s=step,
        **cost_model(fl.get("tau"), split, step),
        methods=methods,
    )
    if "baseline" in methods:
        s["baseline_speedup"] = ratio(methods["baseline"]["decode_tps"], plain["decode_tps"])
    keys = dflash_keys(runs[0])
    if len(keys) > 1:
        s["columns"] = {}
        for k in keys:
            sp = round_split([p for r in profs.get(k, []) for p in r.phases])
            s["columns"][k] = dict(
                speedup=ratio(methods[k]["decode_tps"], plain["decode_tps"]),
                tau=methods[k].get("tau"), round_time_s=sp, **cost_model(methods[k].get("tau"), sp, step),
            )
            agree = [r["columns"][k]["agreement"] for r in records if "agreement" in r["columns"][k]]
            if agree:
                s["columns"][k]["agreement"] = sum(agree) / len(agree)
    return s


def dflash_keys(runs: Dict) -> List[str]:
    """The DFlash methods of a run dict: "dflash" (the main column), then
    "dflash@<label>" for each other column."""
    return [k for k in runs if k == "dflash" or k.startswith("dflash@")]


def _group(runs: List[Dict[str, Run]]) -> dict:
    plain, fl = _pool([r["plain"] for r in runs]), _pool([r["dflash"] for r in runs])
    return dict(
        prompts=len(runs),
        plain_tps=plain["decode_tps"],
        dflash_tps=fl["decode_tps"],
        speedup=ratio(fl["decode_tps"], plain["decode_tps"]),
        tau=fl.get("tau"),
    )


def categories(records: List[dict], runs: List[Dict[str, Run]]) -> Dict[str, dict]:
    """Pooled decode tok/s, speedup and tau per category (prompts without
    one under "other"), in order of appearance, then "all"."""
    groups: Dict[str, List[Dict[str, Run]]] = {}
    for rec, r in zip(records, runs):
        groups.setdefault(rec["category"] or "other", []).append(r)
    out = {k: _group(v) for k, v in groups.items()}
    out["all"] = _group(runs)
    return out


# -------------------------------------------------------------- the driver


def build_parser() -> argparse.ArgumentParser:
    from ..generate import add_pipeline_arg

    p = argparse.ArgumentParser(
        prog="python -m dflash_mlx.benchmark",
        description="Benchmark DFlash speculative decoding against plain mlx-lm decoding.",
        epilog="Exit codes: 0 ok, 1 bad input, 3 outputs differ at temperature 0.",
    )
    p.add_argument("--model", help="Target model folder, hub id or short name (default: smollm2).")
    p.add_argument("--draft", help="DFlash draft folder or hub id (default: the embedded or published draft for --model).")
    p.add_argument("--dataset", default="heldout",
                   help="gsm8k, math500, humaneval, mbpp, mt-bench (from the hub), a JSONL file of prompts, "
                        "heldout (the smollm2 held-out set, default), demo (the toy pair's prompts) or "
                        "long[:N,M,...] (long-context prompts of 256, 1024, 2048, 4096 or N, M tokens, "
                        "made offline; one category each).")
    p.add_argument("--max-samples", type=int, default=None,
                   help="Prompts to run (default: all of a file, 20 of a hub dataset); for long, prompts of each "
                        "length (default 2, at most 6).")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temp", default="0,0.7",
                   help="Sampling temperatures, comma-separated, each a full pass (0: greedy, outputs checked; default 0,0.7).")
    p.add_argument("--block-size", type=block_sizes_arg, default=["auto"],
                   help="DFlash tokens per round: auto (default, adaptive up to the draft's block) or a fixed "
                        "number; a comma-separated list (e.g. 4,8,16,auto) measures each side by side, one column each.")
    p.add_argument("--seed", default=None,
                   help="Sampling seed (default: 0 at temperatures > 0). 'none': DFlash samples unseeded (the "
                        "p/q rule for sampled drafts), from MLX's generator seeded with 0 before every run.")
    p.add_argument("--draft-bits", type=_list(_bits), default=[None],
                   help="Quantize the DFlash draft's linear layers to this many bits (4 or 8) at load; "
                        "a list such as none,8,4 adds a column for each after the first.")
    p.add_argument("--proposal", type=_list(_proposal), default=[None],
                   help="How the draft proposes when sampling: sample (drawn with the target's noise, the default) or argmax; "
                        "a list adds a column for each after the first.")
    p.add_argument("--denoise-steps", type=_list(int), default=[1],
                   help="Draft passes per round (default 1); a list adds a column for each after the first.")
    p.add_argument("--accept-threshold", type=_list(float), default=[],
                   help="A relaxed (not exact) DFlash column for each value T in (0, 1]; its agreement "
                        "with the target's output is reported instead of the identity check.")
    add_pipeline_arg(p)
    p.add_argument("--out", default="bench_out/results.json", help="JSON results path.")
    p.add_argument("--chart", default=None, help="PNG chart path (default: --out with .png).")
    p.add_argument("--baseline-draft-model", default=None,
                   help="A small autoregressive draft for mlx-lm's speculative decoding, as a third column.")
    p.add_argument("--num-draft-tokens", type=int, default=3, help="Draft tokens per step of the mlx-lm baseline.")
    p.add_argument("--no-chat-template", action="store_true", help="Use prompts as raw text.")
    p.add_argument("--repetition-penalty", type=float, default=None, help="Applied to every method.")
    p.add_argument("--warmup-tokens", type=int, default=16, help="Tokens of each per-prompt warm-up run (0: none).")
    p.add_argument("--profile", choices=["separate", "inline", "off"], default="separate",
                   help="Round split from a separate profiled DFlash run (default), from the measured run, or not at all.")
    p.add_argument("--perturb-dflash", type=float, default=None, metavar="PENALTY",
                   help="Self-test of the identity check: give the DFlash side alone a repetition "
                        "penalty PENALTY; its output then legitimately differs and the run must fail.")
    return p


def _list(parse: Callable) -> Callable[[str], list]:
    """An argparse type: comma-separated values of ``parse``, without repeats."""

    def f(text: str) -> list:
        try:
            out = [parse(t.strip()) for t in str(text).split(",") if t.strip()]
        except ValueError:
            out = []
        if not out:
            raise argparse.ArgumentTypeError(f"expected comma-separated values, got {text!r}")
        return list(dict.fromkeys(out))

    return f


def _bits(text: str) -> Optional[int]:
    if text.lower() == "none":
        return None
    if text not in ("4", "8"):
        raise argparse.ArgumentTypeError(f"draft bits are 4, 8 or none, got {text!r}")
    return int(text)


def _proposal(text: str) -> str:
    if text not in ("argmax", "sample"):
        raise argparse.ArgumentTypeError(f"proposal is argmax or sample, got {text!r}")
    return text


def block_sizes_arg(text: str) -> list:
    """``--block-size`` values: "auto" or integers, comma-separated, without repeats."""
    from ..generate import block_size_arg

    return _list(block_size_arg)(text)


def main_block(sizes: list):
    """The block size of the main "dflash" column: auto when listed, else the first."""
    return "auto" if "auto" in sizes else sizes[0]


def _check(args) -> None:
    for name in ("max_tokens", "max_samples", "num_draft_tokens"):
        v = getattr(args, name)
        if isinstance(v, int) and v < 1:
            raise BenchmarkError(f"--{name.replace('_', '-')} must be at least 1, got {v}.")
    for v in args.block_size:
        if isinstance(v, int) and v < 1:
            raise BenchmarkError(f"--block-size must be at least 1, got {v}.")
    if any(k < 1 for k in args.denoise_steps):
        raise BenchmarkError(f"--denoise-steps must be at least 1, got {args.denoise_steps}.")
    if any(not 0 < t <= 1 for t in args.accept_threshold):
        raise BenchmarkError(f"--accept-threshold values must be in (0, 1], got {args.accept_threshold}.")
    parse_temps(args.temp)
    if args.seed not in (None, "none"):
        try:
            args.seed = int(args.seed)
        except ValueError:
            raise BenchmarkError(f"--seed must be an integer or 'none', got {args.seed!r}.") from None
    if args.warmup_tokens < 0:
        raise BenchmarkError(f"--warmup-tokens must be >= 0, got {args.warmup_tokens}.")
    for name in ("repetition_penalty", "perturb_dflash"):
        v = getattr(args, name)
        if v is not None and v <= 0:
            raise BenchmarkError(f"--{name.replace('_', '-')} must be > 0, got {v}.")


def parse_temps(text: str) -> List[float]:
    """The temperatures of ``--temp`` ("0,0.7"), in order, without repeats."""
    try:
        temps = [float(t) for t in str(text).split(",") if t.strip()]
    except ValueError:
        raise BenchmarkError(f"--temp takes comma-separated numbers, got '{text}'.") from None
    if not temps or any(not t >= 0 for t in temps):
        raise BenchmarkError(f"--temp values must be >= 0, got '{text}'.")
    return list(dict.fromkeys(temps))


def resolve(args) -> Dict[str, Optional[str]]:
    """Model, draft and baseline paths; smollm2 and its embedded draft when
    no --model."""
    from ..generate import EMBEDDED, known_draft

    model = args.model or DEFAULT_MODEL
    draft = args.draft or known_draft(model)
    if draft is None:
        raise BenchmarkError(f"No --draft given and no published DFlash draft is known for '{model}'.")
    if not args.draft and draft in EMBEDDED.values() and not (Path(draft) / "config.json").exists():
        raise BenchmarkError(
            f"The embedded {model} draft is not installed ({draft} is missing); "
            "train it first, or pass --draft."
        )
    return dict(model=model, draft=draft, baseline_draft_model=args.baseline_draft_model)


def is_demo(model: str) -> bool:
    """Whether ``model`` is the toy demo target (which is prompted without a
    chat template)."""
    return Path(model).expanduser().resolve() == (DEMO / "target").resolve()


def load_models(paths: Dict[str, Optional[str]], demo: bool, draft_bits: Optional[int] = None,
                pipeline: bool = False) -> Models:
    """Load the target, the DFlash draft and the optional baseline draft."""
    from ..models.loading import check_compatible, load, load_draft

    model, tokenizer = load(paths["model"], pipeline=pipeline)
    draft = load_draft(paths["draft"], bits=draft_bits)
    check_compatible(draft, model)
    base = paths["baseline_draft_model"]
    baseline = load(base)[0] if base else None
    return Models(model, tokenizer, draft, baseline, demo, paths)


def make_columns(args, models: Models) -> List[Column]:
    """The DFlash columns: the main one (auto if listed, else the first block
    size, with the first value of every other list), then one column per
    other value of each list, differing from the main column in that alone."""
    from ..models.loading import load_draft

    block, bits = main_block(args.block_size), args.draft_bits[0]
    main = dict(denoise_steps=args.denoise_steps[0], proposal=args.proposal[0])
    label = [str(block)] + [f"bits={bits}"] * (bits is not None)
    if main["denoise_steps"] != 1:
        label.append(f"denoise={main['denoise_steps']}")
    if main["proposal"] is not None:
        label.append(f"proposal={main['proposal']}")
    cols = [Column("dflash", " ".join(label), block, models.draft, main)]

    def add(label, **change):
        draft = change.pop("draft", models.draft)
        cols.append(Column(f"dflash@{label}", label, change.pop("block", block), draft, {**main, **change}))

    for b in args.block_size:
        if b != block:
            add(str(b), block=b)
    for b in args.draft_bits[1:]:
        add(f"bits={b}", draft=load_draft(models.paths["draft"], bits=b))
    for k in args.denoise_steps[1:]:
        add(f"denoise={k}", denoise_steps=k)
    for q in args.proposal[1:]:
        add(f"proposal={q}", proposal=q)
    for t in args.accept_threshold:
        add(f"threshold={t:g}", accept_threshold=t)
    return cols


def render(tokenizer, messages: List[dict], template: bool) -> str:
    """A chat as prompt text: the chat template (thinking off) or, without
    one, the contents joined by blank lines."""
    if template:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
    return "\n\n".join(m["content"] for m in messages)


def encode(tokenizer, text: str) -> List[int]:
    """Token ids the way both mlx-lm and DFlash encode a text prompt."""
    bos = tokenizer.bos_token
    ids = tokenizer.encode(text, add_special_tokens=bos is None or not text.startswith(bos))
    if not ids:
        raise BenchmarkError("A prompt encodes to no tokens.")
    return ids


def order(names: List[str], i: int) -> List[str]:
    """The methods' order for prompt ``i``: the i-th row of a Williams
    square. Over len(names) prompts (twice as many if odd) each method runs
    in each place, and right after each other method, equally often. A
    method's speed depends on the one before it here: on the toy target our
    block 1 made 385 tok/s right after a block-16 run and 305 after a plain
    one (mlx-lm 354 and 304; 2026-12-06), and a rotation gives each method
    the same predecessor. With n odd, rows alternate forward and backward, so
    a run that stops short of 2n prompts is not one-sided."""
    n = len(names)
    first = [0] + [(j + 1) // 2 if j % 2 else n - j // 2 for j in range(1, n)]
    r, back = ((i // 2) % n, i % 2 == 1) if n % 2 else (i % n, False)
    row = [names[(x + r) % n] for x in first]
    return row[::-1] if back else row


class Bench:
    """Runs the methods on prompts and collects records."""

    def __init__(self, models: Models, s: Settings, profile: str, warmup: int, block: int,
                 cols: Optional[List[Column]] = None):
        self.m, self.s, self.profile, self.warmup, self.block = models, s, profile, warmup, block
        inline = profile == "inline"
        self.cols = cols or [Column("dflash", str(s.block_size), s.block_size, models.draft)]
        self.methods = {"plain": lambda ids, n=None: run_mlx(self.m, ids, self.s, n)}
        for c in self.cols:
            self.methods[c.key] = lambda ids, n=None, c=c: run_dflash(self.m, ids, self.s, n, profile=inline, col=c)
        if models.baseline is not None:
            self.methods["baseline"] = lambda ids, n=None: run_mlx(self.m, ids, self.s, n, speculative=True)
        self.records, self.runs, self.profs = [], [], {}

    def prompt(self, pid: str, ids: List[int], category: Optional[str], show: Callable[[str], None]) -> dict:
        """Warm up, run every method (in :func:`order`), profile."""
        names = order(list(self.methods), len(self.records))
        if self.warmup:
            show(f"{pid}: warm-up")
            for name in names[1:] + names[:1]:  # the first measured run follows its own warm-up
                self.methods[name](ids, min(self.warmup, self.s.max_tokens))
        done = {}
        for name in names:
            show(f"{pid}: {name}")
            done[name] = self.methods[name](ids)
        runs = {name: done[name] for name in self.methods}  # reported in the columns' order
        profs = {}
        if self.profile == "inline":
            profs = {c.key: runs[c.key] for c in self.cols}
        elif self.profile == "separate":
            for c in self.cols:
                show(f"{pid}: profiled {c.key}")
                profs[c.key] = run_dflash(self.m, ids, self.s, profile=True, col=c)
        rec = prompt_result(pid, runs, profs.get("dflash"), self.block, self.s.temp == 0, category, profs, self.cols)
        self.records.append(rec)
        self.runs.append(runs)
        for k, p in profs.items():
            self.profs.setdefault(k, []).append(p)
        return rec


    def result(self) -> dict:
        """This temperature's JSON result."""
        return dict(
            temp=self.s.temp,
            seed=self.s.seed if self.s.keyed else "none",
            summary=summarize(self.records, self.runs, self.profs, self.block),
            categories=categories(self.records, self.runs),
            prompts=self.records,
        )


def _settings(args, temp: float) -> Settings:
    from mlx_lm.sample_utils import make_logits_processors

    procs = make_logits_processors(repetition_penalty=args.repetition_penalty) if args.repetition_penalty else None
    perturb = make_logits_processors(repetition_penalty=args.perturb_dflash) if args.perturb_dflash else None
    seed = 0 if args.seed in (None, "none") and temp > 0 else args.seed
    return Settings(args.max_tokens, temp, main_block(args.block_size), seed, args.num_draft_tokens, procs, perturb,
                    keyed=args.seed != "none")


def _config(args, models: Models, block: int, template: bool, cols: List[Column]) -> dict:
    import mlx.core as mx
    import mlx_lm

    from .. import __version__

    return dict(
        **models.paths,
        dataset=args.dataset,
        max_samples=args.max_samples,
        max_tokens=args.max_tokens,
        temps=parse_temps(args.temp),
        block_size=block,  # the longest round of any column
        adaptive=main_block(args.block_size) == "auto",
        columns={c.key: c.label for c in cols},  # the DFlash columns, the main one first
        seed=args.seed,
        num_draft_tokens=args.num_draft_tokens if models.baseline is not None else None,
        chat_template=template,
        repetition_penalty=args.repetition_penalty,
        perturb_dflash=args.perturb_dflash,
        draft_bits=args.draft_bits[0],
        warmup_tokens=args.warmup_tokens,
        profile=args.profile,
        timing="decode: first generated token to last (prefill excluded); e2e: call to last token",
        versions=dict(dflash_mlx=__version__, mlx=mx.__version__, mlx_lm=mlx_lm.__version__, python=platform.python_version()),
        device=str(mx.default_device()),
        platform=platform.platform(),
        blas_preloaded="openblas" in os.environ.get("LD_PRELOAD", ""),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )


def run_pass(bench: Bench, samples, template: bool, progress: Progress, done: int) -> int:
    """Run every sample's turns through ``bench``; return the prompts done."""
    tok, tag = bench.m.tokenizer, f"[temp {bench.s.temp:g}]"
    for smp in samples:
        chat = list(smp.messages or [])
        for t, turn in enumerate(smp.turns or [None]):
            if turn is not None:
                chat.append({"role": "user", "content": turn})
            pid = smp.id if len(smp.turns) < 2 else f"{smp.id}#{t + 1}"
            ids = encode(tok, render(tok, chat, template))
            rec = bench.prompt(pid, ids, smp.category, lambda msg: progress.show(done, f"{tag} {msg}"))
            done += 1
            progress.show(done, f"{tag} {pid}: x{fmt(rec['speedup'], '{:.2f}')} tau {fmt(rec['tau'], '{:.2f}')}", final=True)
            if rec["checked"] and not rec["identical"]:
                progress.log(f"MISMATCH {pid}: outputs differ from token {rec['first_difference']}")
            chat.append({"role": "assistant", "content": rec["output"]})
    return done


def compare_to_greedy(results: List[dict]) -> None:
    """Set each sampled result's speedup as a multiple of the greedy one."""
    greedy = next((r["summary"]["speedup"] for r in results if r["temp"] == 0), None)
    for r in results:
        r["speedup_vs_greedy"] = ratio(r["summary"]["speedup"], greedy) if r["temp"] > 0 else None


def benchmark(args, progress: Optional[Progress] = None) -> dict:
    """Run the benchmark described by parsed ``args``; return the results:
    the shared config and one result per temperature."""
    from .datasets import is_hub, load_samples, long_lengths, long_samples

    _check(args)
    temps = parse_temps(args.temp)
    paths = resolve(args)
    lengths = long_lengths(args.dataset)  # long prompts are cut with the target's tokenizer
    if lengths is None:
        samples = load_samples(args.dataset, args.max_samples or (20 if is_hub(args.dataset) else None))
    models = load_models(paths, is_demo(paths["model"]), args.draft_bits[0], getattr(args, "pipeline", False))
    if lengths is not None:
        samples = long_samples(models.tokenizer, lengths, args.max_samples or 2)
    cols = make_columns(args, models)
    block = max(c.block if isinstance(c.block, int) else c.draft.block_size for c in cols)
    template = bool(not args.no_chat_template and not models.demo and getattr(models.tokenizer, "chat_template", None))
    progress = progress or Progress(sum(len(x.turns) or 1 for x in samples) * len(temps))
    results, done = [], 0
    for temp in temps:
        bench = Bench(models, _settings(args, temp), args.profile, args.warmup_tokens, block, cols)
        done = run_pass(bench, samples, template, progress, done)
        results.append(bench.result())
    progress.close()
    compare_to_greedy(results)
    failures = [p["id"] for r in results for p in r["prompts"] if p["checked"] and not p["identical"]]
    return dict(
        config=_config(args, models, block, template, cols),
        results=results,
        failures=failures,
        ok=not failures,
    )


def main(argv: Optional[List[str]] = None) -> int:
    """The command line; returns the exit code."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return run_command(lambda: _run(args))


def _run(args) -> int:
    from ..models.distributed import quiet_followers, rank

    quiet_followers()  # launched on several ranks: rank 0 reports, the others follow
    if rank() != 0:
        result = benchmark(args, Progress(1, open(os.devnull, "w")))
        return 0 if result["ok"] else MISMATCH_EXIT
    result = benchmark(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    chart = Path(args.chart) if args.chart else out.with_suffix(".png")
    note = write_chart(result, chart)
    print(format_summary(result))
    print(f"results: {out}" + (f", chart: {chart}" if note is None else f" ({note})"))
    if not result["ok"]:
        print(f"error: outputs differ from plain decoding on {len(result['failures'])} prompt(s): "
              + ", ".join(result["failures"]), file=sys.stderr)
        return MISMATCH_EXIT
    return 0
