"""The DFlash draft model: Qwen3-style layers whose keys/values also see the
target's context features, and a bidirectional block of mask tokens."""

import math
from typing import Callable, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope

from ..models.config import DFlashConfig
from .sampling import shifted


class Attention(nn.Module):
    def __init__(self, cfg: DFlashConfig, window: Optional[int] = None):
        super().__init__()
        dim, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.scale = hd**-0.5
        self.window = window
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, dim, bias=bias)
        self.q_norm = nn.RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.rope = initialize_rope(
            hd,
            base=cfg.rope_theta,
            traditional=False,
            scaling_config=cfg.rope_scaling,
            max_position_embeddings=cfg.max_position_embeddings,
        )

    def _kv(self, x):
        B, L, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, -1))
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1)
        return k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

    @property
    def reach(self) -> Optional[int]:
        """Context positions a block query attends back to (None: all)."""
        return None if self.window is None else max(self.window - 1, 1)

    def __call__(self, x, ctx, cache=None, anchors=None, skip=0, shift=0):
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1))
        q = q.transpose(0, 2, 1, 3)
        if cache is None:
            return self._train(q, x, ctx, anchors)
        # Context and block K/V in one projection, stored together; the block's
        # entries are dropped again once attended (only context is cached).
        k, v = self._kv(mx.concatenate([ctx, x], axis=1))
        if skip:  # context that slid out of the window before it was read: zeros hold its place
            z = mx.zeros((B, self.n_kv_heads, skip, k.shape[-1]), k.dtype)
            cache.update_and_fetch(z, z)
        start = cache.offset + shift  # the positions in gaps are not in the cache
        pos = start + ctx.shape[1]
        keys, values = cache.update_and_fetch(self.rope(k, offset=start), v)
        cache.trim(L)
        mask = None
        if self.window is not None:
            # Block queries reach back at most window-1 context positions.
            n = min(keys.shape[2] - L, self.reach)
            keys, values = keys[:, :, -(n + L) :], values[:, :, -(n + L) :]
            qpos = mx.arange(pos, pos + L)
            mask = _block_mask(qpos[None], mx.arange(pos - n, pos), None, self.window, L)
        return self._attend(self.rope(q, offset=pos), keys, values, mask)

    def read(self, ctx, cache, shift=0):
        """Cache the context ``ctx`` without a block."""
        k, v = self._kv(ctx)
        cache.update_and_fetch(self.rope(k, offset=cache.offset + shift), v)

    def _train(self, q, x, ctx, anchors):
        """ctx is the whole sequence; x holds one block per anchor."""
        kb, vb = self._kv(x)
        kc, vc = self._kv(ctx)
        S = kc.shape[2]
        n = x.shape[0] // kc.shape[0]
        kc = mx.repeat(self.rope(kc), n, axis=0)
        vc = mx.repeat(vc, n, axis=0)
        qpos = anchors[:, None] + mx.arange(x.shape[1])
        mask = _block_mask(qpos, mx.arange(S), anchors, self.window, x.shape[1])
        keys = mx.concatenate([kc, self.rope(kb, offset=anchors)], axis=2)
        values = mx.concatenate([vc, vb], axis=2)
        return self._attend(self.rope(q, offset=anchors), keys, values, mask)

    def _attend(self, q, keys, values, mask):
        B, _, L, _ = q.shape
        out = attend(q, keys, values, self.scale, mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def attend(q, keys, values, scale: float, mask) -> mx.array:
    # A module-level name, so that training can swap in a cheaper softmax.
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)


def _block_mask(qpos, kpos, anchors, window, L):
    """[B, 1, L, C + L] boolean mask: context keys before the anchor (and inside
    the window, if any), then the whole block."""
    ok = mx.ones((qpos.shape[0], L, kpos.shape[0]), dtype=mx.bool_)
    if anchors is not None:
        ok = ok & (kpos[None, None] < anchors[:, None, None])
    if window is not None:
        ok = ok & (qpos[..., None] - kpos[None, None] < window)
    block = mx.ones((qpos.shape[0], L, L), dtype=mx.bool_)
    return mx.concatenate([ok, block], axis=-1)[:, None]


