"""A draft with its own vocabulary (dflash_config.draft_vocab) proposes from
those rows of the target's LM head and stays lossless; target features are
computed once and kept on disk (FeatureStore)."""

import json
import os

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import DraftConfigError, load_draft
from dflash_mlx.models.config import DFlashConfig
from dflash_mlx.training.data import Sequence
from dflash_mlx.training.features import FeatureStore
from dflash_mlx.engine.target import Target
from tiny import make_draft, make_target
from util import dflash_tokens, mlx_tokens, runs

PROMPTS = ["def foo(x):\n    return", "class A:\n"]


def vocab_draft(path, folder, vocab, **kw):
    """A z-lab-format draft whose config.json lists ``vocab``, loaded back."""
    make_draft(path, folder, **kw)
    cfg = json.loads((path / "config.json").read_text())
    cfg["dflash_config"]["draft_vocab"] = vocab
    (path / "config.json").write_text(json.dumps(cfg))
    return load_draft(str(path))


def test_config_round_trip_and_errors(target_folder, tmp_path):
    cfg = json.loads((make_draft(tmp_path / "d", target_folder("qwen3")) / "config.json").read_text())
    V = cfg["vocab_size"]
    c = DFlashConfig.from_dict({**cfg, "dflash_config": {**cfg["dflash_config"], "draft_vocab": [7, 3, V - 1]}})
    assert c.draft_vocab == [7, 3, V - 1]
    assert DFlashConfig.from_dict(c.to_dict()).draft_vocab == [7, 3, V - 1]
    assert "draft_vocab" not in DFlashConfig.from_dict(cfg).to_dict()["dflash_config"]
    for bad in (5, "1,2", [], [1, 2, 1], [0, V], [-1], [True, 2], [1.0]):
        d = {**cfg, "dflash_config": {**cfg["dflash_config"], "draft_vocab": bad}}
        with pytest.raises(DraftConfigError, match="draft_vocab") as e:
            DFlashConfig.from_dict(d)
        assert "\n" not in str(e.value), bad


@pytest.mark.parametrize("arch,tied", [("qwen3", False), ("llama", True), ("qwen3_4bit", False),
                                       ("qwen3_4bit", True)])
