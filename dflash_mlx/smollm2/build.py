"""Make the embedded DFlash draft for SmolLM2-135M-Instruct: `make smollm2-draft`.

Stages (``--stages``, comma-separated, run in this order):

- ``prompts``: ``--prompts`` instruction prompts from :mod:`.prompts` (seeded);
- ``written``: ``--written`` more prompts whose user text the target itself
  writes (:mod:`.written`, seeded), each listed ``--repeat`` times so that
  training draws them that much more often (their features are computed once);
- ``corpus``: text the target did not write becomes data too (exact labels,
  :mod:`..training.labels`): ``--corpus-files`` Python standard-library
  sources, their features and greedy labels computed by ``--data-workers``
  processes into ``WORK/corpus`` (resumable: a rerun goes on where it stopped;
  with ``--online`` only the text is written, and training computes them);
- ``regen``: the target answers each one greedily (``--regen-tokens`` at
  most); answers are kept in the work folder as they finish, so an
  interrupted run loses none and a rerun only makes the missing ones.
  The answers committed in ``answers.jsonl.gz`` next to this file join the
  work folder's first, so a new machine answers only prompts none has;
- ``keep``: write the work folder's answers into ``answers.jsonl.gz`` (to
  commit: answers cost ~125 tokens a second to make, and work folders do not
  outlive a session here);
- ``train``: train the draft (``--minutes``) on prompt + answer sequences
  (``--train-on corpus``: on the corpus stage's store instead).
  Target features are computed once and kept in the work folder; with
  ``--init DRAFT`` training continues from an earlier draft (a new stage);
- ``install``: copy the draft into the package (float16 weights);
- ``eval``: greedy tau of the installed draft on the held-out prompts.

Training runs in stages over several sessions; each is recorded in
STAGES.md next to this file with its command, time and held-out tau.
"""

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
DRAFT = HERE / "draft"
HELDOUT = HERE / "heldout.jsonl"
ANSWERS = HERE / "answers.jsonl.gz"
POOL = 6000

# The draft's shape and training settings (see STAGES.md for what they gave).
TRAIN = [
    "--block-size", "16", "--depth", "3", "--target-layer-ids", "1,8,15,22,29", "--target-init",
    "--draft-vocab", "8192", "--seq-len", "384", "--context-window", "384", "--anchors", "32", "--batch-size", "4",
    "--regen-tokens", "256", "--regen-batch", "64", "--eval-prompts", "0",
]


def train_args(work: Path, args) -> list:
    out = ["--model", "smollm2", "--data", str(work / "prompts.jsonl"), "--out", str(work / "draft"),
           "--regenerate", *TRAIN, "--lr", str(args.lr), "--seed", str(args.seed)]
    if args.init:
        out += ["--init", args.init]
    return out


def _answer_lines(path: Path) -> list:
    if not path.exists():
        return []
    text = (gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()).decode()
    return [l for l in text.splitlines() if l.endswith("}")]  # a line cut short by a kill is dropped


def restore_answers(work: Path) -> int:
    """Add the committed answers to the work folder's; returns how many."""
    from ..training.train import REGEN

    path = work / "draft" / REGEN
    have = set(_answer_lines(path))
    new = [l for l in _answer_lines(ANSWERS) if l not in have]
    if new:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            if path.stat().st_size and not path.read_text().endswith("\n"):
                f.write("\n")
            f.write("".join(l + "\n" for l in new))
    return len(new)


def keep_answers(work: Path) -> int:
    """Write the committed answers plus the work folder's new ones into
    ``ANSWERS`` (byte-for-byte the same for the same answers); returns how
    many it holds."""
    from ..training.train import REGEN

    lines = _answer_lines(ANSWERS)
    seen = set(lines)
    lines += [l for l in dict.fromkeys(_answer_lines(work / "draft" / REGEN)) if l not in seen]
    tmp = ANSWERS.with_suffix(".part")
    with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        f.write("".join(l + "\n" for l in lines).encode())
    tmp.replace(ANSWERS)
    return len(lines)


def written(work: Path, args, make: bool) -> list:
    """The first ``--written`` target-written prompts of the work folder,
    written there first when ``make`` and the folder holds none made for
    this many with this seed (none of them is a held-out prompt)."""
    path, meta = work / "written.jsonl", work / "written.json"
    rows = [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []
    asked = json.loads(meta.read_text()) if meta.exists() and rows else {}
    # Some of the target's texts are dropped, so a file made for this request
    # (or a larger one) may hold fewer rows than asked: it is kept all the same.
    if make and not (asked.get("seed") == args.seed and asked.get("asked", 0) >= args.written):
        from .. import load
        from ..training.train import Progress
        from .written import written_prompts

        model, tok = load("smollm2")
        held = {json.loads(l)["prompt"].strip() for l in HELDOUT.read_text().splitlines() if l.strip()}
        bar = Progress(args.written, "written")
        rows = [r for r in written_prompts(model, tok, args.written, args.seed, progress=bar.update)
                if r["messages"][0]["content"] not in held]
        bar.close()
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        meta.write_text(json.dumps({"asked": args.written, "seed": args.seed}) + "\n")
        print(f"{len(rows)} prompts written by the target (unfinished, short and repeated ones dropped)",
              file=sys.stderr)
    elif len(rows) < args.written:
        print(f"note: {path} holds {len(rows)} written prompts (asked for {args.written})", file=sys.stderr)
    return rows[: args.written]


def corpus(work: Path, n: int) -> Path:
    """``work/corpus.jsonl``: the first ``n`` standard-library Python sources
    (sorted by path, tests and site-packages left out) as text records."""
    import sysconfig

    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in lib.rglob("*.py") if not ({"test", "tests", "site-packages", "idlelib"}
                                                         & set(f.relative_to(lib).parts)))[:n]
    path = work / "corpus.jsonl"
    rows = (f.read_text(encoding="utf-8", errors="replace") for f in files)
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in rows if t.strip()))
    return path


