"""Token choice and the acceptance rule.

The draft proposes its argmax (a one-hot q). The target samples its own token
y_i at every block offset, independently, from exactly the distribution plain
decoding would use; draft token d_{i+1} is accepted iff it equals y_i, and the
first y that differs is the bonus. That is the same law as "accept d with
probability p(d), else sample p without d", so the output follows the target's
distribution exactly, for any sampler, and greedy is the temperature-0 case.
"""

import math
from typing import Callable, List, Optional

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

Sampler = Callable[[mx.array], mx.array]


def exp(x: mx.array) -> mx.array:
    """exp(x) as a power of 2: on MLX-CPU mx.exp takes about twice as long,
    on every row of every round."""
    return mx.power(2.0, x * math.log2(math.e))


def exp_shifted(x: mx.array) -> mx.array:
    """exp(x - max(x)) along the last axis, in float32."""
    x = x.astype(mx.float32)
    return exp(x - x.max(axis=-1, keepdims=True))


def softmax(x: mx.array) -> mx.array:
    """Softmax along the last axis (see :func:`exp_shifted`)."""
    e = exp_shifted(x)
    return e / e.sum(axis=-1, keepdims=True)


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
    filters = _filters(top_p, min_p, top_k)
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


def _filters(top_p: float, min_p: float, top_k: int) -> List[Callable]:
    filters = []
    if 0 < top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, top_p))
    if min_p != 0.0:
        filters.append(lambda x: apply_min_p(x, min_p))
    if top_k > 0:
        filters.append(lambda x: apply_top_k(x, top_k))
    return filters


def make_distribution(
    temp: float = 0.0, top_p: float = 0.0, min_p: float = 0.0, top_k: int = 0
) -> Callable[[mx.array], mx.array]:
    """The probabilities [N, V] that :func:`make_sampler`'s sampler draws
    from, given log-probability rows (or logits: the filters and the softmax
    ignore a shift); at temperature 0 the plain softmax."""
    if temp == 0:
        return softmax
    filters = _filters(top_p, min_p, top_k)

    def dist(logprobs: mx.array) -> mx.array:
        # Log-probabilities up to a constant, in float32: raw bf16 logits
        # divided by the temperature would round coarsely, and top-p's exp
        # would overflow on logits above ~88.
        x = logprobs.astype(mx.float32)
        x = x - x.max(axis=-1, keepdims=True)
        for f in filters:
            x = f(x)
        # The filters keep the top entry: the row maximum is still 0.
        e = exp(x * (1.0 / temp))
        return e / e.sum(axis=-1, keepdims=True)

    return dist


class Keys:
    """A private stream of random keys (``None`` each time without a seed:
    MLX's global generator). ``salt`` separates streams of one seed."""

    def __init__(self, seed: Optional[int], salt: int):
        self.key = mx.random.key(seed * 3 + salt) if seed is not None else None

    def __call__(self):
        if self.key is None:
            return None
        self.key, sub = mx.random.split(self.key)
        return sub


def near_top(probs: mx.array, draft: mx.array, threshold: float) -> mx.array:
    """For draft tokens [L-1]: is each one's probability (rows of ``probs``)
    at least ``threshold`` times its row's top probability?"""
    n = draft.shape[0]
    pd = mx.take_along_axis(probs[:n], draft[:, None].astype(mx.int32), axis=-1)[:, 0]
    return pd >= threshold * probs[:n].max(axis=-1)


def speculative(p: mx.array, q: mx.array, draft: mx.array, key=None, also: Optional[mx.array] = None):
    """Speculative sampling of draft tokens [L-1] drawn from the rows of
    ``q`` [L-1, V], against the target's probabilities ``p`` [L, V]: accept
    each with probability min(1, p/q); at the first rejection draw the bonus
    from normalise(max(0, p - q)), after all from the last row of ``p``.
    Drafts flagged in ``also`` are accepted regardless (not exact then).
    Returns (tokens [L], accepted count): the accepted drafts, then the bonus."""
    n = draft.shape[0]
    draft = draft.astype(mx.int32)
    k1, k2 = mx.random.split(key) if key is not None else (None, None)
    pd = mx.take_along_axis(p[:n], draft[:, None], axis=-1)[:, 0]
    qd = mx.take_along_axis(q, draft[:, None], axis=-1)[:, 0]
    ok = mx.random.uniform(shape=(n,), key=k1) * qd < pd
    if also is not None:
        ok = ok | also
    a = mx.cumprod(ok.astype(mx.int32)).sum()
    rest = mx.concatenate([mx.maximum(p[:n] - q, 0.0), p[n:]])[a]
    # rest is all zero only where p == q, which never rejects; guard anyway.
    rest = mx.where(rest.sum() > 0, rest, p[a])
    bonus = mx.random.categorical(mx.log(rest), key=k2)
    tokens = mx.concatenate([draft, bonus.reshape(1).astype(mx.int32)])
    return mx.where(mx.arange(n + 1) < a, tokens, bonus.astype(mx.int32)), a


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


def accepted(draft: mx.array, target: mx.array, also: Optional[mx.array] = None) -> mx.array:
    """How many draft tokens [L-1] match the target's choices [L] (or are
    flagged in ``also``), as a prefix."""
    match = draft == target[: draft.shape[0]]
    if also is not None:
        match = match | also
    return mx.cumprod(match.astype(mx.int32)).sum()
