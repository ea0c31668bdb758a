"""Build the embedded demo pair from scratch: `python -m dflash_mlx.demo.build`.

Stages (each reuses the previous stages' output in --work):
  tokenizer  byte-level BPE trained on the CPython standard library (*.py)
  target     a small Qwen3 trained from scratch on the same files (next-token loss)
  prompts    held-out code prompts, from HELD_OUT files only (never trained on)
  draft      its DFlash draft, trained with dflash_mlx.train on the target's own
             greedy continuations of training-file snippets (--regenerate)

The shipped folders are dflash_mlx/demo/target and dflash_mlx/demo/draft
(Hugging Face layout, float16 weights) and dflash_mlx/demo/prompts.jsonl.
The default sizes take about 2.3 h on 2 CPU cores (target 600 steps ~31 min,
regeneration of 3072 sequences ~8 min, draft 1300 steps ~95 min); --fast builds a
weaker pair in about 1.1 h, and --target-minutes / --draft-minutes fit either stage
into a time budget. (A target trained 2.5x longer, to loss ~3.3 instead of ~3.9,
gave a draft with a lower tau for the same training time: its greedy output is
less repetitive, so it is harder to guess.)
The shipped pair was made in stages, longer than the defaults (601 target steps,
about 2,560 draft steps, ~3.7 h in all):
    python -m dflash_mlx.demo.build --stages tokenizer,target,prompts \
        --target-minutes 35 --target-batch 8 --target-lr 3e-3      # 601 steps
    python -m dflash_mlx.demo.build --stages draft --fast --regen 2048 \
        --draft-minutes 45      # draft v1: 1000 steps (stopped and resumed with
                                # python -m dflash_mlx.train ... --resume)
    python -m dflash_mlx.demo.build --stages draft --regen 2048 --draft-minutes 24 \
        --draft-init <draft v1> --draft-lr 5e-4 --seed 2            # +324 steps
    python -m dflash_mlx.demo.build --stages draft --regen 6144 --draft-minutes 80 \
        --draft-init <that draft> --draft-lr 4e-4 --seed 3          # +1125 steps
    then --decode-anchors fine-tuning (dflash_mlx.train with these same settings):
    111 steps at lr 3e-4 on 1024 new regenerations (--seed 4), 105 steps at 3e-4
    on the 6144 above, 58 steps at 2e-4 on the 1024 again (11, 11, 6 min)
    python -m dflash_mlx.demo.build --stages install
Measured tau (40 held-out prompts, 256 tokens, block 16) after each draft stage:
4.06, 4.73, 4.93, 4.97, 5.04.
"""

import argparse
import json
import random
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

HERE = Path(__file__).parent
EOS = "<|endoftext|>"

# Standard-library modules kept out of every training set; the evaluation
# prompts come from these files only.
HELD_OUT = [
    "bisect.py",
    "colorsys.py",
    "fnmatch.py",
    "graphlib.py",
    "heapq.py",
    "sched.py",
    "shlex.py",
    "textwrap.py",
    "queue.py",
    "glob.py",
]


@dataclass
class TargetArgs:
    """The demo target: a small Qwen3."""

    hidden_size: int = 256
    num_hidden_layers: int = 4
    intermediate_size: int = 768
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    vocab_pad: int = 64


def stdlib_files(held_out: bool = False) -> List[Path]:
    """Sorted *.py files of the running interpreter's standard library, without
    site-packages and test suites; with ``held_out`` only the HELD_OUT files."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    if held_out:
        return [lib / f for f in HELD_OUT if (lib / f).exists()]
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    out = []
    for p in sorted(lib.rglob("*.py")):
        rel = p.relative_to(lib)
        if skip & set(rel.parts) or str(rel) in HELD_OUT:
            continue
        out.append(p)
    return out


def read(p: Path) -> str:
    return p.read_text(encoding="utf-8", errors="replace")


def build_tokenizer(work: Path, vocab_size: int, pad: int) -> int:
    """Train a byte-level BPE and write tokenizer.json / tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(p) for p in stdlib_files()], trainer)
    out = work / "target"
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": EOS,
                "pad_token": EOS,
                "model_max_length": 4096,
            },
            indent=2,
        )
    )
    return tok.get_vocab_size()


