"""The decoding loop's rounds, timed for ``block_size="auto"``."""

from typing import List, Optional

import mlx.core as mx

from ..models.distributed import agree, group
from . import policy as _policy
from .policy import Policy

RETIME = 32  # plain steps of a run between bookings of their time


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
    at 9.2 ms (the first step after a switch runs slower). A drafting round
    is timed from the end of the last one, unless it is one of the first two
    after plain steps (or the prompt, or a batch): the first also reads their
    features, and the second still ran 6-13% slower than the next ones
    (rounds of 8 after the prompt, toy target, one core: 9.2, 7.1, then
    6.3-6.7 ms); timed, it kept a length looking dearer than it runs (a
    batch, see :mod:`.batch`, leaves only the first untimed: its second is
    not slower). Every round, from the last one's end, is spent against the
    budget (:meth:`Policy.spend`).
    Under mlx.launch, rank 0's times, a round late (sent with the next
    round's tokens, see :meth:`agree`).

    Args:
        policy: The policy to teach, or None (nothing is booked).
    """

    def __init__(self, policy: Optional[Policy] = None):
        self.policy = policy
        self._tick = None  # when the last round (or the prefill) ended
        self._drafts = 0  # drafting rounds in a row, up to the last round
        self._run = 0  # plain steps since the last drafting round or booking of their time
        self._second = 0.0  # the second one's end
        self._prev = 0.0  # when the round before the last one ended
        self._lags = []  # under mlx.launch: [length (negative: spent), microseconds, rounds (tokens)] not yet agreed

    def start(self) -> None:
        """Time the next rounds afresh, from now (a prefill, or the batch the
        row was in, just ended)."""
        self._drafts, self._run, self._tick = 0, 0, _policy.clock()

    def learn(self, length: int, accepted: int, took: bool = True) -> None:
        """Teach the policy a round whose tokens were just read, and time it."""
        now, drafted = _policy.clock(), length > 1
        if self.policy is not None:
            if drafted:
                self.policy.learn(length, [accepted])
                self._stretch()
                if self._drafts >= 2:  # not the first two after plain steps (or the prompt, or a batch)
                    self._time(length, now - self._tick, 1)
                self._run = 0
            else:
                if self._run == 1:
                    self._second = now
                self._run += 1
                # Timed after 4 steps at first, then every RETIME of a run, so that a
                # long run does not keep the time of its start (or a lucky first one).
                if self._run >= (RETIME if self.policy.timed(1) else 4):
                    self._stretch(self._tick)
                    self._run = 0
            self._time(-length, now - self._tick, accepted + 1)  # charged if a probe (Policy.spend)
            if took:
                self.policy.took(length)
        self._prev, self._tick, self._drafts = self._tick, now, self._drafts + 1 if drafted else 0

    def end(self) -> None:
        """The generation ended: time its last plain steps."""
        if self.policy is not None and group() is None:
            self._stretch()

    def _stretch(self, before: Optional[float] = None) -> None:
        """Time the plain steps since the last drafting round (or booking), the one
        before the last of them ended at ``before`` (default: when the round
        before the last one ended): per step, over rounds 3 .. n - 1 (see the
        class); up to three steps are not timed."""
        n = self._run
        before = self._prev if before is None else before
        if n > 3:
            self._time(1, (before - self._second) / (n - 3), n)

    def agree(self, values: mx.array, block: mx.array) -> List[int]:
        """Rank 0's ``values`` (see :func:`agree`) as a list; under mlx.launch
        the policy also gets rank 0's times of the last round, so that every
        rank chooses the same lengths."""
        if group() is None or self.policy is None:
            return agree(values, block).tolist()
        lags = (self._lags + [[0, 0, 0]] * 3)[:3]  # a round sends at most: spent, a stretch, its time
        self._lags = []
        out = agree(mx.concatenate([values, mx.array(sum(lags, []), mx.int32)]), block).tolist()
        for length, us, rounds in zip(out[-9::3], out[-8::3], out[-7::3]):
            if rounds:
                self._book(length, us / 1e6, rounds)
        return out[:-9]

    def _time(self, length: int, seconds: float, rounds: int) -> None:
        """Book ``rounds`` rounds of ``length`` that took ``seconds`` each;
        a negative length: one round of -length spent, that committed
        ``rounds`` tokens."""
        if group() is None:
            self._book(length, seconds, rounds)
        else:  # sent with the next round's tokens
            self._lags.append([length, int(seconds * 1e6), rounds])

    def _book(self, length: int, seconds: float, rounds: int) -> None:
        if length < 0:
            self.policy.spend(seconds, rounds, drafted=length < -1)
        else:
            self.policy.time(length, seconds, rounds=rounds)
