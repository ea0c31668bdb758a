"""`python -m dflash_mlx.generate`: stream DFlash generation in a terminal.

The decoding loop itself lives in :mod:`dflash_mlx.engine.decoding`; its public
functions are re-exported here for `from dflash_mlx.generate import ...`.
"""

import argparse
import re
import sys
import types
from pathlib import Path
from typing import List, Optional

from .engine.decoding import GenerationResponse, generate, print_stats, stream_generate
from .engine import saved
from .engine.policy import Policy
from .errors import run_command

DEFAULT_MODEL = "smollm2"
DEFAULT_PROMPT = "Explain in a few sentences why the sky is blue."

# Drafts shipped inside the package, keyed by the target's short name.
EMBEDDED = {"smollm2": str(Path(__file__).parent / "smollm2" / "draft")}

# Published z-lab drafts, keyed by the target's base name (lower case).
KNOWN_DRAFTS = {
    "qwen3-4b": "z-lab/Qwen3-4B-DFlash-b16",
    "qwen3-8b": "z-lab/Qwen3-8B-DFlash-b16",
    "qwen3.5-4b": "z-lab/Qwen3.5-4B-DFlash",
    "qwen3.5-9b": "z-lab/Qwen3.5-9B-DFlash",
    "qwen3.5-27b": "z-lab/Qwen3.5-27B-DFlash",
    "qwen3.5-35b-a3b": "z-lab/Qwen3.5-35B-A3B-DFlash",
    "qwen3.5-122b-a10b": "z-lab/Qwen3.5-122B-A10B-DFlash",
    "qwen3.6-27b": "z-lab/Qwen3.6-27B-DFlash",
    "qwen3.6-35b-a3b": "z-lab/Qwen3.6-35B-A3B-DFlash",
    "qwen3-coder-30b-a3b": "z-lab/Qwen3-Coder-30B-A3B-DFlash",
    "qwen3-coder-next": "z-lab/Qwen3-Coder-Next-DFlash",
    "gpt-oss-20b": "z-lab/gpt-oss-20b-DFlash",
    "gpt-oss-120b": "z-lab/gpt-oss-120b-DFlash",
    "kimi-k2.5": "z-lab/Kimi-K2.5-DFlash",
    "minimax-m2.5": "z-lab/MiniMax-M2.5-DFlash",
    "gemma-4-12b-it": "z-lab/gemma4-12B-it-DFlash",
    "gemma-4-26b-a4b-it": "z-lab/gemma-4-26B-A4B-it-DFlash",
    "gemma-4-31b-it": "z-lab/gemma-4-31B-it-DFlash",
    "qwen3.8-27b": "z-lab/Qwen3.8-27B-DFlash2",
    "llama-3.1-8b-instruct": "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat",
    "meta-llama-3.1-8b-instruct": "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat",
}


def known_draft(model: str) -> Optional[str]:
    """The embedded draft of a short model name, or the z-lab draft for a
    published target, by name (quantized and community conversions
    included), or None."""
    if model.lower() in EMBEDDED:
        return EMBEDDED[model.lower()]
    name = Path(model.rstrip("/")).name.lower()
    best = None
    for key in KNOWN_DRAFTS:
        if re.match(re.escape(key) + r"($|[-_.])", name) and (
            best is None or len(key) > len(best)
        ):
            best = key
    return KNOWN_DRAFTS[best] if best else None


