"""Faster training on MLX-CPU: the exps of softmax, SwiGLU and cross entropy
done by numpy.

MLX-CPU's ``exp`` runs ~30x slower than numpy's (87 against 3 ms over the
5.3M attention scores of one SmolLM2 layer on 4 x 384 tokens), and making
training data and training a draft spend much of their time there: in the
attention softmax, the SwiGLU gate and the loss. The functions here compute
those exps with numpy, agree with MLX's to float32 rounding, and are
differentiable (their gradients need no exp or take it from numpy too).
Because they are not bit for bit MLX's, only training runs them, never DFlash
decoding: :func:`numpy_exp` swaps them into a model's modules for its scope
and always puts MLX's back, only on the CPU. The swap is per module, so while
it lasts another model of the same architecture in this process (say, one
decoding on another thread) would run them too: training and serving belong
in separate processes.
"""

import sys
import threading
from contextlib import contextmanager
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import activations, base

_lock = threading.Lock()
_FLOATS = (mx.float32, mx.float16)


def _np(x: mx.array) -> np.ndarray:
    return np.asarray(x.astype(mx.float32))


def _one(primals) -> mx.array:
    # MLX hands a one-argument function's primals to its vjp unwrapped.
    return primals[0] if isinstance(primals, (tuple, list)) else primals


@mx.custom_function
def softmax(x: mx.array) -> mx.array:
    """Softmax over the last axis."""
    a = _np(x)
    e = np.exp(a - a.max(axis=-1, keepdims=True))
    e /= e.sum(axis=-1, keepdims=True)
    return mx.array(e).astype(x.dtype)


@softmax.vjp
def _softmax_vjp(primals, cotangent, output):
    return (output * (cotangent - (cotangent * output).sum(axis=-1, keepdims=True)),)


@mx.custom_function
def silu(x: mx.array) -> mx.array:
    a = _np(x)
    return mx.array(a / (1.0 + np.exp(-a))).astype(x.dtype)


@silu.vjp
def _silu_vjp(primals, cotangent, output):
    x = _one(primals)
    a = _np(x)
    s = 1.0 / (1.0 + np.exp(-a))
    return (cotangent * mx.array(s * (1.0 + a * (1.0 - s))).astype(cotangent.dtype),)


@mx.custom_function
def logsumexp(x: mx.array) -> mx.array:
    """log(sum(exp(x))) over the last axis."""
    a = _np(x)
    m = a.max(axis=-1, keepdims=True)
    return mx.array((m + np.log(np.exp(a - m).sum(axis=-1, keepdims=True)))[..., 0])


@logsumexp.vjp
def _logsumexp_vjp(primals, cotangent, output):
    x = _one(primals)
    p = np.exp(_np(x) - np.asarray(output)[..., None])
    return (mx.array(p).astype(x.dtype) * cotangent[..., None],)


def cross_entropy(logits: mx.array, labels: mx.array) -> mx.array:
    """``nn.losses.cross_entropy(logits, labels, reduction="none")``."""
    if mx.default_device() != mx.cpu:
        return nn.losses.cross_entropy(logits, labels, reduction="none")
    return logsumexp(logits) - mx.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """``silu(gate) * x``."""
    if gate.dtype not in _FLOATS:
        return activations.swiglu(gate, x)
    return silu(gate) * x


def attention(queries, keys, values, cache, scale: float, mask, sinks=None) -> mx.array:
    """mlx-lm's ``scaled_dot_product_attention`` with :func:`softmax`, for
    float32/float16 inputs without sinks or a quantized cache."""
    if hasattr(cache, "bits") or sinks is not None or queries.dtype not in _FLOATS:
        return base.scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks)
    B, H, L, D = queries.shape
    Hk, S = keys.shape[1], keys.shape[2]
    q = (queries * scale).reshape(B, Hk, H // Hk, L, D)  # grouped-query heads share a key
    s = q @ keys[:, :, None].swapaxes(-1, -2)
    if isinstance(mask, str):
        mask = mx.arange(S)[None] <= mx.arange(S - L, S)[:, None]
    if mask is not None:
        mask = mask[:, :, None] if mask.ndim == 4 else mask
        s = mx.where(mask, s, -mx.inf) if mask.dtype == mx.bool_ else s + mask
    return (softmax(s) @ values[:, :, None]).reshape(B, H, L, -1)


def draft_attention(q, keys, values, scale: float, mask) -> mx.array:
    return attention(q, keys, values, None, scale, mask)


def _swaps() -> dict:
    from ..engine import draft

    return {"scaled_dot_product_attention": (base.scaled_dot_product_attention, attention),
            "swiglu": (activations.swiglu, swiglu), "attend": (draft.attend, draft_attention)}


@contextmanager
def numpy_exp(*models: Optional[nn.Module]):
    """Run the forward passes (and their gradients) of ``models`` with the
    softmax and SwiGLU above (on the CPU; elsewhere nothing changes)."""
    models = [m for m in models if m is not None]
    if not models or mx.default_device() != mx.cpu:
        yield
        return
    mods = {sys.modules[type(m).__module__] for model in models for _, m in model.named_modules()}
    swaps = _swaps()
    with _lock:
        swapped = []
        try:
            for mod in mods:
                for name, (old, new) in swaps.items():
                    if getattr(mod, name, None) is old:
                        setattr(mod, name, new)
                        swapped.append((mod, name, old))
            yield
        finally:
            for mod, name, old in swapped:
                setattr(mod, name, old)