def token_stream(work: Path) -> np.ndarray:
    """All training files as one token stream, files separated by EOS."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(work / "target" / "tokenizer.json"))
    eos = tok.token_to_id(EOS)
    encs = tok.encode_batch([read(p) for p in stdlib_files()])
    ids = []
    for e in encs:
        ids.extend(e.ids)
        ids.append(eos)
    return np.array(ids, dtype=np.int32)


def target_config(a: TargetArgs, n_tok: int) -> dict:
    vocab = (n_tok + a.vocab_pad + 63) // 64 * 64  # spare rows: the draft's mask
    return dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        hidden_size=a.hidden_size,
        num_hidden_layers=a.num_hidden_layers,
        intermediate_size=a.intermediate_size,
        num_attention_heads=a.num_attention_heads,
        num_key_value_heads=a.num_key_value_heads,
        head_dim=a.head_dim,
        rms_norm_eps=1e-6,
        vocab_size=vocab,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        torch_dtype="float16",
        eos_token_id=0,
    )


def train_target(work: Path, a: TargetArgs, steps: int, batch: int, seq: int, lr: float,
                 seed: int, minutes: float = None, resume: bool = False):
    """Next-token training of the target on random windows of the stream.
    With ``minutes`` the step count is set from a timed trial step so that
    training fits the budget; with ``resume`` training continues from the
    saved target (a fresh schedule; pass another seed for other windows)."""
    from mlx_lm.models import qwen3

    from ..training.train import Progress, make_schedule

    out = work / "target"
    from tokenizers import Tokenizer

    n_tok = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size()
    stream = token_stream(work)
    print(f"target: {len(stream)} training tokens", file=sys.stderr)
    config = target_config(a, n_tok)
    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    if resume:
        model.load_weights(str(out / "model.safetensors"))
    model.set_dtype(mx.float32)

    def loss_fn(m, x, y):
        return nn.losses.cross_entropy(m(x), y, reduction="mean")

    grad = nn.value_and_grad(model, loss_fn)
    if minutes:
        x = mx.array(rng.integers(0, n_tok, size=(batch, seq + 1)), dtype=mx.int32)
        mx.eval(grad(model, x[:, :-1], x[:, 1:]))
        tic = time.perf_counter()
        mx.eval(grad(model, x[:, :-1], x[:, 1:]))
        steps = max(50, int(minutes * 60 / ((time.perf_counter() - tic) * 1.1)))
        print(f"target: {steps} steps fit in {minutes} min", file=sys.stderr)
    opt = optim.AdamW(make_schedule(lr, steps, max(1, steps // 20)), weight_decay=0.1)
    state = [model.state, opt.state]

    def step(x, y):
        loss, g = grad(model, x, y)
        g, _ = optim.clip_grad_norm(g, 1.0)
        opt.update(model, g)
        return loss

    step = mx.compile(step, inputs=state, outputs=state)
    bar = Progress(steps, "target")
    for i in range(steps):
        starts = rng.integers(0, len(stream) - seq - 1, size=batch)
        w = np.stack([stream[s : s + seq + 1] for s in starts])
        loss = step(mx.array(w[:, :-1]), mx.array(w[:, 1:]))
        mx.eval(loss, state)
        bar.update(i + 1, batch * seq, f"loss {loss.item():.3f}")
    bar.close()
    weights = {k: v.astype(mx.float16) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))


def build_prompts(work: Path, n_per_file: int = 4, lines: int = 12) -> Path:
    """Held-out prompts: a few lines of context ending with a top-level or
    method ``def`` line, from HELD_OUT files only."""
    prompts = []
    for p in stdlib_files(held_out=True):
        text = read(p).splitlines(keepends=True)
        defs = [i for i, l in enumerate(text) if l.lstrip().startswith("def ") and l.rstrip().endswith(":")]
        pick = defs[:: max(1, len(defs) // n_per_file)][:n_per_file]
        for i in pick:
            ctx = "".join(text[max(0, i - lines + 1) : i + 1])
            prompts.append({"prompt": ctx, "file": p.name})
    path = work / "prompts.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in prompts))
    return path


def snippets(work: Path, n: int, prompt_tokens: int, seed: int) -> Path:
    """Regeneration prompts from training files, shaped like the held-out ones:
    the last ``prompt_tokens`` tokens of a few lines ending with a ``def`` line
    (half of them) or with any line."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(work / "target" / "tokenizer.json"))
    rng = random.Random(seed)
    files = stdlib_files()
    out = []
    while len(out) < n:
        lines = read(rng.choice(files)).splitlines(keepends=True)
        if not lines:
            continue
        ends = range(len(lines))
        if len(out) % 2 == 0:
            ends = [i for i in ends if lines[i].lstrip().startswith("def ")] or ends
        i = rng.choice(ends)
        ids = tok.encode("".join(lines[max(0, i - 24) : i + 1])).ids
        if len(ids) < prompt_tokens:
            continue
        out.append({"prompt": tok.decode(ids[-prompt_tokens:])})
    path = work / "regen.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in out))
    return path


