"""Trainer speed-ups: a draft vocabulary of the most frequent target tokens
with cached target features still trains a lossless draft; regenerated
answers are kept as they finish and reused by a rerun."""

import json
import os
from collections import Counter
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from dflash_mlx import load, load_draft, stream_generate
from dflash_mlx.training.data import Sequence, read_records, regen_prompts, regenerate
from dflash_mlx.engine.target import Target
from dflash_mlx.training.train import REGEN, TrainArgs, main, make_batch, top_tokens, train

from tiny import corpus_files, make_target


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = make_target(tmp_path_factory.mktemp("target"), "qwen3", layers=4)
    model, tok = load(str(folder))
    return folder, model, tok


def test_make_batch_over_a_draft_vocab(tiny):
    a = TrainArgs(block_size=4, anchors=5, seq_len=20)
    seqs = [Sequence(list(range(1, 15)), 3), Sequence(list(range(2, 22)), 1)]
    lookup = np.full(300, -1, dtype=np.int32)
    vocab = [9, 4, 12, 7, 15, 3, 20]
    lookup[vocab] = np.arange(len(vocab))
    plain = [np.array(x) for x in make_batch(seqs, a, 0, 299, np.random.default_rng(0))]
    got = [np.array(x) for x in make_batch(seqs, a, 0, 299, np.random.default_rng(0), lookup=lookup)]
    for x, y in zip(plain[:3], got[:3]):  # tokens, blocks, anchors
        assert (x == y).all()
    labels, valid = got[3], got[4]
    assert (valid == plain[4] & (lookup[plain[3]] >= 0)).all()
    assert valid.any() and (plain[4] & ~valid).any()
    assert (np.array(vocab)[labels[valid]] == plain[3][valid]).all()
    assert (labels >= 0).all() and (labels < len(vocab)).all()


def test_draft_vocab_training_with_cached_features(tiny, tmp_path):
    _, model, tok = tiny
    records = [{"text": Path(f).read_text()[:3000]} for f in corpus_files(4)]
    seqs = regenerate(model, regen_prompts(tok, records, 64, 16), 48, set(tok.eos_token_ids), batch=16)
    K, rows, out = 48, Target(model).vocab_rows, tmp_path / "d"
    losses = []
    a = TrainArgs(block_size=8, depth=2, seq_len=64, anchors=8, batch_size=4, steps=30, lr=3e-3,
                  checkpoint_every=0, draft_vocab=K, cache_features=True)
    train(model, tok, seqs, str(out), a, on_step=lambda s, l, acc, tau: losses.append(l))
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5])
    assert (out / "train_features.f16").exists()

    vocab = json.loads((out / "config.json").read_text())["dflash_config"]["draft_vocab"]
    assert vocab == top_tokens(seqs, K, rows) and len(set(vocab)) == K
    counts = Counter(t for s in seqs for t in s.tokens[s.start :])
    assert min(counts[t] for t in vocab) >= max(c for t, c in counts.items() if t not in vocab)

    # --resume keeps the vocabulary trained with, and the features computed once.
    os.utime(out / "train_features.f16", ns=(10**9, 10**9))
    train(model, tok, seqs, str(out), replace(a, steps=32, draft_vocab=10), resume=True)
    assert (out / "train_features.f16").stat().st_mtime_ns == 10**9
    draft = load_draft(str(out))
    assert draft.config.draft_vocab == vocab
    for prompt in ("def walk(self, node):\n", "import sys\n"):
        want = [r.token for r in mlx_lm.stream_generate(model, tok, prompt, max_tokens=40)]
        for bs in (1, 4, 8):
            got = [t for r in stream_generate(model, draft, tok, prompt, block_size=bs, max_tokens=40)
                   for t in r.tokens]
            assert got == want, (prompt, bs)

    # The shipped copy: config and float16 weights rounded from the exact ones, nothing else.
    from dflash_mlx.training.train import export_draft, float32_weights

    export_draft(out, tmp_path / "shipped")
    assert sorted(f.name for f in (tmp_path / "shipped").iterdir()) == ["config.json", "model.safetensors"]
    exact = float32_weights(out)
    for k, v in mx.load(str(tmp_path / "shipped" / "model.safetensors")).items():
        assert v.dtype == mx.float16 and mx.array_equal(v, exact[k].astype(mx.float16)).item(), k


def test_regenerated_answers_are_kept_and_reused(tiny, tmp_path, capsys):
    folder, model, tok = tiny
    data = tmp_path / "p.jsonl"
    texts = ["def f(x):", "import os", "class A:", "def f(x):", "for i in range(3):"]
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in texts))
    out = tmp_path / "o"
    args = ["--model", str(folder), "--data", str(data), "--out", str(out), "--regenerate",
            "--prepare-only", "--seq-len", "32", "--regen-tokens", "12", "--eval-prompts", "0"]
    prompts = {tuple(p) for p in regen_prompts(tok, read_records(str(data)), 32, 8)}
    assert len(prompts) == 4

    # Options are checked before any regeneration.
    assert main(args + ["--mask-token-id", "100000"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --mask-token-id") and "\n" not in err
    assert main(args + ["--draft-vocab", "-5"]) == 1
    assert capsys.readouterr().err.strip() == "error: --draft-vocab must be positive (or 0: the whole vocabulary)."
    assert main(args + ["--regen-batch", "0"]) == 1
    assert capsys.readouterr().err.strip() == "error: --regen-batch must be positive."
    assert not (out / REGEN).exists()

    def kept():
        seqs = [Sequence(**json.loads(l)) for l in (out / REGEN).read_text().splitlines()]
        assert {tuple(s.tokens[: s.start]) for s in seqs} == prompts and len(seqs) == 4
        return seqs

    assert main(args) == 0
    first = kept()
    # The target's own greedy continuation, as mlx-lm decodes it alone.
    for s in first:
        p = s.tokens[: s.start]
        want = [r.token for r in mlx_lm.stream_generate(model, tok, p, max_tokens=12)]
        assert s.tokens[s.start :] == want, p

    # An interrupted run: one whole answer and half of the next.
    lines = (out / REGEN).read_text().splitlines()
    (out / REGEN).write_text(lines[0] + "\n" + lines[1][: len(lines[1]) // 2])
    capsys.readouterr()
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "reusing 1 regenerated" in err and "regenerated 3 sequences" in err
    again = kept()
    assert again[0] == first[0] and sorted(map(str, again)) == sorted(map(str, first))
