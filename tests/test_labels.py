"""Exact labels from one prefill: on a tiny target, the labels of a block are
what greedy decoding from its anchor writes, up to the text's first
disagreement with the greedy path, and the loss reads nothing past it."""

import mlx.core as mx
import numpy as np

from dflash_mlx.engine.target import Target
from dflash_mlx.training.labels import block_labels, greedy_labels
from util import mlx_tokens

BS = 8


def _text(model, tok, n=40):
    """Token ids that follow the target's greedy path in stretches of 5,
    with a token off the path between them."""
    ids = tok.encode("def main(")
    while len(ids) < n:
        ids += mlx_tokens(model, tok, ids, 5)[:5]
        nxt = mlx_tokens(model, tok, ids, 1)[0]
        ids.append((nxt + 7) % 300)
    return ids[:n]


def test_labels_are_greedy_decoding_up_to_the_first_disagreement(loaded):
    model, tok, _ = loaded("qwen3")
    ids = _text(model, tok)
    n = len(ids)
    labels, feats = greedy_labels(Target(model), mx.array([ids]), [1, 3])
    labels = np.array(labels[0])
    assert feats.shape[:2] == (1, n)
    arr = np.array(ids)
    counts = []
    for a in range(n - 1):
        want = mlx_tokens(model, tok, ids[: a + 1], BS - 1)
        lab, valid = block_labels(arr, labels, n, np.array([a]), BS)
        # How far the text after the anchor follows greedy decoding from it.
        follow = 0
        while a + follow + 1 < n and follow < len(want) and ids[a + follow + 1] == want[follow]:
            follow += 1
        expected = min(follow + 1, BS - 1, n - a, len(want))
        assert valid[0].sum() == expected and valid[0, :expected].all(), (a, valid[0], follow)
        assert list(lab[0, :expected]) == want[:expected], a
        counts.append(expected)
    assert min(counts) == 1 and max(counts) >= 4  # both ends of the rule were met


def test_loss_ignores_labels_past_the_first_disagreement(loaded, draft_for):
    from dflash_mlx.training.train import loss_fn

    model, tok, folder = loaded("qwen3")
    draft = draft_for(folder, block_size=BS)
    target = Target(model)
    ids = _text(model, tok, 32)
    anchors = np.arange(0, 24, 3)
    labels, feats = greedy_labels(target, mx.array([ids]), draft.config.target_layer_ids)
    lab, valid = block_labels(np.array(ids), np.array(labels[0]), len(ids), anchors, BS)
    assert not valid.all() and valid.any()
    blocks = np.full((len(anchors), BS), draft.config.mask_token_id)
    blocks[:, 0] = np.array(ids)[anchors]
    weights = mx.ones((BS - 1,))
    args = (draft, target, feats, mx.array(blocks), mx.array(anchors))
    loss, _ = loss_fn(*args, mx.array(lab), mx.array(valid), weights)
    scrambled = np.where(valid, lab, (lab + 1) % 300)
    loss2, _ = loss_fn(*args, mx.array(scrambled), mx.array(valid), weights)
    assert abs(loss.item() - loss2.item()) < 1e-5
    loss3, _ = loss_fn(*args, mx.array((lab + 1) % 300), mx.array(valid), weights)
    assert abs(loss.item() - loss3.item()) > 1e-3


def _seqs(lengths, seed=0):
    from dflash_mlx.training.data import Sequence

    rng = np.random.default_rng(seed)
    return [Sequence(rng.integers(0, 300, size=n).tolist(), 1) for n in lengths]


def test_store_labels_workers_and_resume(loaded, tmp_path):
    """The feature store keeps each position's greedy label beside its
    features; two worker processes write the same store as one process; an
    interrupted build goes on from the batches it had finished."""
    from dflash_mlx.training.features import FeatureStore

    model, _, folder = loaded("qwen3")
    t, S, layers = Target(model), 16, [1, 3]
    seqs = _seqs([5, 20, 9, 16, 12, 7, 14, 3])
    one = FeatureStore(tmp_path / "one", seqs, t, layers, S, pad=0, batch=2)
    for i, s in enumerate(seqs):
        toks = s.tokens[:S]
        want, _ = greedy_labels(t, mx.array([toks]), layers)
        assert list(one.labels[i, : len(toks)]) == np.array(want[0]).tolist()
    two = FeatureStore(tmp_path / "two", seqs, t, layers, S, pad=0, batch=2, workers=2, model=str(folder))
    assert np.array_equal(np.asarray(two.labels), np.asarray(one.labels))
    np.testing.assert_allclose(np.asarray(two.array, np.float32), np.asarray(one.array, np.float32), atol=1e-2)

    # Interrupted after two batches of four: those are not computed again.
    class Stop(Exception):
        pass

    def stop_after(n, _):
        if n >= 4:
            raise Stop

    try:
        FeatureStore(tmp_path / "cut", seqs, t, layers, S, pad=0, batch=2, progress=stop_after)
    except Stop:
        pass
    assert not (tmp_path / "cut" / "train_features.f16").exists()
    part = np.memmap(tmp_path / "cut" / "train_features.f16.part", np.float16, "r+", shape=one.array.shape)
    done = [i for i in range(len(seqs)) if np.abs(part[i]).sum() > 0]
    assert len(done) == 4
    part[done[0]] = 7.0
    part.flush()
    del part
    seen = []
    store = FeatureStore(tmp_path / "cut", seqs, t, layers, S, pad=0, batch=2, progress=lambda n, _: seen.append(n))
    assert seen == [6, 8]  # two batches left
    assert (np.asarray(store.array[done[0]]) == 7.0).all()
    rest = [i for i in range(len(seqs)) if i != done[0]]
    np.testing.assert_allclose(np.asarray(store.array[rest], np.float32), np.asarray(one.array[rest], np.float32),
                               atol=1e-2)
    assert np.array_equal(np.asarray(store.labels), np.asarray(one.labels))
