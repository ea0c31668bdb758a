"""``block_size="auto"``: how many tokens each decoding round verifies.

The choices are the round lengths 1 (a plain step), 2, 4, ... up to the
draft's block (near the end, those that fit); each round takes the one
expected to commit the most tokens per second of the loop's own clock:

- Seconds per round: a decaying mean per length and batch width (not the
  first rounds after a switch between drafting and plain steps). The plain
  step and the full block are timed first, plain steps again after
  ``window`` drafting rounds without them; a length not timed is
  interpolated between timed ones (optimistic: the draft pass costs at any
  length), so it is tried where it might win.
- Tokens per round: draft i's chance of acceptance given the ones before
  it, a count per depth over every drafting round and the drafts beyond a
  probe's block (:meth:`saw`), fading with every round; a depth seen little
  leans on the one before it.

While plain steps win, the best drafting round still runs now and then (a probe)
to find a draft that starts to help; what probes alone (not a round chosen because
drafting won) and the rounds next to them lose stays within ``budget`` of the loop's
recent time, give or take a probe: a useless draft costs about that share. What a
policy learnt carries over to the next generation with the same draft and sampling.
Nothing is measured ahead, and no length is assumed faster than it runs, so the
choice holds on any pair and machine; the output never depends on it.
"""

import time
import weakref
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple


TRUST = 1.0  # timed rounds (decayed) before a length's time is trusted
clock = time.perf_counter  # the loop's clock (a test may put a modelled one here)