def test_head_over_is_rows_of_the_head(loaded, arch, tied):
    """Untied, tied (the embedding as head) and 4-bit (QuantizedLinear head,
    and QuantizedEmbedding as head) targets."""
    model, _, _ = loaded(arch, tied)
    t = Target(model)
    ids = np.random.default_rng(0).permutation(t.vocab_rows)[:37]
    h = mx.random.normal((2, 3, t.hidden_size), key=mx.random.key(1))
    got = t.head_over(mx.array(ids))(h)
    assert got.shape == (2, 3, 37)
    np.testing.assert_allclose(np.array(got), np.array(t.head(h))[..., ids], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("bits", [None, 4])
def test_head_over_keeps_the_head_bias(bits):
    """phi's LM head has a bias, also once quantized."""
    from mlx_lm.utils import _get_classes, quantize_model

    cfg = dict(model_type="phi", vocab_size=96, hidden_size=64, num_attention_heads=4,
               num_hidden_layers=2, intermediate_size=128)
    model_cls, args_cls = _get_classes(cfg)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(cfg))
    model.lm_head.bias = mx.random.normal(model.lm_head.bias.shape)
    if bits:
        model, _ = quantize_model(model, cfg, group_size=32, bits=bits)
    t, ids = Target(model), [5, 3, 90, 41]
    h = mx.random.normal((2, 64))
    got = t.head_over(mx.array(ids))(h)
    np.testing.assert_allclose(np.array(got), np.array(t.head(h))[:, ids], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_draft_vocab_decoding_is_lossless(arch, loaded, tmp_path):
    model, tok, folder = loaded(arch)
    V = Target(model).vocab_rows
    vocab = np.random.default_rng(1).permutation(V)[: V // 3].tolist()
    draft = vocab_draft(tmp_path / "d", folder, vocab)
    assert draft.config.draft_vocab == vocab
    for prompt in PROMPTS:
        ref = mlx_tokens(model, tok, prompt, 40)
        for bs in (1, 4, draft.block_size):
            out, rs = dflash_tokens(model, draft, tok, prompt, block_size=bs, max_tokens=40)
            assert out == ref, (arch, prompt, bs)
            # Every drafted token came from the vocabulary: accepted drafts are in it.
            assert all(t in vocab for r in rs[1:] for t in r.tokens[:-1])


def test_draft_vocab_is_what_the_draft_proposes(loaded, tmp_path):
    """An echo draft always guesses its mask token t. With t in a shuffled
    draft vocabulary it still guesses t and runs of t are accepted; with a
    vocabulary holding none of the target's tokens no draft is ever accepted.
    The output is mlx-lm's either way."""
    model, tok, folder = loaded("qwen3", tied=True)
    V = Target(model).vocab_rows
    for prompt in PROMPTS:
        ref = mlx_tokens(model, tok, prompt, 60)
        t = runs(ref)[0]
        others = [i for i in range(V) if i not in ref]
        rng = np.random.default_rng(2)
        with_t = rng.permutation(others[:60] + [t]).tolist()
        for vocab, accepts in ((with_t, True), (others, False)):
            draft = vocab_draft(tmp_path / f"d{accepts}", folder, vocab, mask_token_id=t, echo=True)
            out, rs = dflash_tokens(model, draft, tok, prompt, block_size=8, max_tokens=60)
            assert out == ref, (prompt, accepts)
            if accepts:
                assert rs[-1].mean_accepted > 1.5
            else:
                assert rs[-1].mean_accepted == 1.0 and all(r.accepted == 1 for r in rs)


def _seqs(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [Sequence(rng.integers(0, 300, size=n).tolist(), 1) for n in lengths]


def test_feature_store_matches_target_and_is_reused(loaded, tmp_path):
    model, _, _ = loaded("qwen3")
    t, S, layers = Target(model), 16, [1, 3]
    seqs = _seqs([5, 20, 9, 16, 12])  # one longer than S: cut to S
    data = tmp_path / "train_features.f16"

    def check(store, seqs, layers, t=t):
        got = np.array(store.batch(list(range(len(seqs))), S))
        assert got.shape == (len(seqs), S, t.hidden_size * len(layers)) and got.dtype == np.float32
        for i, s in enumerate(seqs):
            toks = s.tokens[:S]
            want = np.array(t.hidden(mx.array([toks]), layers)[1][0])
            np.testing.assert_allclose(got[i, : len(toks)], want, rtol=1e-2, atol=1e-2 * np.abs(want).max())

    check(FeatureStore(tmp_path, seqs, t, layers, S, pad=0, batch=2), seqs, layers)
    # Reused: the file is not written again (its old mtime stays).
    os.utime(data, ns=(10**9, 10**9))
    check(FeatureStore(tmp_path, seqs, t, layers, S, pad=0, batch=2), seqs, layers)
    assert data.stat().st_mtime_ns == 10**9
    # Other sequences, other layers, or an unfinished build: rebuilt.
    other = _seqs([5, 20, 9, 16, 12], seed=1)
    for s2, l2, unfinished in ((other, layers, False), (other, [0, 2, 5], False), (other, [0, 2, 5], True)):
        if unfinished:  # an interrupted build leaves no metadata
            (tmp_path / "train_features.json").unlink()
        os.utime(data, ns=(10**9, 10**9))
        check(FeatureStore(tmp_path, s2, t, l2, S, pad=0, batch=3), s2, l2)
        assert data.stat().st_mtime_ns != 10**9, (l2, unfinished)
    # Another target of the same shape (other weights): rebuilt.
    from dflash_mlx import load

    t2 = Target(load(str(make_target(tmp_path / "t2", "qwen3", seed=5)))[0])
    os.utime(data, ns=(10**9, 10**9))
    store = FeatureStore(tmp_path, other, t2, [0, 2, 5], S, pad=0)
    assert data.stat().st_mtime_ns != 10**9
    check(store, other, [0, 2, 5], t2)


def test_feature_store_extended_computes_only_new_rows(loaded, tmp_path):
    model, _, _ = loaded("qwen3")
    t, S, layers = Target(model), 16, [1, 3]
    seqs = _seqs([5, 20, 9, 16, 12, 7])
    FeatureStore(tmp_path, seqs[:4], t, layers, S, pad=0, batch=2)
    # Mark a kept row: an extension must carry it over, not recompute it.
    dim = t.hidden_size * len(layers)
    old = np.memmap(tmp_path / "train_features.f16", np.float16, "r+", shape=(4, S, dim))
    old[1] = 7.0
    old.flush()
    del old
    store = FeatureStore(tmp_path, seqs, t, layers, S, pad=0, batch=2)
    got = np.array(store.batch(list(range(6)), S))
    assert (got[1] == 7.0).all()
    for i in (0, 4, 5):
        toks = seqs[i].tokens[:S]
        want = np.array(t.hidden(mx.array([toks]), layers)[1][0])
        np.testing.assert_allclose(got[i, : len(toks)], want, rtol=1e-2, atol=1e-2 * np.abs(want).max())
    # Repeated sequences (a record weighing more) copy the row met first,
    # whether kept or computed in this build.
    store = FeatureStore(tmp_path, seqs + [seqs[1], seqs[5]], t, layers, S, pad=0, batch=2)
    got = np.array(store.batch(list(range(8)), S))
    assert (got[6] == 7.0).all() and (got[7] == got[5]).all() and np.abs(got[7]).sum() > 0
    # Other leading sequences: nothing is kept.
    store = FeatureStore(tmp_path, seqs[1:] + seqs[:1], t, layers, S, pad=0, batch=2)
    assert not (np.array(store.batch([0], S)) == 7.0).all()


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_features_equal_hidden(loaded, arch):
    model, _, _ = loaded(arch)
    t = Target(model)
    toks = mx.array(np.random.default_rng(0).integers(0, 300, size=(2, 11)), dtype=mx.int32)
    f = t.features(toks, [0, 2, 4])
    assert mx.array_equal(f, t.hidden(toks, [0, 2, 4])[1]).item()
