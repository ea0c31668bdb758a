"""Bring the target's caches back to the committed prefix after a verify pass.

Attention caches are trimmed. Gated-DeltaNet caches (``ArraysCache``) are
rebuilt from the pre-verify snapshot: the conv state is a slice of the recorded
conv input, the recurrent state is the gated-delta recurrence re-run over the
committed steps only. No layer is run a second time except these two cheap
pieces (and the two tiny gate projections).
"""

from typing import List

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk

from .errors import UnsupportedModelError


def check_rollback(cache: list) -> None:
    """Refuse caches that cannot be brought back exactly."""
    for c in cache:
        if isinstance(c, ArraysCache):
            continue
        if not (hasattr(c, "trim") and c.is_trimmable()):
            raise UnsupportedModelError(
                f"The target uses {type(c).__name__}, which cannot be trimmed back "
                "after a rejected draft token; use block_size=1 with this model."
            )


def rollback(cache: list, tape: List, keep: int, length: int) -> None:
    """Keep the first ``keep`` of the ``length`` tokens of the last verify pass."""
    drop = length - keep
    if drop <= 0:
        return
    for c in cache:
        if not isinstance(c, ArraysCache):
            c.trim(drop)
    for c, snapshot, gdn, x, conv_input in tape or []:
        c[0], c[1] = _replay(gdn, x[:, :keep], conv_input, snapshot[1], keep)


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