def block_size_arg(text: str):
    """``--block-size`` values: "auto" or an integer (checked when generating)."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {text!r}") from None


def add_pipeline_arg(p: argparse.ArgumentParser) -> None:
    """``--pipeline``, shared by the command-line tools."""
    p.add_argument("--pipeline", action="store_true",
                   help="Under mlx.launch: shard the target as a pipeline (each rank runs a slice of its layers) "
                        "instead of tensor parallel (for models mlx-lm can only pipeline, e.g. Qwen3-Next).")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dflash_mlx.generate",
        description="Generate with DFlash speculative decoding (exactly the target's output, faster).",
    )
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="Target: a folder, hub id, .gguf file or a short name (default: smollm2, "
                        "SmolLM2-135M-Instruct with its embedded draft).")
    p.add_argument("--draft", help="DFlash draft folder or hub id (default: the published draft for --model).")
    p.add_argument("--prompt", "-p", help="The prompt; '-' reads it from stdin.")
    p.add_argument("--system", help="A system message for the chat template.")
    p.add_argument("--no-chat-template", action="store_true", help="Use the prompt as raw text.")
    p.add_argument("--max-tokens", "-m", type=int, default=256)
    p.add_argument("--temp", type=float, default=0.0, help="Sampling temperature (0: greedy).")
    p.add_argument("--top-p", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--block-size", type=block_size_arg, default="auto",
                   help="Tokens verified per round: auto (default: chosen each round, from plain steps "
                        "up to the draft's block, to be fastest), or a fixed number (1 = plain decoding).")
    p.add_argument("--draft-bits", type=int, choices=(4, 8), default=None,
                   help="Quantize the draft's linear layers to this many bits at load (group size 64).")
    p.add_argument("--accept-threshold", type=float, default=None, metavar="T",
                   help="Also accept a draft token whose target probability is >= T x the top one "
                        "(0 < T <= 1; faster, but the output is no longer exactly the target's).")
    p.add_argument("--denoise-steps", type=int, default=1, metavar="K",
                   help="Draft passes per round: after each, keep its surest guesses and re-mask the rest.")
    p.add_argument("--proposal", choices=("argmax", "sample"), default=None,
                   help="Draft tokens when sampling: drawn from the draft at a temperature tuned as it goes "
                        "(the default; verified with the p/q rule, or with --seed drawn with the target's own "
                        "noise), or the draft's argmax.")
    p.add_argument("--fresh", action="store_true",
                   help="Start auto afresh: do not read or keep what earlier runs with this target and draft "
                        "learnt about which lengths pay (kept in $DFLASH_MLX_CACHE/auto, default ~/.cache/dflash_mlx/auto).")
    add_pipeline_arg(p)
    p.add_argument("--quiet", action="store_true", help="Print the text only, no statistics.")
    p.add_argument(
        "--compare",
        action="store_true",
        help="Then decode the same prompt plainly with mlx-lm and print the speedup "
        "(greedy: also check that the text is identical).",
    )
    p.add_argument("--compare-runs", type=int, default=5, metavar="N",
                   help="With --compare: the speedup is the median of N pairs of runs (a DFlash "
                        "and a plain one back to back), after the run shown (one run swings by ~10%% here).")
    return p


def _prompt(args, tokenizer) -> str:
    text = args.prompt
    if text == "-":
        text = sys.stdin.read()
    if text is None:
        text = DEFAULT_PROMPT
    use_template = not args.no_chat_template and getattr(tokenizer, "chat_template", None)
    if not use_template:
        if args.system and not use_template:
            raise ValueError("--system needs a tokenizer with a chat template.")
        return text
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": text})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _resolve(args):
    draft = args.draft or known_draft(args.model)
    if draft is None and args.block_size != 1:
        raise ValueError(
            f"No --draft given and no published DFlash draft is known for '{args.model}'; "
            "pass --draft (or --block-size 1 for plain decoding)."
        )
    if args.block_size != 1 and draft in EMBEDDED.values() and not Path(draft, "config.json").exists():
        raise FileNotFoundError(
            f"The embedded draft for '{args.model}' is not installed ({draft}); build it with "
            "`make smollm2-draft`, pass --draft, or use --block-size 1 for plain decoding."
        )
    return args.model, draft


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    return run_command(lambda: _run(args))


def _run(args) -> int:
    if args.compare_runs < 1:
        raise ValueError(f"--compare-runs must be at least 1, got {args.compare_runs}.")
    from .models.distributed import quiet_followers
    from .models.loading import load, load_draft

    quiet_followers()  # launched on several ranks: only rank 0 prints
    model_path, draft_path = _resolve(args)
    model, tokenizer = load(model_path, pipeline=args.pipeline)
    draft = None if args.block_size == 1 else load_draft(draft_path, bits=args.draft_bits)
    prompt = _prompt(args, tokenizer)
    processors = None
    if args.repetition_penalty:
        from mlx_lm.sample_utils import make_logits_processors

        processors = make_logits_processors(repetition_penalty=args.repetition_penalty)
    _warm_up(model, draft, tokenizer, args.block_size)
    key = saved.start(draft, model_path, draft_path, args.block_size, args.fresh, **_settings(args),
                      bits=args.draft_bits, **_variants(args))
    if args.prompt is None and not args.quiet:
        print(f"> {DEFAULT_PROMPT}", flush=True)
    last, text = None, ""
    for last in _dflash(model, draft, tokenizer, prompt, args, processors):
        print(last.text, end="", flush=True)
        text += last.text
    print()
    if not args.quiet:
        print("=" * 10)
        print_stats(last)
    saved.keep(draft, key)
    if not last.exact:
        print(f"Note: --accept-threshold {args.accept_threshold} accepts near-top draft tokens: "
              "this is not exactly the target's output.", file=sys.stderr)
    if args.compare:
        return _compare(model, draft, tokenizer, prompt, args, processors, text)
    return 0


def _dflash(model, draft, tokenizer, prompt, args, processors):
    """stream_generate with the command line's settings."""
    return stream_generate(
        model, draft, tokenizer, prompt,
        block_size=args.block_size, max_tokens=args.max_tokens,
        temperature=args.temp, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, seed=args.seed, logits_processors=processors,
        **_variants(args),
    )


