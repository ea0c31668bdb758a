"""The data engine's numpy softmax and SwiGLU: the same features and labels
as MLX's own forward pass, on real mlx-lm architectures, and the swap undone."""

import sys

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx.engine.target import Target
from dflash_mlx.training import fastmath
from mlx_lm.models import activations, base


@pytest.mark.parametrize("arch", ["qwen3", "llama", "gemma4", "gpt_oss", "qwen3_5"])
def test_numpy_exp_keeps_the_forward(loaded, arch):
    model, tok, _ = loaded(arch)
    target = Target(model)
    ids = mx.array(np.random.RandomState(0).randint(0, 300, (2, 40)))
    layers = [1, 3]
    want_logits, want = target.hidden(ids, layers)
    mod = sys.modules[type(model.model if hasattr(model, "model") else model).__module__]
    with fastmath.numpy_exp(model):
        if arch in ("qwen3", "llama"):  # these take the numpy path
            assert mod.scaled_dot_product_attention is fastmath.attention
            assert mod.swiglu is fastmath.swiglu
        logits, got = target.hidden(ids, layers)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.array(logits), np.array(want_logits), rtol=1e-4, atol=1e-4)
    assert getattr(mod, "scaled_dot_product_attention", base.scaled_dot_product_attention) \
        is base.scaled_dot_product_attention
    assert getattr(mod, "swiglu", activations.swiglu) is activations.swiglu


def test_attention_masks_match_mlx():
    rng = np.random.RandomState(1)
    q, k, v = (mx.array(rng.randn(2, h, 6, 8).astype(np.float32)) for h in (4, 2, 2))
    keep = mx.array(rng.rand(6, 6) > 0.3) | mx.eye(6, dtype=mx.bool_)
    add = mx.where(keep, 0.0, -1e9)
    for mask in ("causal", None, keep, add, keep[None, None]):
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask)
        got = fastmath.attention(q, k, v, None, 0.3, mask)
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)


def test_swap_is_undone_after_an_error(loaded):
    model, _, _ = loaded("qwen3")
    mod = sys.modules[type(model.model).__module__]
    with pytest.raises(RuntimeError):
        with fastmath.numpy_exp(model):
            raise RuntimeError("stop")
    assert mod.scaled_dot_product_attention is base.scaled_dot_product_attention
    assert mod.swiglu is activations.swiglu


def test_values_and_gradients_match_mlx():
    import mlx.nn as nn

    rng = np.random.RandomState(2)
    x = mx.array(rng.randn(3, 5, 40).astype(np.float32) * 4)
    w = mx.array(rng.randn(3, 5, 40).astype(np.float32))
    labels = mx.array(rng.randint(0, 40, (3, 5)))
    pairs = [
        (lambda x: (fastmath.softmax(x) * w).sum(), lambda x: (mx.softmax(x, axis=-1) * w).sum()),
        (lambda x: (fastmath.swiglu(x, w) * w).sum(), lambda x: (activations.swiglu(x, w) * w).sum()),
        (lambda x: fastmath.cross_entropy(x, labels).sum(),
         lambda x: nn.losses.cross_entropy(x, labels, reduction="none").sum()),
    ]
    for ours, theirs in pairs:
        (v, g), (v0, g0) = mx.value_and_grad(ours)(x), mx.value_and_grad(theirs)(x)
        np.testing.assert_allclose(float(v), float(v0), rtol=1e-5)
        np.testing.assert_allclose(np.array(g), np.array(g0), rtol=1e-4, atol=1e-5)


def test_draft_training_loss_and_gradients_match(loaded, draft_for):
    """The draft's training loss and its gradients, with its own attention and
    SwiGLU swapped too."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from dflash_mlx.engine import draft as draft_module
    from dflash_mlx.training.train import block_logits

    model, tok, folder = loaded("qwen3")
    draft = draft_for(folder, block_size=4)
    target = Target(model)
    ids = mx.array(np.random.RandomState(3).randint(0, 300, (2, 24)))
    _, feats = target.hidden(ids, draft.config.target_layer_ids)
    anchors = mx.array([2, 9, 15, 3, 8, 19])
    blocks = mx.array(np.random.RandomState(4).randint(0, 300, (6, 4)))
    labels = mx.array(np.random.RandomState(5).randint(0, 300, (6, 3)))

    def loss(d, ce):
        return ce(block_logits(d, target, feats, blocks, anchors), labels).mean()

    mlx_ce = lambda l, y: nn.losses.cross_entropy(l, y, reduction="none")
    v0, g0 = nn.value_and_grad(draft, lambda: loss(draft, mlx_ce))()
    with fastmath.numpy_exp(model, draft):
        assert draft_module.attend is fastmath.draft_attention
        v, g = nn.value_and_grad(draft, lambda: loss(draft, fastmath.cross_entropy))()
    assert draft_module.attend is not fastmath.draft_attention
    np.testing.assert_allclose(float(v), float(v0), rtol=1e-5)
    for (k, a), (_, b) in zip(tree_flatten(g), tree_flatten(g0)):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-3, atol=1e-5, err_msg=k)