def evaluate(n: int, max_tokens: int) -> float:
    """Greedy tau of the installed draft over the first ``n`` held-out prompts."""
    from .. import load, load_draft
    from ..training.train import evaluate as tau_of

    model, tok = load("smollm2")
    draft = load_draft(str(DRAFT))
    rows = [json.loads(l) for l in HELDOUT.read_text().splitlines() if l.strip()][:n]
    prompts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                       add_generation_prompt=True) for r in rows]
    return tau_of(model, draft, tok, prompts, draft.block_size, max_tokens)


def main(argv=None) -> int:
    from ..errors import run_command
    from ..training.train import export_draft
    from ..training.train import main as train_main

    p = argparse.ArgumentParser(prog="python -m dflash_mlx.smollm2.build", description=__doc__.splitlines()[0])
    p.add_argument("--work", default="build/smollm2", help="Work folder (prompts, answers, features, checkpoints).")
    p.add_argument("--stages", default="prompts,regen,train,install,eval",
                   help="Comma-separated: prompts, written, corpus, regen, keep, train, install, eval.")
    p.add_argument("--prompts", type=int, default=2000)
    p.add_argument("--written", type=int, default=0, help="Prompts written by the target (after the template ones).")
    p.add_argument("--repeat", type=int, default=1, help="How many times each written prompt is listed.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--minutes", type=float, default=60.0, help="Training time of the train stage.")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--init", default=None, help="Continue from this draft (a later stage).")
    p.add_argument("--corpus-files", type=int, default=200, help="Standard-library sources of the corpus stage.")
    p.add_argument("--data-workers", type=int, default=2, help="Processes computing features and labels.")
    p.add_argument("--train-on", choices=("answers", "corpus"), default="answers",
                   help="What the train stage (and install) uses: the target's answers to the prompts, or the "
                        "corpus stage's store (WORK/corpus, the draft saved there too).")
    p.add_argument("--online", action="store_true",
                   help="With --train-on corpus: compute the target's features and labels at each training step "
                        "instead of storing them first (no store to keep; the corpus stage only writes its text).")
    p.add_argument("--eval-prompts", type=int, default=48)
    p.add_argument("--eval-tokens", type=int, default=192)
    args = p.parse_args(argv)
    work = Path(args.work)
    stages = args.stages.split(",")

    def run() -> int:
        work.mkdir(parents=True, exist_ok=True)
        if "prompts" in stages or "written" in stages:
            from .prompts import training_prompts

            # The first N of a fixed pool, so a larger N extends a smaller one.
            rows = training_prompts(max(args.prompts, POOL), args.seed)[: args.prompts]
            if args.written:
                rows += written(work, args, "written" in stages) * args.repeat
            (work / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        on_corpus = [a for a in train_args(work, args) if a != "--regenerate"]
        on_corpus[on_corpus.index("--data") + 1] = str(work / "corpus.jsonl")
        on_corpus[on_corpus.index("--out") + 1] = str(work / "corpus")
        if "corpus" in stages:
            corpus(work, args.corpus_files)
            if not args.online:
                code = train_main(on_corpus + ["--prepare-only", "--data-workers", str(args.data_workers)])
                if code:
                    return code
        if "regen" in stages or "train" in stages:
            n = restore_answers(work)
            if n:
                print(f"{n} committed answers added to the work folder", file=sys.stderr)
        if "regen" in stages:
            code = train_main(train_args(work, args) + ["--prepare-only"])
            if code:
                return code
        if "keep" in stages:
            print(f"{ANSWERS} holds {keep_answers(work)} answers", file=sys.stderr)
        if "train" in stages:
            tic = time.perf_counter()
            base = on_corpus if args.train_on == "corpus" else train_args(work, args)
            online = ["--no-feature-cache", "--checkpoint-every", "50"] if args.online else []
            code = train_main(base + online + ["--minutes", str(args.minutes)])
            if code:
                return code
            print(f"train stage: {(time.perf_counter() - tic) / 60:.1f} min", file=sys.stderr)
        if "install" in stages:
            src = work / ("corpus" if args.train_on == "corpus" else "draft")
            print(f"installed {DRAFT}: {export_draft(src, DRAFT):.1f} MB", file=sys.stderr)
        if "eval" in stages:
            tau = evaluate(args.eval_prompts, args.eval_tokens)
            print(f"held-out tau (greedy, {args.eval_prompts} prompts, {args.eval_tokens} tokens): {tau:.2f}")
        return 0

    return run_command(run)


if __name__ == "__main__":
    from ..blas import preload

    preload("dflash_mlx.smollm2.build", sys.argv[1:])
    raise SystemExit(main())