def _variants(args) -> dict:
    """The stream_generate arguments of the issue #15 flags that differ
    from their defaults."""
    kw = {"accept_threshold": args.accept_threshold, "denoise_steps": args.denoise_steps,
          "proposal": args.proposal}
    defaults = {"accept_threshold": None, "denoise_steps": 1, "proposal": None}
    return {k: v for k, v in kw.items() if v != defaults[k]}


def _settings(args) -> dict:
    """The sampling settings that change what a round accepts, so that runs
    with other ones keep their "auto" policies apart (greedy and sampled
    generations have a policy each in one file)."""
    return {"seeded": args.temp > 0 and args.seed is not None,
            "penalty": getattr(args, "repetition_penalty", None)}


def _warm_up(model, draft, tokenizer, block_size) -> None:
    """One tiny generation, so one-time costs (allocation, compiled kernels)
    are not counted in the reported speeds."""
    ids = [tokenizer.eos_token_id or 0] * 4
    for _ in stream_generate(model, draft, tokenizer, ids, block_size=block_size, max_tokens=2):
        pass
    if draft is not None:
        Policy.forget(draft)  # a throwaway prompt teaches "auto" nothing about the real one


def _compare(model, draft, tokenizer, prompt, args, processors, text) -> int:
    """Decode plainly with mlx-lm and report the speedup (and, greedy, identity):
    the median of ``--compare-runs`` pairs of runs, each pair a DFlash run and
    a plain one back to back (which goes first alternates), so that both sides
    of a pair see the machine alike. The DFlash runs are the ones after the
    one shown, which also taught "auto" this draft (as the first request of a
    session does)."""
    from statistics import median

    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    sampler = make_sampler(args.temp, args.top_p, args.min_p, top_k=args.top_k)

    def dflash() -> float:
        for d in _dflash(model, draft, tokenizer, prompt, args, processors):
            pass
        return d.generation_tps

    pairs = []  # (DFlash, plain) tok/s
    for i in range(args.compare_runs):
        fast = dflash() if i % 2 == 0 else None
        out = ""
        for r in mlx_lm.stream_generate(
            model, tokenizer, prompt, max_tokens=args.max_tokens,
            sampler=sampler, logits_processors=processors,
        ):
            out += r.text
        pairs.append((dflash() if fast is None else fast, r.generation_tps))
    ratios = sorted(f / p for f, p in pairs)
    how = "one pair"
    if len(pairs) > 1:
        how = f"median of {len(pairs)} alternating pairs: {ratios[0]:.2f}-{ratios[-1]:.2f}"
    print(
        f"Plain mlx-lm decoding: {r.generation_tokens} tokens, {median(p for _, p in pairs):.3f} "
        f"tokens-per-sec; DFlash {median(f for f, _ in pairs):.3f} tokens-per-sec, speedup "
        f"{median(ratios):.2f}x ({how})"
    )
    if args.temp == 0:
        print(f"Identical output: {'yes' if out == text else 'NO'}")
        return 0 if out == text else 2
    return 0


class _CallableModule(types.ModuleType):
    """Importing this module rebinds the package attribute ``dflash_mlx.generate``
    (the function) to the module; calling it still generates, so both work."""

    def __call__(self, *args, **kwargs):
        return generate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule


if __name__ == "__main__":
    from .blas import preload

    preload("dflash_mlx.generate", sys.argv[1:])
    raise SystemExit(main())
