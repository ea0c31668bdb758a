"""Token choice and the acceptance rule.

The target chooses its own token at every block offset, from exactly the
distribution plain decoding uses; a draft token is accepted iff it equals the
target's choice there, and the first choice that differs is the bonus.
Seeded sampling (and any under mlx.launch) draws with Gumbel noise keyed by
the seed and the token's position (:class:`Noise`), so a token is the same
whichever round, block length or process draws it; a draft that samples then
draws with the same noise. Otherwise a sampled draft is verified with the p/q
rule instead (:func:`speculative`), which accepts more but draws per round.
"""

import math
import random
from typing import Callable, List, Optional

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

Sampler = Callable[[mx.array], mx.array]


def exp(x: mx.array) -> mx.array:
    """exp(x) as a power of 2: on MLX-CPU mx.exp takes about twice as long,
    on every row of every round."""
    return mx.power(2.0, x * math.log2(math.e))


def softmax(x: mx.array) -> mx.array:
    """Softmax along the last axis, in float32."""
    e = exp(shifted(x))
    return e / e.sum(axis=-1, keepdims=True)


def make_sampler(temp: float = 0.0, top_p: float = 0.0, min_p: float = 0.0, top_k: int = 0) -> Sampler:
    """A sampler over rows of log-probabilities [N, V] -> tokens [N], with the
    filters and temperature of ``mlx_lm.sample_utils.make_sampler`` (MLX's
    global generator)."""
    if temp == 0:
        return lambda logprobs: mx.argmax(logprobs, axis=-1)
    filters = _filters(top_p, min_p, top_k)

    def sample(logprobs: mx.array) -> mx.array:
        for f in filters:
            logprobs = f(logprobs)
        return mx.random.categorical(logprobs * (1.0 / temp))

    return sample


def make_draw(
    temp: float, top_p: float = 0.0, min_p: float = 0.0, top_k: int = 0
) -> Callable[[mx.array, mx.array], mx.array]:
    """Tokens [N] from logit rows [N, V] (any shift per row) and Gumbel noise
    rows [N, V]: a draw from the distribution of ``mlx_lm.sample_utils.make_sampler``
    with these filters and temperature."""
    filt = make_filter(top_p, min_p, top_k)

    def draw(logits: mx.array, noise: mx.array) -> mx.array:
        return mx.argmax(filt(logits) * (1.0 / temp) + noise, axis=-1)

    return draw


def make_filter(top_p: float = 0.0, min_p: float = 0.0, top_k: int = 0) -> Callable[[mx.array], mx.array]:
    """Rows of logits or log-probabilities [N, V] -> float32 log-probabilities
    up to a shift per row, with the filters of ``mlx_lm.sample_utils.make_sampler``
    applied (what they remove is -inf)."""
    filters = _filters(top_p, min_p, top_k)
    return lambda x: _filtered(x, filters)


class Noise:
    """Gumbel noise rows [V] for the positions of one sequence, each from the
    seed and its position alone; rows not yet consumed stay for later rounds.
    ``held``: tokens before position 0 (a prompt cache's), so that a
    continued conversation draws as a fresh run of all its tokens would."""

    def __init__(self, seed: int, width: int, held: int = 0):
        # (Random takes a negative seed's absolute value.)
        self.base = random.Random(seed % 2**64).getrandbits(32)
        self.width, self.held = width, held
        self.start, self.rows = 0, mx.zeros((0, width))

    def __call__(self, pos: int, n: int) -> mx.array:
        """The rows [n, V] of positions pos .. pos + n - 1."""
        if not self.start <= pos <= self.start + self.rows.shape[0]:
            self.start, self.rows = pos, self.rows[:0]
        end = self.start + self.rows.shape[0]
        if pos + n > end:  # new rows: keep the ones from pos on, add them
            self.rows = mx.concatenate([self.rows[pos - self.start :]] + [self._row(p) for p in range(end, pos + n)])
            self.start = pos
        return self.rows[pos - self.start : pos - self.start + n]

    def _row(self, pos: int) -> mx.array:
        key = mx.array([self.base, (self.held + pos) % 2**32], dtype=mx.uint32)
        return mx.random.gumbel(shape=(1, self.width), key=key)


def held(cache: Optional[list]) -> int:
    """Tokens a prompt cache holds (0 for none)."""
    for c in cache or []:
        n = held(c.caches) if hasattr(c, "caches") else getattr(c, "offset", None)
        if isinstance(n, int) and n:
            return n
    return 0


