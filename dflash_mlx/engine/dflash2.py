"""The DFlash2 draft (``DFlash2DraftModel``): DFlash layers wrapped in grouped
dynamic causal convolutions, logits scaled and softcapped, and a candidate
selector that walks each offset's top-k with a low-rank bigram score.

The round, rollback and acceptance rules are the DFlash ones: the selector
only decides which row entry is the proposal, as argmax of the rows returned.
"""

from typing import Callable, List

import mlx.core as mx
import mlx.nn as nn

from ..models.config import DFlashConfig
from .draft import DFlashDraft, DraftLayer


def _convolve(x: mx.array, dyn: mx.array, base: mx.array, group: int) -> mx.array:
    """Causal depthwise convolution along the block: tap ``o`` of channel c in
    group g weighs x[t - o] by base[o, c] + dyn[t, o, g] (zeros before t = 0)."""
    B, L, D = x.shape
    K, G = base.shape[0], D // group
    xs = x.reshape(B, L, G, group)
    out = mx.zeros_like(xs)
    for o in range(min(K, L)):
        tap = xs if o == 0 else mx.pad(xs[:, : L - o], [(0, 0), (o, 0), (0, 0), (0, 0)])
        w = base[o].reshape(G, group).astype(x.dtype) + dyn[:, :, o, :, None]
        out = out + w * tap
    return out.reshape(B, L, D)


class DynamicConv(nn.Module):
    """Two convolutions around a sublayer, their per-group taps predicted
    from the sublayer's input."""

    def __init__(self, dim: int, kernel: int, group: int):
        super().__init__()
        self.kernel, self.group = kernel, group
        self.base_kernel = mx.zeros((2, kernel, dim))
        self.kernel_projection = nn.Linear(dim, 2 * kernel * (dim // group), bias=False)

    def prepare(self, x: mx.array):
        """(the convolved input, the taps kept for :meth:`finish`)."""
        B, L, D = x.shape
        dyn = self.kernel_projection(x).reshape(B, L, 2, self.kernel, D // self.group)
        return _convolve(x, dyn[:, :, 0], self.base_kernel[0], self.group), dyn[:, :, 1]

    def finish(self, y: mx.array, dyn: mx.array) -> mx.array:
        return _convolve(y, dyn, self.base_kernel[1], self.group)


class DFlash2Layer(DraftLayer):
    def __init__(self, cfg: DFlashConfig, layer: int):
        super().__init__(cfg, layer)
        p, H = cfg.dflash2, cfg.hidden_size
        self.attention_conv = DynamicConv(H, p.conv_kernel_size, p.conv_group_size)
        self.mlp_conv = DynamicConv(H, p.conv_kernel_size, p.conv_group_size)

    def __call__(self, x, ctx, cache=None, anchors=None, skip=0, shift=0):
        a, dyn = self.attention_conv.prepare(self.input_layernorm(x))
        h = x + self.attention_conv.finish(self.self_attn(a, ctx, cache, anchors, skip, shift), dyn)
        m, dyn = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(m), dyn)


class CandidateSelector(nn.Module):
    """Rescores each offset's top-k logits with a bigram term, given the token
    chosen before it: <pred[prev] * proj(h), succ[candidate]>."""

    def __init__(self, dim: int, vocab: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.hidden_projection = nn.Linear(dim, rank, bias=False)
        self.predecessor_codebook = mx.zeros((vocab, rank))
        self.successor_codebook = mx.zeros((vocab, rank))

    def __call__(self, logits: mx.array, hidden: mx.array, anchor: mx.array) -> mx.array:
        """Rows [n, V]: -inf but at each offset's candidates, which hold their
        scores given the previous offset's choice (the greedy walk from the
        anchor), so that each row's argmax is the walk's token."""
        n, k = logits.shape[0], self.top_k
        cand = mx.argpartition(logits, -k, axis=-1)[:, -k:]
        unary = mx.take_along_axis(logits, cand, axis=-1).astype(mx.float32)
        proj = self.hidden_projection(hidden[0]).astype(mx.float32)
        succ = self.successor_codebook[cand].astype(mx.float32)  # [n, k, R]
        prev, scores = anchor.reshape(1), []
        for i in range(n):
            ctx = self.predecessor_codebook[prev].astype(mx.float32) * proj[i]  # [1, R]
            s = unary[i] + (succ[i] @ ctx[0])
            scores.append(s)
            prev = cand[i][mx.argmax(s)].reshape(1)
        rows = mx.full((n, logits.shape[-1]), -mx.inf, mx.float32)
        return mx.put_along_axis(rows, cand, mx.stack(scores), axis=-1)


class DFlash2Draft(DFlashDraft):
    """A DFlash2 draft: DFlash's context and block attention (every layer
    non-causal inside the block, sliding over the context), each sublayer
    between two dynamic convolutions, and a candidate selector that picks
    the proposals from the top-k of logits scaled by ``output_multiplier``
    and softcapped."""

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        p = config.dflash2
        self.layers: List[DFlash2Layer] = [DFlash2Layer(config, i) for i in range(config.num_hidden_layers)]
        self.candidate_selector = CandidateSelector(
            config.hidden_size, config.vocab_size, p.selector_rank, p.selector_top_k
        )

    def __call__(self, x, features, cache=None, anchors=None, shift=0):
        scale = self.config.dflash2.input_embedding_scale
        return super().__call__(x * scale if scale != 1.0 else x, features, cache, anchors, shift)

    def logits(self, hidden: mx.array, head: Callable[[mx.array], mx.array]) -> mx.array:
        p = self.config.dflash2
        x = head(hidden)[0].astype(mx.float32) * p.output_multiplier
        cap = p.final_logit_softcapping
        return mx.tanh(x / cap) * cap if cap else x

    def select(self, logits: mx.array, hidden: mx.array, anchor: mx.array) -> mx.array:
        return self.candidate_selector(logits, hidden, anchor)
