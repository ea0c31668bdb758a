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