def _filters(top_p: float, min_p: float, top_k: int) -> List[Callable]:
    # Rows may be logits up to a shift: min-p and top-k ignore it, and top-p
    # gets log-probabilities (mlx-lm before 0.32 summed unnormalised mass).
    # A top-k as wide as the row (a draft's smaller vocabulary) keeps it whole.
    filters = []
    if 0 < top_p < 1.0:
        filters.append(lambda x: apply_top_p(x - mx.logsumexp(x, axis=-1, keepdims=True), top_p))
    if min_p != 0.0:
        filters.append(lambda x: apply_min_p(x, min_p))
    if top_k > 0:
        filters.append(lambda x: apply_top_k(x, top_k) if top_k < x.shape[-1] else x)
    return filters


def shifted(x: mx.array) -> mx.array:
    """x - max(x) along the last axis, in float32."""
    # Log-probabilities up to a constant, in float32: raw bf16 logits divided
    # by a temperature would round coarsely, and exp would overflow on
    # logits above ~88.
    x = x.astype(mx.float32)
    return x - x.max(axis=-1, keepdims=True)


def _filtered(x: mx.array, filters: List[Callable]) -> mx.array:
    x = shifted(x)
    for f in filters:
        x = f(x)
    return x


def make_distribution(
    temp: float = 0.0, top_p: float = 0.0, min_p: float = 0.0, top_k: int = 0
) -> Callable[[mx.array], mx.array]:
    """The probabilities [N, V] that :func:`make_draw` draws from, given
    log-probability rows (or logits: the filters and the softmax ignore a
    shift); at temperature 0 the plain softmax."""
    if temp == 0:
        return softmax
    filt = make_filter(top_p, min_p, top_k)

    def dist(logprobs: mx.array) -> mx.array:
        e = exp(filt(logprobs) * (1.0 / temp))
        return e / e.sum(axis=-1, keepdims=True)

    return dist


def near_top(probs: mx.array, draft: mx.array, threshold: float) -> mx.array:
    """For draft tokens [L-1]: is each one's probability (rows of ``probs``)
    at least ``threshold`` times its row's top probability?"""
    n = draft.shape[0]
    pd = mx.take_along_axis(probs[:n], draft[:, None].astype(mx.int32), axis=-1)[:, 0]
    return pd >= threshold * probs[:n].max(axis=-1)


def speculative(p: mx.array, q: mx.array, draft: mx.array, also: Optional[mx.array] = None):
    """Speculative sampling of draft tokens [L-1] drawn from the rows of
    ``q`` [L-1, V], against the target's probabilities ``p`` [L, V]: accept
    each with probability min(1, p/q); at the first rejection draw the bonus
    from normalise(max(0, p - q)), after all from the last row of ``p``.
    Drafts flagged in ``also`` are accepted regardless (not exact then).
    Returns (tokens [L], accepted count): the accepted drafts, then the bonus."""
    n = draft.shape[0]
    draft = draft.astype(mx.int32)
    pd = mx.take_along_axis(p[:n], draft[:, None], axis=-1)[:, 0]
    qd = mx.take_along_axis(q, draft[:, None], axis=-1)[:, 0]
    ok = mx.random.uniform(shape=(n,)) * qd < pd
    if also is not None:
        ok = ok | also
    a = mx.cumprod(ok.astype(mx.int32)).sum()
    rest = mx.concatenate([mx.maximum(p[:n] - q, 0.0), p[n:]])[a]
    # rest is all zero only where p == q, which never rejects; guard anyway.
    rest = mx.where(rest.sum() > 0, rest, p[a])
    bonus = mx.random.categorical(mx.log(rest))
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
    """Argmax of float32 logit rows [L, V] without the log-softmax, and each
    row's count of entries within 2**-17 of its top: unless every count is 1,
    :func:`process`'s rounding could pick another token (or a top is not
    finite), so use the exact path.

    Log-probabilities of near-top tokens lie in (-16, 0], where float32 steps
    are at most 2**-20, so subtracting the row's log-sum-exp cannot merge or
    reorder logits further apart than that. Skipping it saves an exp per entry,
    which dominates a 16-row verification on a CPU. Few ops: on MLX-CPU each
    costs ~10 us, as much as the exp over a 4k vocabulary. A non-finite top
    leaves no entry within reach of itself (inf - inf is nan), so the count
    of near-top entries is 1 exactly when the row is safe."""
    top = logits.max(axis=-1, keepdims=True)
    return mx.argmax(logits, axis=-1), ((logits - top) >= -(2.0**-17)).sum(axis=-1)


def accepted(drafts: List[int], choices: List[int], also: Optional[List[int]] = None) -> int:
    """How many drafts match the target's choices (or are flagged in ``also``),
    as a prefix. Counted on the host from the read tokens: as MLX ops it cost
    1-2% of a toy round (docs/measurements.md, session 58)."""
    a = 0
    while a < len(drafts) and (drafts[a] == choices[a] or (also is not None and also[a])):
        a += 1
    return a
