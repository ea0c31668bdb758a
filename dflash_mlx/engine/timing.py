"""The decoding loop's rounds, timed for ``block_size="auto"``."""

from typing import List, Optional

import mlx.core as mx

from ..models.distributed import agree, group
from . import policy as _policy
from .policy import Policy


class RoundTimer:
    """Times the loop's rounds and books them in the Policy.

    Plain steps are timed by the stretch, over its rounds but the first two
    and the last: which round computes a step depends on the platform, and
    those are the rounds where it differs. A pipelined step is read once the
    next one is queued. On MLX-CPU async_eval computes what it is given, so
    the first round computes two steps, each next one the step it queues,
    and a last round that queues none computes nothing (the demo target: 12,
    5 and 1 ms, where its steps take 4). Where async_eval returns at once,
    the first step is read when the second (queued with it: MLX signals a
    whole evaluation at once) is done, and the second at once, and each
    next one after its own step. Either way, rounds 3 .. n - 1 compute n - 3
    steps. Counted from the first step's end, a stretch of 2 steps was
    priced at 0.25 ms; from its start, a short stretch priced a 5.7 ms step
    at 9.2 ms (the first step after a switch runs slower). A drafting round is timed from
    the end of the last one; after plain steps only against the policy's
    budget (it reads their features too). Under mlx.launch, rank 0's times,
    a round late (sent with the next round's tokens, see :meth:`agree`).

    The plain steps next to a switch to drafting run slower than the
    switch's own time shows (on MLX-CPU a probe lost 2x what it took beyond
    a plain step): the one before it and the one after (which runs alone, as
    the first step after any switch does) are charged against the probes'
    budget for what they took beyond two plain steps.

    Args:
        policy: The policy to teach, or None (nothing is booked).
    """

    def __init__(self, policy: Optional[Policy] = None):
        self.policy = policy
        self._tick = None  # when the last round (or the prefill) ended
        self._last = None  # whether the last round drafted
        self._run, self._start = 0, 0.0  # plain steps since the last drafting round, from when
        self._second = 0.0  # the second one's end
        self._prev = 0.0  # when the round before the last one ended
        self._before = None  # after a switch to drafting: what the plain step before it took
        self._lags = []  # under mlx.launch: [length (0: a charge), microseconds, rounds] not yet agreed

    def start(self) -> None:
        """Time the next rounds afresh, from now (a prefill, or the batch the
        row was in, just ended)."""
        self._last, self._run, self._before, self._tick = None, 0, None, _policy.clock()

    def learn(self, length: int, accepted: int, took: bool = True) -> None:
        """Teach the policy a round whose tokens were just read, and time it."""
        now, drafted = _policy.clock(), length > 1
        if self.policy is not None:
            if self._before is not None and not drafted:
                self._charge(now)
            self._before = None
            if drafted:
                self.policy.learn(length, [accepted])
                self._stretch()
                # After plain steps (or the prompt) it also reads their features.
                self._time(length, now - self._tick, 1, book=bool(self._last))
                if not self._last:
                    self._before = self._tick - self._prev if self._run else 0.0
                self._run = 0
            else:
                if not self._run:
                    self._start = self._tick
                elif self._run == 1:
                    self._second = now
                self._run += 1
                if self._run >= 4 and not self.policy.timed(1):  # no need to wait for a drafting round
                    self._stretch(self._tick, now)
                    self._run = 0
            if took:
                self.policy.took(length)
        self._prev, self._tick, self._last = self._tick, now, drafted

    def end(self) -> None:
        """The generation ended: its last plain steps count in the budget's time."""
        if self.policy is not None:
            if group() is None:
                self._stretch()
            self.policy.end()

    def _stretch(self, before: Optional[float] = None, end: Optional[float] = None) -> None:
        """Time the plain steps since the last drafting round, the last two
        of them ended at ``before`` and ``end`` (default: the last two
        rounds' ends): per step, over rounds 3 .. n - 1 (see the class);
        up to three steps only against the budget."""
        n = self._run
        before, end = self._prev if before is None else before, self._tick if end is None else end
        if n > 3:
            self._time(1, (before - self._second) / (n - 3), n)
        elif n:
            self._time(1, (end - self._start) / n, n, book=False)

    def agree(self, values: mx.array, block: mx.array) -> List[int]:
        """Rank 0's ``values`` (see :func:`agree`) as a list; under mlx.launch
        the policy also gets rank 0's times of the last round, so that every
        rank chooses the same lengths."""
        if group() is None or self.policy is None:
            return agree(values, block).tolist()
        lags = (self._lags + [[0, 0, 0]] * 2)[:2]
        self._lags = []
        out = agree(mx.concatenate([values, mx.array(sum(lags, []), mx.int32)]), block).tolist()
        for length, us, rounds in zip(out[-6::3], out[-5::3], out[-4::3]):
            if rounds:
                self._book(length, us / 1e6, rounds)
        return out[:-6]

    def _charge(self, now: float) -> None:
        """Charge the plain steps next to the last switch."""
        step = self.policy.seconds(1)
        if step is not None:
            self._time(0, self._before + now - self._tick - 2 * step, 1)

    def _time(self, length: int, seconds: float, rounds: int, book: bool = True) -> None:
        code = length if book else -length  # a round not booked: its length negated; 0: a charge
        if group() is None:
            self._book(code, seconds, rounds)
        else:  # sent with the next round's tokens
            self._lags.append([code, int(seconds * 1e6), rounds])

    def _book(self, code: int, seconds: float, rounds: int) -> None:
        """Give the policy a time coded as :meth:`_time` codes it."""
        if code == 0:
            self.policy.charge(seconds)
        else:
            self.policy.time(abs(code), seconds, rounds=rounds, book=code > 0)
