"""Token choice and the acceptance rule.

The draft proposes its argmax (a one-hot q). The target samples its own token
y_i at every block offset, independently, from exactly the distribution plain
decoding would use; draft token d_{i+1} is accepted iff it equals y_i, and the
first y that differs is the bonus. That is the same law as "accept d with
probability p(d), else sample p without d", so the output follows the target's
distribution exactly, for any sampler, and greedy is the temperature-0 case.
"""

from typing import Callable, List, Optional

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

Sampler = Callable[[mx.array], mx.array]


def make_sampler(
    temp: float = 0.0,
    top_p: float = 0.0,
    min_p: float = 0.0,
    top_k: int = 0,
    seed: Optional[int] = None,
) -> Sampler:
    """A sampler over rows of log-probabilities [N, V] -> tokens [N], with the
    filters and temperature of ``mlx_lm.sample_utils.make_sampler``. With a
    ``seed`` it draws from its own key, leaving MLX's global RNG untouched."""
    if temp == 0:
        return lambda logprobs: mx.argmax(logprobs, axis=-1)
    filters = []
    if 0 < top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, top_p))
    if min_p != 0.0:
        filters.append(lambda x: apply_min_p(x, min_p))
    if top_k > 0:
        filters.append(lambda x: apply_top_k(x, top_k))
    key = mx.random.key(seed) if seed is not None else None

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        for f in filters:
            logprobs = f(logprobs)
        sub = None
        if key is not None:
            key, sub = mx.random.split(key)
        return mx.random.categorical(logprobs * (1.0 / temp), key=sub)

    return sample


def process(
    logits: mx.array,
    history: mx.array,
    block: mx.array,
    processors: Optional[List[Callable]],
) -> mx.array:
    """Log-probabilities of ``logits`` [L, V], after the logits processors,
    row i seeing ``history`` plus the first i + 1 tokens of ``block``."""
    if processors:
        rows = []
        for i in range(logits.shape[0]):
            row = logits[i : i + 1]
            seen = mx.concatenate([history, block[: i + 1]])
            for p in processors:
                row = p(seen, row)
            rows.append(row)
        logits = mx.concatenate(rows, axis=0)
    # Same dtype and arithmetic as mlx-lm, so greedy ties break the same way.
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def greedy(logits: mx.array):
    """Argmax of float32 logit rows [L, V] without the log-softmax, and a flag
    set when :func:`process`'s rounding could pick another token (a runner-up
    within 2**-17 of a row's top, or a non-finite top): then use the exact path.

    Log-probabilities of near-top tokens lie in (-16, 0], where float32 steps
    are at most 2**-20, so subtracting the row's log-sum-exp cannot merge or
    reorder logits further apart than that. Skipping it saves an exp per entry,
    which dominates a 16-row verification on a CPU."""
    top = logits.max(axis=-1, keepdims=True)
    close = (logits >= top - 2.0**-17).sum(axis=-1) > 1
    return mx.argmax(logits, axis=-1), close.any() | ~mx.isfinite(top).all()


def accepted(draft: mx.array, target: mx.array) -> mx.array:
    """How many draft tokens [L-1] match the target's choices [L], as a prefix."""
    match = (draft == target[: draft.shape[0]]).astype(mx.int32)
    return mx.cumprod(match).sum()