@dataclass
class Policy:
    """Chooses each round's length for the generations of one draft.

    Args:
        block_size: The draft's trained block size (the longest round).
        memory: Decay per drafting round of the counts (0.95 chose worse on noisy drafts).
        fade: Decay per plain step of the counts (rare probes must outweigh the
            rounds that made plain steps win).
        decay: Decay per round of a length's timing.
        prior: Pseudo-trials behind each depth's starting guess.
        budget: The share of the time (over about the last ``window`` rounds)
            that probes may lose against plain steps.
    """

    block_size: int
    memory: float = 0.98
    fade: float = 0.995
    decay: float = 0.95
    prior: float = 1.0
    budget: float = 0.01
    window: int = 256
    # (width, length) -> [decaying seconds, decaying rounds]
    times: Dict[Tuple[int, int], List[float]] = field(init=False, default_factory=dict)
    # counts per depth over every drafting round (fading): drafts accepted, checked
    hits: List[float] = field(init=False)
    trials: List[float] = field(init=False)
    skip: int = field(init=False, default=0)  # plain steps to take (to time them) before drafting again
    aged: Dict[int, int] = field(init=False, default_factory=dict)  # width -> drafting rounds since plain steps were timed
    spent: float = field(init=False, default=0.0)  # decaying seconds of the rounds
    lost: float = field(init=False, default=0.0)  # of those, what they lost against plain steps while these won
    _held: float = field(init=False, default=0.0, repr=False)  # the last plain round's loss, not yet counted
    _near: int = field(init=False, default=0, repr=False)  # plain rounds after a drafting round still to count
    _steps: int = field(init=False, default=0, repr=False)  # plain steps not yet faded (took)
    probe: bool = field(init=False, default=False, repr=False)  # the round chosen last is a probe
    # kept as a round asks best() 3-4 times: until learn() (gains) or time() (times)
    _gains: Optional[List[float]] = field(init=False, default=None, repr=False, compare=False)
    _timed: Dict[int, Dict[int, float]] = field(init=False, default_factory=dict, repr=False, compare=False)
    _best: Dict[tuple, int] = field(init=False, default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        self.lengths = sorted({1, self.block_size} | {2**k for k in range(1, 8) if 2**k < self.block_size})
        self.hits, self.trials = [0.0] * max(self.block_size - 1, 0), [0.0] * max(self.block_size - 1, 0)

    def chances(self) -> List[float]:
        """Each draft's estimated chance of acceptance given the ones before."""
        out, last = [], 0.5
        for h, t in zip(self.hits, self.trials):
            last = (h + self.prior * last) / (t + self.prior)
            out.append(last)
        return out

    def tokens(self, length: int) -> float:
        """Expected tokens committed by a round of ``length``."""
        if self._gains is None:  # for each length 1..block
            reach, self._gains = 1.0, [1.0]
            for p in self.chances():
                reach *= p
                self._gains.append(self._gains[-1] + reach)
        return self._gains[length - 1]

    def seconds(self, length: int, width: int = 1) -> Optional[float]:
        """A round's expected seconds: measured, else interpolated between
        the nearest timed lengths (flat beyond them); None if none is timed."""
        if width not in self._timed:
            self._timed[width] = {n: s[0] / s[1] for (w, n), s in self.times.items() if w == width and s[1] >= TRUST}
        timed = self._timed[width]
        if length in timed or not timed:
            return timed.get(length)
        below, above = [n for n in timed if n < length], [n for n in timed if n > length]
        if not below or not above:
            return timed[max(below) if below else min(above)]
        a, b = max(below), min(above)
        return timed[a] + (timed[b] - timed[a]) * (length - a) / (b - a)

    def best(self, limit: Optional[int] = None, width: int = 1, least: int = 1) -> int:
        """The length from ``least`` to ``limit`` expected to commit the most
        tokens per second, ``width`` rows at once (the untimed full block first)."""
        key = (limit or self.block_size, width, least)
        if key not in self._best:
            self._best[key] = self._fastest(*key)
        return self._best[key]

    def _fastest(self, limit: int, width: int, least: int) -> int:
        options = [n for n in self.lengths if least <= n <= limit]
        if self.block_size in options and not self.timed(self.block_size, width):
            return self.block_size
        if not self.timed(1, width):
            options = [n for n in options if n > 1] or [1]
        if self.seconds(options[-1], width) is None:  # nothing timed within the limit
            return options[-1]
        return max(options, key=lambda n: self.tokens(n) / self.seconds(n, width))

    def choose(self, limit: Optional[int] = None, width: int = 1, ready: bool = True) -> int:
        """The next round's length: :meth:`best`, plain steps while ``skip``
        says so or the draft is not ``ready``, and while plain steps win, the
        best drafting round (a probe) when probes have lost less than
        ``budget`` of the time."""
        limit = limit or self.block_size
        if self.skip > 0 or limit < 2 or not ready:
            return 1
        self.probe = self.best(limit, width) == 1  # a drafting round now is a probe
        probe = self.probe and self.lost <= self.budget * self.spent
        return self.best(limit, width, least=2 if probe else 1)

    def learn(self, length: int, accepted: Sequence[int]) -> None:
        """A drafting round verified ``length`` tokens a row; row r accepted ``accepted[r]`` drafts."""
        self._fade(self.memory ** len(accepted))
        for a in accepted:
            for i in range(min(a + 1, length - 1)):
                self.hits[i] += i < a
                self.trials[i] += 1

    def _fade(self, decay: float) -> None:
        self.hits[:] = [h * decay for h in self.hits]
        self.trials[:] = [t * decay for t in self.trials]
        self._gains, self._best = None, {}

    def saw(self, depth: int, hit: bool) -> None:
        """A draft at ``depth`` beyond a probe's block (those before it right) was the
        next token (``hit``) or not: so that a guess about the deeper drafts does not hold."""
        self.hits[depth], self.trials[depth] = self.hits[depth] + hit, self.trials[depth] + 1
        self._gains, self._best = None, {}

    def plain_wins(self, width: int = 1) -> bool:
        """Whether plain steps are timed and win (a drafting round now is a probe)."""
        return self.timed(1, width) and self.best(width=width) == 1

    def quiet(self, ahead: int, width: int = 1) -> bool:
        """Whether plain steps win and no probe is due for ``ahead`` rounds."""
        return self.plain_wins(width) and self.lost * (1 - 1 / self.window) ** ahead > self.budget * self.spent

    def timed(self, length: int, width: int = 1) -> bool:
        """Whether rounds of ``length`` on ``width`` rows have been timed."""
        return self.times.get((width, length), [0, 0])[1] >= TRUST

    def time(self, length: int, seconds: float, width: int = 1, rounds: int = 1) -> None:
        """``rounds`` rounds of ``length`` on ``width`` rows took ``seconds``
        each (a drafting round: the one :meth:`learn` was told last); not the
        first rounds after a switch, which do more than their own work."""
        s = self.times.setdefault((width, length), [0.0, 0.0])
        if s[1] >= 1:  # a pause of the machine weighs like a slow round, no more
            seconds = min(seconds, 3 * s[0] / s[1])
        self._timed, self._best = {}, {}
        if length == 1:
            self.aged[width] = 0
        for _ in range(rounds):
            s[:] = [self.decay * s[0] + seconds, self.decay * s[1] + 1]

    def spend(self, seconds: float, tokens: float, width: int = 1, drafted: bool = False) -> None:
        """A round took ``seconds`` and committed ``tokens`` a row. What a probe (a
        round :meth:`choose` chose while plain steps won; under mlx.launch, booked a
        round late, the next round's flag) takes beyond their time for as many tokens
        is lost (a gain only if it drafted none: a lucky probe of a useless draft would
        buy the next ones), and so is what the plain rounds next to it lose (one
        before, two after: where a switch costs); no other's."""
        keep = 1 - 1 / self.window
        self.lost, self.spent = self.lost * keep, self.spent * keep + seconds
        if not (self.probe if drafted else self.plain_wins(width)):
            return
        loss = seconds - tokens * self.seconds(1, width)
        if drafted:
            self.lost += self._held + (max(loss, 0.0) if tokens > 1 else loss)
            self._held, self._near = 0.0, 2
        elif self._near:
            self.lost, self._near = self.lost + loss, self._near - 1
        else:
            self._held = loss  # counted if a drafting round comes next

    def took(self, length: int, width: int = 1) -> None:
        """Count a round of ``length`` (learnt from and timed): a plain step fades
        the counts; plain steps follow until they are timed once the full block
        is, again after ``window`` drafting rounds without them, and after a
        probe, enough to time one (one booked too slow would buy probe after probe)."""
        if length == 1:
            self.skip, self._steps = max(self.skip - 1, 0), (self._steps + 1) % 16
            # By 16 steps (best() is kept until the counts change), to no fewer than 8 first
            # drafts: with fewer, the prior alone made a useless draft look worth trying.
            if not self._steps and self.trials and self.trials[0] > 8:
                self._fade(self.fade**16)
            return
        self.aged[width] = self.aged.get(width, 0) + 1
        if self.aged[width] > self.window:
            self.times.pop((width, 1), None)
            self._timed, self._best = {}, {}
        # the full block timed but not plain steps, or a probe: a run long enough to be timed
        if (not self.timed(1, width) and self.timed(self.block_size, width)) or self.plain_wins(width):
            self.skip = 4

    @staticmethod
    def of(draft, sampled: bool = False) -> "Policy":
        """The policy of ``draft``'s greedy or ``sampled`` generations (made
        at the first): what a round accepts and costs differs between them."""
        learnt, key = memo(draft), ("policy", sampled)
        if key not in learnt:  # not made each time: a batch asks every round
            learnt[key] = Policy(draft.block_size)
        return learnt[key]

    @staticmethod
    def forget(draft) -> None:
        """Drop what generations with ``draft`` taught, so the next one starts afresh."""
        for sampled in (False, True):
            memo(draft).pop(("policy", sampled), None)


_learnt: Dict[int, dict] = {}  # id(draft) -> what its generations learnt (see memo)


def memo(draft) -> dict:
    """What generations with ``draft`` learnt (the greedy and sampled policies, the proposal's temperature)."""
    if id(draft) not in _learnt:
        _learnt[id(draft)] = {}
        weakref.finalize(draft, _learnt.pop, id(draft), None)
    return _learnt[id(draft)]