def confidence(logits: mx.array) -> mx.array:
    """The draft's top probability at each offset, from its logits [N, V],
    within 0.02: each exp is a power of 2 read from float32 bits
    (2**y ~ 2**floor(y) * (1 + frac(y))), a third of mx.exp's time on
    MLX-CPU; the denoising order reads it."""
    y = shifted(logits) * (math.log2(math.e) * 2**23) + 127 * 2**23
    return 1 / mx.maximum(y, 0).astype(mx.int32).view(mx.float32).sum(axis=-1)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)

    def __call__(self, x):
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer: int):
        super().__init__()
        window = cfg.sliding_window if cfg.is_sliding(layer) else None
        self.self_attn = Attention(cfg, window)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(
            cfg.hidden_size, eps=cfg.rms_norm_eps
        )

    def __call__(self, x, ctx, cache=None, anchors=None, skip=0, shift=0):
        h = x + self.self_attn(self.input_layernorm(x), ctx, cache, anchors, skip, shift)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraft(nn.Module):
    """A DFlash block-diffusion draft.

    It owns no embedding and no LM head: ``__call__`` takes the target's
    embedded block and returns hidden states; the caller applies the target's
    head (see :meth:`propose`).
    """

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        H, n = config.hidden_size, len(config.target_layer_ids)
        self.fc = nn.Linear(n * H, H, bias=False)
        self.hidden_norm = nn.RMSNorm(H, eps=config.rms_norm_eps)
        self.layers = [DraftLayer(config, i) for i in range(config.num_hidden_layers)]
        self.norm = nn.RMSNorm(H, eps=config.rms_norm_eps)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def make_cache(self) -> List[KVCache]:
        """One context K/V cache per layer (block K/V are never cached)."""
        return [KVCache() for _ in self.layers]

    def context(self, features: mx.array) -> mx.array:
        """Project concatenated target features [B, S, n*H] to the context c."""
        return self.hidden_norm(self.fc(features))

    def __call__(
        self,
        x: mx.array,
        features: Optional[mx.array],
        cache: Optional[List[KVCache]] = None,
        anchors: Optional[mx.array] = None,
        shift: int = 0,
    ) -> mx.array:
        """Hidden states of the block ``x`` (already embedded), given the new
        target features (or None). With ``cache`` the features extend the
        cached context and the block sits right after it (``shift``: context
        positions missing from the cache, gaps); without, ``anchors`` gives
        each block's position in the feature sequence (training)."""
        # With every layer sliding, new context older than the window (a long
        # prompt) is never attended: only its place in the caches is kept.
        reach = [layer.self_attn.reach for layer in self.layers]
        skip = 0
        if cache is not None and None not in reach and features is not None:
            skip = max(features.shape[1] - max(reach), 0)
            features = features[:, skip:]
        # No new features (a later denoising pass, or none since a gap): skip
        # fc, whose quantized matmul cannot take zero rows.
        ctx = self.context(features) if features is not None and features.shape[1] else x[:, :0]
        caches = cache if cache is not None else [None] * len(self.layers)
        for layer, c in zip(self.layers, caches):
            x = layer(x, ctx, c, anchors, skip, shift)
        return self.norm(x)

    def read(self, features: mx.array, cache: List[KVCache], shift: int = 0) -> None:
        """Read new target features into ``cache`` (a draft whose layers all
        see the whole context), lazily, with no block to propose."""
        ctx = self.context(features)
        for layer, c in zip(self.layers, cache):
            layer.self_attn.read(ctx, c, shift)

    def propose(
        self,
        anchor: mx.array,
        features: Optional[mx.array],
        cache: List[KVCache],
        embed: Callable[[mx.array], mx.array],
        head: Callable[[mx.array], mx.array],
        block_size: int,
        steps: int = 1,
        vocab: Optional[mx.array] = None,
        shift: int = 0,
    ) -> mx.array:
        """Logits [block_size - 1, V] for the block after ``anchor`` (a 1-element
        int array), whose position is the cached context length (plus
        ``shift``, the positions missing from the cache).

        With ``steps`` K > 1 the draft denoises the block in K passes: after
        pass k its surest guesses fill k/K of the positions (the ones kept
        before stay, their logits too) and the rest are masked again for the
        next pass. ``vocab`` maps rows of ``head`` to token ids (a draft
        vocabulary)."""
        n = block_size - 1
        mask = mx.full((n,), self.config.mask_token_id, anchor.dtype)
        tokens, kept, logits = mask, mx.zeros((n,), mx.bool_), None
        for k in range(1, steps + 1):
            block = mx.concatenate([anchor.reshape(1), tokens])[None]
            hidden = self(embed(block), features, cache, shift=shift)[:, 1:]
            new = self.logits(hidden, head)
            features = None  # read into the cache by the first pass
            logits = new if logits is None else mx.where(kept[:, None], logits, new)
            if k == steps:
                break
            sure = confidence(logits)
            rank = mx.argsort(mx.argsort(mx.where(kept, -2.0, -sure)))
            kept = rank < n * k // steps
            guess = mx.argmax(logits, axis=-1)
            guess = (vocab[guess] if vocab is not None else guess).astype(anchor.dtype)
            tokens = mx.where(kept, guess, mask)
        return self.select(logits, hidden, anchor)

    def logits(self, hidden: mx.array, head: Callable[[mx.array], mx.array]) -> mx.array:
        """The proposal rows [n, V] of the block's hidden states [1, n, H]."""
        return head(hidden)[0]

    def select(self, logits: mx.array, hidden: mx.array, anchor: mx.array) -> mx.array:
        """The rows whose argmax is each offset's proposal (here the logits)."""
        return logits