def copy_pair(work: Path, dest: Path) -> None:
    """Copy the built target, draft and prompts into the package folder."""
    import shutil

    from ..training.train import export_draft

    dst = dest / "target"
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for f in (work / "target").iterdir():
        if f.is_file() and not f.name.startswith("."):
            shutil.copy2(f, dst / f.name)
    # The draft ships with float16 weights like the target (only its config
    # and weights: the trainer's side files stay in the work folder).
    export_draft(work / "draft", dest / "draft")
    shutil.copy2(work / "prompts.jsonl", dest / "prompts.jsonl")


def evaluate_pair(dest: Path, n: int, max_tokens: int) -> None:
    """Greedy tau of the installed pair on held-out prompts, and its decode
    speed against plain mlx-lm decoding of the same target (same tokens)."""
    import mlx_lm

    from .. import load, load_draft, stream_generate

    model, tok = load(str(dest / "target"))
    draft = load_draft(str(dest / "draft"))
    prompts = [json.loads(l)["prompt"] for l in (dest / "prompts.jsonl").read_text().splitlines()]
    prompts = prompts[:: max(1, len(prompts) // n)][:n]
    for _ in mlx_lm.stream_generate(model, tok, prompts[0], max_tokens=16):
        pass  # warm-up
    t_plain = t_fast = 0.0
    rounds = committed = tokens = 0
    for p in prompts:
        tic = time.perf_counter()
        want = [r.token for r in mlx_lm.stream_generate(model, tok, p, max_tokens=max_tokens)]
        t_plain += time.perf_counter() - tic
        tic = time.perf_counter()
        got, last = [], None
        for last in stream_generate(model, draft, tok, p, max_tokens=max_tokens):
            got.extend(last.tokens)
        t_fast += time.perf_counter() - tic
        if got != want:
            print(f"MISMATCH on prompt {p[:40]!r}", file=sys.stderr)
        rounds, committed, tokens = rounds + last.rounds, committed + last.committed, tokens + len(got)
    print(f"demo pair on {len(prompts)} held-out prompts, block {draft.block_size}, greedy, "
          f"{max_tokens} tokens: tau {committed / max(rounds, 1):.2f}, plain {tokens / t_plain:.1f} tok/s, "
          f"dflash {tokens / t_fast:.1f} tok/s, speedup {t_plain / t_fast:.2f}x (prefill included)")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m dflash_mlx.demo.build", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="build/demo", help="Scratch folder.")
    p.add_argument("--dest", default=str(HERE), help="Where the pair is installed.")
    p.add_argument("--stages", default="tokenizer,target,prompts,draft,install,eval")
    p.add_argument("--eval-prompts", type=int, default=8)
    p.add_argument("--fast", action="store_true", help="A reduced build (~1.1 h).")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--target-steps", type=int, default=None)
    p.add_argument("--target-minutes", type=float, default=None,
                   help="Fit target training in this time instead of a step count.")
    p.add_argument("--target-batch", type=int, default=8)
    p.add_argument("--target-seq", type=int, default=256)
    p.add_argument("--target-lr", type=float, default=3e-3)
    p.add_argument("--target-resume", action="store_true",
                   help="Continue training the target in --work instead of starting afresh.")
    p.add_argument("--regen", type=int, default=None, help="Regenerated sequences for the draft.")
    p.add_argument("--draft-steps", type=int, default=None)
    p.add_argument("--draft-minutes", type=float, default=None,
                   help="Fit draft training in this time instead of a step count.")
    p.add_argument("--draft-layers", type=int, default=2)
    p.add_argument("--draft-lr", type=float, default=1.5e-3)
    p.add_argument("--decode-anchors", action="store_true",
                   help="Train the draft on the blocks decoding would start (see dflash_mlx.train).")
    p.add_argument("--draft-init", default=None,
                   help="Fine-tune this draft (e.g. an earlier build's) instead of starting afresh.")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    stages = args.stages.split(",")
    fast = args.fast
    t_steps = args.target_steps or (400 if fast else 600)
    regen = args.regen or (2048 if fast else 3072)
    d_steps = args.draft_steps or (500 if fast else 1300)
    a = TargetArgs()
    t0 = time.time()
    if "tokenizer" in stages:
        n = build_tokenizer(work, args.vocab, a.vocab_pad)
        print(f"tokenizer: {n} tokens", file=sys.stderr)
    if "target" in stages:
        train_target(work, a, t_steps, args.target_batch, args.target_seq, args.target_lr, args.seed,
                     args.target_minutes, args.target_resume)
    if "prompts" in stages:
        build_prompts(work)
    if "draft" in stages:
        from ..training.train import main as train_main

        data = snippets(work, regen, 64, args.seed)
        code = train_main(
            [
                "--model", str(work / "target"),
                "--data", str(data),
                "--out", str(work / "draft"),
                "--regenerate", "--regen-tokens", "192",
                "--block-size", "16",
                "--depth", str(args.draft_layers),
                "--seq-len", "256",
                "--anchors", "24",
                "--batch-size", "8",
                *(["--minutes", str(args.draft_minutes)] if args.draft_minutes else ["--steps", str(d_steps)]),
                "--target-layer-ids", ",".join(str(i) for i in range(1, a.num_hidden_layers)),
                "--regen-batch", "64",
                "--lr", str(args.draft_lr),
                "--seed", str(args.seed),
                "--eval-prompts", "0",
                "--checkpoint-every", "200",
                *(["--init", args.draft_init] if args.draft_init else []),
                *(["--decode-anchors"] if args.decode_anchors else []),
            ]
        )
        if code:
            sys.exit(code)
    if "install" in stages:
        copy_pair(work, Path(args.dest))
        size = sum(f.stat().st_size for f in Path(args.dest).rglob("*") if f.is_file()
                   and f.parent.name in ("target", "draft"))
        print(f"installed in {args.dest}: {size / 1e6:.1f} MB", file=sys.stderr)
    if "eval" in stages:
        evaluate_pair(Path(args.dest), args.eval_prompts, 128)
    print(f"done in {(time.time() - t0) / 60:.1f} min", file=sys.stderr)


if __name__ == "__main__":
    from dflash_mlx.blas import preload

    preload("dflash_mlx.demo.build", sys.argv[1:])
    main()
