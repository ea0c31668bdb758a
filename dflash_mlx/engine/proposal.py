"""Sampled proposals: the draft draws at its own temperature, tuned as it goes.

Sampled decoding stays exact whatever distribution the draft draws from: the
p/q rule is exact for the q the drafts came from, and a draft drawn with the
target's own noise never changes the target's token. So the draft draws at s
times the target's temperature (s = 0: its argmax), s being, each round, the
value of a small grid that would have been accepted most on the rows
verified so far. Drafts are off both ways: SmolLM2's is too sure of itself
(best s 0.5-0.75 at temperatures 0.7-1.0), the toy demo draft too unsure
(best s 2 at 1.0, where s = 1 accepted a third less).
"""

from typing import Optional

import mlx.core as mx

from .policy import memo
from .sampling import make_filter, softmax

SCALES = (0.0, 0.5, 0.7, 1.0, 1.4, 2.0, 2.8)
PRIOR = 0.5  # a head start for s = 1, the draft's own distribution


class Tuner:
    """The draft's sampled proposals in one generation, and their temperature.

    Args:
        temp: The target's temperature (> 0).
        top_p, min_p, top_k: The target's filters, applied to the draft's rows too.
        memory: Decay per verified round of what each s would have accepted.
    """

    def __init__(self, temp: float, top_p: float = 0.0, min_p: float = 0.0, top_k: int = 0,
                 memory: float = 0.98):
        self.temp, self.memory = temp, memory
        self.key = ("tuner", temp, top_p, min_p, top_k)  # what it learns depends on
        self.filter = make_filter(top_p, min_p, top_k)
        self.scales = mx.array(SCALES)
        self.score = PRIOR * (self.scales == 1.0).astype(mx.float32)
        self._rows = None  # the draft's last rows [n, V']

    def recall(self, draft) -> "Tuner":
        """Start from what the last generation with ``draft`` and the same
        sampling settings learnt."""
        self.score = memo(draft).get(self.key, self.score)
        return self

    def remember(self, draft) -> None:
        """Keep what this generation learnt for the next one with ``draft``."""
        mx.eval(self.score)  # the next one may run on another thread
        memo(draft)[self.key] = self.score

    def scale(self) -> mx.array:
        """The temperature scale s the next drafts are drawn at (lazily)."""
        return self.scales[mx.argmax(self.score)]

    def draw(self, logits: mx.array, noise: mx.array) -> mx.array:
        """Draft tokens from the draft's rows [n, V'] drawn with the target's
        Gumbel noise at the same positions (its columns of the draft's rows)."""
        self._rows = logits
        s = self.scale()
        drawn = mx.argmax(self._tempered(logits, s) + noise, axis=-1)
        return mx.where(s > 0, drawn, mx.argmax(logits, axis=-1))

    def sample(self, logits: mx.array):
        """(tokens [n], their distributions q [n, V']) drawn from the draft's
        rows with MLX's generator, for the p/q rule."""
        self._rows = logits
        q = self._dist(logits, self.scale())
        return mx.random.categorical(mx.log(q)), q

    def learn(self, rows: int, p: mx.array, vocab: Optional[mx.array] = None) -> None:
        """Score every s on the first ``rows`` rows of the last drafts, those
        whose context the target verified (the accepted drafts and the first
        rejected one), by sum min(p, q_s) over the target's probabilities
        ``p`` [>= rows, V] there: the p/q rule's chance of accepting, and
        close to (above) that of a draw with the target's noise, without its
        sampling noise. ``vocab``: the draft's rows of the target's
        vocabulary, if it has its own."""
        p = p[:rows] if vocab is None else p[:rows, vocab]
        q = self._dist(self._rows[None, :rows], self.scales[:, None, None])
        self.score = self.memory * self.score + mx.minimum(q, p[None]).sum(axis=(1, 2))

    def _tempered(self, logits: mx.array, s: mx.array) -> mx.array:
        return self.filter(logits) * (1.0 / (self.temp * mx.maximum(s, 1e-6)))

    def _dist(self, logits, s):
        top = mx.argmax(logits, axis=-1, keepdims=True)
        one = (mx.arange(logits.shape[-1]) == top).astype(mx.float32)
        return mx.where(s > 0, softmax(self._tempered(logits, s)), one)
