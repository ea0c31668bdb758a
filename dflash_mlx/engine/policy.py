"""``block_size="auto"``: how many tokens each decoding round verifies.

The choices are plain steps (1) and rounds of 2, 4, ... up to the draft's
block (near the end, the tokens left); each round takes the one expected to
commit the most tokens per second of the loop's own clock:

- Seconds: a decaying mean of that length's rounds per batch width (not the
  first after a switch to or from plain steps); the plain step and the full
  block are timed first, a length not timed is interpolated.
- Tokens: draft i's chance of acceptance given the ones before, decaying
  counts per depth of that length's rounds, leaning on every round's where
  it saw little (a depth seen little leans on the one before).

Among drafting lengths the chances are drawn from what was seen (Thompson
sampling), so a length seen little or unlucky is tried again. While plain
steps win, the best drafting round still runs now and then (a probe) while
what probes lost (with the slowdown of the plain steps next to them) stays
within ``budget`` of the recent time: a useless draft costs at most that.
What a policy learnt carries over to the draft's next generation. Nothing
is measured ahead; the output never depends on the choice.
"""

import time
import weakref
from itertools import accumulate
from operator import mul
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np


TRUST = 1.0  # timed rounds (decayed) before a length's time is trusted
clock = time.perf_counter  # the loop's clock (a test may put a modelled one here)


