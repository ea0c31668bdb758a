"""Bring the target's caches back to the committed prefix after a verify pass.

Plain attention caches are trimmed. Every other cache is restored from the
snapshot taken before the pass (MLX arrays are immutable, so keeping the old
state is free) and then advanced over the kept tokens only:

* gated-DeltaNet caches (``ArraysCache``): the conv state is a slice of the
  recorded conv input, the recurrent state is the gated-delta recurrence re-run
  over the kept steps; no projection or layer is run again (only the two tiny
  gate projections);
* other attention caches, e.g. the rotating caches of sliding-window layers:
  the recorded keys/values of the kept tokens are written again.
"""

from dataclasses import dataclass
from typing import Any, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, dynamic_roll
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk

from ..errors import UnsupportedModelError


def trims_exactly(cache) -> bool:
    """Whether ``cache.trim(n)`` gives exactly the state before the last n tokens."""
    return type(cache) in (KVCache, QuantizedKVCache)


@dataclass
class DeltaTape:
    """A gated-DeltaNet layer's state before a verify pass, and (through taps)
    its input and conv input during it."""

    cache: ArraysCache
    state: list
    gdn: nn.Module
    x: Any
    conv: Any

    def restore(self, keep: int) -> None:
        x, conv_input = self.x.value, self.conv.value
        self.cache[0], self.cache[1] = _replay(
            self.gdn, x[:, :keep], conv_input, self.state[1], keep
        )


@dataclass
class CacheTape:
    """An attention cache's state before a verify pass, and (through its
    stand-in) the keys/values the pass wrote."""

    cache: Any
    state: Any
    written: Any

    def restore(self, keep: int) -> None:
        keys, values = self.written.value
        self.cache.state = self.state
        self.cache.update_and_fetch(keys[..., :keep, :], values[..., :keep, :])


def check_rollback(cache: list) -> None:
    """Refuse caches that cannot be brought back exactly."""
    for c in cache:
        ok = isinstance(c, ArraysCache) or trims_exactly(c) or (
            hasattr(c, "update_and_fetch") and hasattr(c, "state")
        )
        if not ok:
            raise UnsupportedModelError(
                f"The target uses {type(c).__name__}, which dflash_mlx cannot roll "
                "back after a rejected draft token; use block_size=1 with this model."
            )


def rollback(cache: list, tape: Optional[List], keep: int, length: int) -> None:
    """Keep the first ``keep`` of the ``length`` tokens of the last verify pass."""
    drop = length - keep
    if drop <= 0:
        return
    for c in cache:
        if trims_exactly(c):
            c.trim(drop)
    for t in tape or []:
        t.restore(keep)


def _replay(gdn, x, conv_input, state, n):
    B = x.shape[0]
    K = gdn.conv_kernel_size
    conv_state = mx.contiguous(conv_input[:, n : n + K - 1])
    conv_out = nn.silu(gdn.conv1d(conv_input[:, : n + K - 1]))
    q, k, v = [
        t.reshape(B, n, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [gdn.key_dim, 2 * gdn.key_dim], -1),
            [gdn.num_k_heads, gdn.num_k_heads, gdn.num_v_heads],
            [gdn.head_k_dim, gdn.head_k_dim, gdn.head_v_dim],
        )
    ]
    q, k = normalize_qk(q, k, inv_scale=gdn.head_k_dim**-0.5, eps=1e-6)
    a, b = _gates(gdn, x)
    _, state = gated_delta_update(
        q, k, v, a, b, gdn.A_log, gdn.dt_bias, state, use_kernel=not gdn.training
    )
    return conv_state, state


def _gates(gdn, x):
    B, n, _ = x.shape
    if hasattr(gdn, "in_proj_ba"):  # Qwen3-Next packs b and a per key head
        nk, nv = gdn.num_k_heads, gdn.num_v_heads
        ba = gdn.in_proj_ba(x).reshape(B, n, nk, -1)
        b, a = mx.split(ba, [nv // nk], axis=-1)
        return a.reshape(B, n, nv), b.reshape(B, n, nv)
    if hasattr(gdn, "in_proj_a") and hasattr(gdn, "in_proj_b"):
        return gdn.in_proj_a(x), gdn.in_proj_b(x)
    raise UnsupportedModelError(
        f"Unknown gated-DeltaNet layout in {type(gdn).__module__}; cannot roll back."
    )


def rollback_rows(cache: list, drop: List[int]) -> None:
    """Drop the last ``drop[i]`` tokens of row i of batched attention caches
    (mlx-lm ``BatchKVCache``). What all rows drop is trimmed; the rest of each
    row's dropped tokens is rolled to the front of the row, where its left
    padding (masked out) grows over it. Leading padding every row has is cut."""
    low = min(drop)
    for c in cache:
        c.trim(low)
    if low == max(drop):
        return
    rest = mx.array([d - low for d in drop])
    for c in cache:
        if c.keys is None:
            continue
        n = c._idx
        c.keys = dynamic_roll(c.keys[..., :n, :], rest[:, None], axis=2)
        c.values = dynamic_roll(c.values[..., :n, :], rest[:, None], axis=2)
        c.left_padding = c.left_padding + rest
        c.offset = c.offset - rest
    pad = min(cache[0].left_padding.tolist())
    for c in cache:
        if pad and c.keys is not None:
            c.keys, c.values = c.keys[..., pad:, :], c.values[..., pad:, :]
            c._idx -= pad
            c.left_padding = c.left_padding - pad
