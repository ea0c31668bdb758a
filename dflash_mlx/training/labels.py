"""Exact training labels from one target forward pass.

The target's argmax at position p, given the text's tokens 0..p, is the token
its greedy decoding would write next. A draft block anchored at a (the token
at a, then masks) is labelled at offset k by the argmax at a + k - 1, and that
label is what greedy decoding from a would produce as long as the text's own
tokens a + 1 .. a + k - 1 equal the argmaxes before them; from the first
disagreement on the block's context is no longer greedy, so the loss stops
there. On the target's own greedy text every label counts; any other text
(code, documents, sampled answers) still gives its first exact slots, at the
cost of a forward pass and no decoding. The same pass gives the features.
"""

from typing import List, Tuple

import mlx.core as mx
import numpy as np

from .fastmath import numpy_exp


def greedy_labels(target, tokens: mx.array, layer_ids: List[int]) -> Tuple[mx.array, mx.array]:
    """(labels [B, S] int32, features [B, S, n*H]) of a batch ``tokens`` [B, S]:
    label p is the target's greedy next token after tokens 0..p."""
    with numpy_exp(target.model):
        logits, features = target.hidden(tokens, layer_ids)
    return mx.argmax(logits, axis=-1).astype(mx.int32), features


def block_labels(tokens: np.ndarray, labels: np.ndarray, n: int, anchors: np.ndarray,
                 block_size: int) -> Tuple[np.ndarray, np.ndarray]:
    """(labels, valid) [len(anchors), block_size - 1] of the blocks anchored
    at ``anchors`` in one sequence of ``n`` tokens (``tokens`` and its greedy
    ``labels``, at least ``n`` long): a label is valid while the text before it
    in the block follows the greedy labels."""
    k = np.arange(1, block_size)
    at = anchors[:, None] + k[None] - 1  # where label k is read
    inside = at < n
    lab = labels[np.minimum(at, n - 1)]
    agree = np.zeros(n + block_size, dtype=bool)
    agree[1:n] = tokens[1:n] == labels[: n - 1]  # token p is the greedy one after p - 1
    follows = agree[at[:, :-1] + 1]  # token a + j follows the greedy labels, j = 1 .. bs-2
    run = np.concatenate([np.ones((len(anchors), 1), bool), np.cumprod(follows, axis=1).astype(bool)], axis=1)
    return lab.astype(np.int32), inside & run