@dataclass
class Policy:
    """Chooses each round's length for the generations of one draft.

    Args:
        block_size: The draft's trained block size (the longest round).
        memory: Decay per drafting round of the acceptance counts.
        decay: Decay per round of a length's timing.
        prior: Pseudo-trials behind each depth's starting guess.
        budget: The share of the time (over about ``window`` rounds) that
            probes may lose against plain steps while plain steps win.
    """

    block_size: int
    memory: float = 0.98
    decay: float = 0.95
    prior: float = 1.0
    budget: float = 0.01
    window: int = 256
    # (width, length) -> [decaying seconds, decaying rounds]
    times: Dict[Tuple[int, int], List[float]] = field(init=False, default_factory=dict)
    # length -> [hits, trials]: its rounds' decaying counts per depth
    own: Dict[int, List[List[float]]] = field(init=False, default_factory=dict)
    skip: int = field(init=False, default=0)  # plain steps to take (to time them) before drafting again
    spent: float = field(init=False, default=0.0)  # decaying seconds of all timed rounds
    lost: float = field(init=False, default=0.0)  # of those, what probes lost against plain steps
    made: float = field(init=False, default=1.0)  # tokens a row committed in the last drafting round
    untimed: int = field(init=False, default=0)  # plain steps taken, not timed yet
    # kept as best() asks 2-3 times a round: until learn() (chances, tokens) or time() (times)
    _pooled: Optional[List[float]] = field(init=False, default=None, repr=False, compare=False)
    _tokens: Dict[int, float] = field(init=False, default_factory=dict, repr=False, compare=False)
    _timed: Dict[int, Dict[int, float]] = field(init=False, default_factory=dict, repr=False, compare=False)
    _drawn: Dict[tuple, Dict[int, float]] = field(init=False, default_factory=dict, repr=False, compare=False)
    rng: np.random.Generator = field(init=False, default_factory=lambda: np.random.default_rng(0), repr=False)

    def __post_init__(self):
        self.lengths = sorted({1, self.block_size} | {2**k for k in range(1, 8) if 2**k < self.block_size})

    def counts(self) -> Tuple[List[float], List[float]]:
        """Every round's decaying counts per depth: drafts accepted, checked."""
        hits, trials = [0.0] * max(self.block_size - 1, 0), [0.0] * max(self.block_size - 1, 0)
        for h, t in self.own.values():
            for i in range(len(h)):
                hits[i], trials[i] = hits[i] + h[i], trials[i] + t[i]
        return hits, trials

    def chances(self, length: Optional[int] = None) -> List[float]:
        """Each draft's estimated chance of acceptance given the ones before: from every round,
        or in rounds of ``length``, from theirs (leaning on every round's where they saw little)."""
        if self._pooled is None:
            self._pooled, last = [], 0.5
            for h, t in zip(*self.counts()):
                last = (h + self.prior * last) / (t + self.prior)
                self._pooled.append(last)
        out, own = list(self._pooled), self.own.get(self.kind(length) if length else None)
        if own:
            h, t = own
            out[: len(h)] = [(a + self.prior * c) / (b + self.prior) for a, b, c in zip(h, t, out)]
        return out

    def tokens(self, length: int) -> float:
        """Expected tokens committed by a round of ``length``."""
        if length not in self._tokens:
            self._tokens[length] = 1.0 + sum(accumulate(self.chances(length)[: length - 1], mul))
        return self._tokens[length]

    def drawn(self, options: List[int]) -> Dict[int, float]:
        """Tokens committed by a round of each of ``options`` (>= 2), each chance
        drawn from a Beta around its estimate, as narrow as its trials say."""
        trials, own = self.counts()[1], [self.own.get(self.kind(n)) for n in options]
        w = np.array([o[1] + trials[len(o[1]) :] if o else trials for o in own]) + self.prior
        m = np.array([self.chances(n) for n in options])
        p = self.rng.beta(np.maximum(m * w, 1e-6), np.maximum((1 - m) * w, 1e-6))
        reach = np.cumprod(p, axis=1) * (np.arange(p.shape[1]) < np.array(options)[:, None] - 1)
        return dict(zip(options, 1.0 + reach.sum(axis=1)))

    def seconds(self, length: int, width: int = 1) -> Optional[float]:
        """A round's expected seconds: measured, else interpolated between
        the nearest timed lengths (flat beyond them); None if none is timed."""
        if width not in self._timed:
            self._timed[width] = {n: s[0] / s[1] for (w, n), s in self.times.items() if w == width and s[1] >= TRUST}
        timed = self._timed[width]
        if length in timed or not timed:
            return timed.get(length)
        a = max((n for n in timed if n < length), default=None)
        b = min((n for n in timed if n > length), default=None)
        if a is None or b is None:
            return timed[b if a is None else a]
        return timed[a] + (timed[b] - timed[a]) * (length - a) / (b - a)

    def best(self, limit: Optional[int] = None, width: int = 1, least: int = 1, draw: bool = False) -> int:
        """The length from ``least`` to ``limit`` expected to commit the most
        tokens per second, ``width`` rows at once (the untimed full block first).
        A ``limit`` below the block (the tokens left) is an option too: one
        round may verify them all."""
        limit = limit or self.block_size
        options = [n for n in self.lengths if least <= n < limit] + [limit] * (limit >= least)
        if self.block_size in options and not self.timed(self.block_size, width):
            return self.block_size
        if not self.timed(1, width):
            options = [n for n in options if n > 1] or [1]
        if self.seconds(options[-1], width) is None:  # nothing timed within the limit
            return options[-1]
        if draw and tuple(options) not in self._drawn:  # kept until took(): choose() stays idempotent
            self._drawn[tuple(options)] = self.drawn(options)
        tokens = self._drawn[tuple(options)].get if draw else self.tokens
        return max(options, key=lambda n: tokens(n) / self.seconds(n, width))

    def choose(self, limit: Optional[int] = None, width: int = 1) -> int:
        """The next round's length: plain steps while ``skip`` says so; if a
        drafting length wins, the best by drawn chances; else plain steps, or
        a probe (the best drafting length) while probes lost under ``budget``."""
        limit = limit or self.block_size
        if self.skip > 0 or limit < 2:
            return 1
        best = self.best(limit, width)
        if best > 1:
            return self.best(limit, width, least=2, draw=True)
        spent = self.spent + self.untimed * (self.seconds(1, width) or 0.0)
        if self.lost > self.budget * spent:
            return best
        return self.best(limit, width, least=2)

    def learn(self, length: int, accepted: Sequence[int]) -> None:
        """A drafting round verified ``length`` tokens a row; row r accepted ``accepted[r]`` drafts."""
        decay, self._pooled, self._tokens = self.memory ** len(accepted), None, {}
        for counts in [c for o in self.own.values() for c in o]:
            counts[:] = [c * decay for c in counts]
        n = self.kind(length)
        hits, trials = self.own.setdefault(n, [[0.0] * (n - 1), [0.0] * (n - 1)])
        self.made = 1 + sum(accepted) / len(accepted)
        for a in accepted:
            for i in range(min(a + 1, length - 1)):
                hits[i] += i < a
                trials[i] += 1

    def kind(self, length: int) -> int:
        """The length whose counts a round of ``length`` adds to (a round cut short: the next one's)."""
        return min(n for n in self.lengths if n >= length)

    def plain_wins(self, width: int = 1) -> bool:
        """Whether plain steps are timed and win (a drafting round now is a probe)."""
        return self.timed(1, width) and self.best(width=width) == 1

    def timed(self, length: int, width: int = 1) -> bool:
        """Whether rounds of ``length`` on ``width`` rows have been timed."""
        return self.times.get((width, length), [0, 0])[1] >= TRUST

    def time(self, length: int, seconds: float, width: int = 1, rounds: int = 1, book: bool = True) -> None:
        """``rounds`` rounds of ``length`` on ``width`` rows took ``seconds``
        each (a drafting round: the one :meth:`learn` was told last). Not
        ``book``: a round timed with more than its own work (the first after
        a switch), counted only against the budget."""
        s = self.times.setdefault((width, length), [0.0, 0.0])
        if s[1] >= 1:  # a pause of the machine weighs like a slow round, no more
            seconds = min(seconds, 3 * s[0] / s[1])
        keep = max(1 - rounds / self.window, 0.0)
        self.lost *= keep
        self.spent = self.spent * keep + seconds * rounds
        if length > 1 and self.plain_wins(width):  # a probe
            self.lost = max(self.lost + seconds - self.made * self.seconds(1, width), 0.0)
        if length == 1:
            self.untimed = max(self.untimed - rounds, 0)
        if not book:
            return
        self._timed = {}
        for _ in range(rounds):
            s[0] = self.decay * s[0] + seconds
            s[1] = self.decay * s[1] + 1

    def charge(self, seconds: float, width: int = 1) -> None:
        """Count ``seconds`` that plain steps next to a probe took beyond
        their time against the budget (while plain steps win); never less than
        nothing (a gain there is noise: it let a useless draft probe 2x as often)."""
        if self.plain_wins(width):
            self.lost += max(seconds, 0.0)

    def took(self, length: int, width: int = 1) -> None:
        """Count a round of ``length`` (learnt from and timed): once the full
        block is timed, plain steps until they are timed too."""
        self._drawn = {}
        if length == 1:
            self.skip = max(self.skip - 1, 0)
            self.untimed += 1
        elif not self.timed(1, width) and self.timed(self.block_size, width):
            self.skip = 3
        elif self.plain_wins(width):  # a probe: then plain steps, the
            self.skip = 2  # first queueing the next, as the charge for them assumes

    def end(self) -> None:
        """A generation ended: plain steps not timed by then never will be."""
        self.untimed = 0

    @staticmethod
    def of(draft) -> "Policy":
        """The policy of ``draft``'s generations (made at the first)."""
        return memo(draft).setdefault("policy", Policy(draft.block_size))

    @staticmethod
    def forget(draft) -> None:
        """Drop what generations with ``draft`` taught (e.g. on a warm-up prompt)."""
        memo(draft).pop("policy", None)


_learnt: Dict[int, dict] = {}


def memo(draft) -> dict:
    """What generations with ``draft`` learnt (the policy, the proposal's
    temperature), kept while the draft lives."""
    if id(draft) not in _learnt:
        _learnt[id(draft)] = {}
        weakref.finalize(draft, _learnt.pop, id(draft), None)
    return _learnt[id(draft)]
