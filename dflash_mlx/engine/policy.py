"""``block_size="auto"``: how many tokens each decoding round verifies.

A round costs a draft pass (unless it is a plain step) plus a target forward
over L tokens, and commits E(L) tokens on average. The costs are measured once
per model pair and machine and cached (:func:`cached_costs`), in units of a
plain decode step. With ``clock`` the policy also times the loop's own rounds
(no extra synchronisation) to correct what a plain step costs against a
drafting round; its choices may then differ between runs, the output cannot.
"""

import hashlib
import json
import math
import os
import platform
import statistics
import time
import uuid
import warnings
import weakref
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Dict, List, Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from .draft import confidence

VERSION = 5  # of the measurement; part of the cache key
LENGTHS = (1, 2, 4, 8, 16)  # verify lengths measured (and the block size)
GROUPS = 5  # offset groups of the acceptance statistics (see Policy.cell)
# Tokens in the cache the costs are measured on: a verify's attention grows with
# it, and decoding rounds see hundreds (at 32, a toy target's verify of 8 looked
# ~40% cheaper, relative to one of 4, than in decoding).
CONTEXT = 256


@dataclass
class Costs:
    """Times of a round's passes in plain decode steps, as the decoding loop
    runs them (pipelined: the next step is queued before this one's token is
    read, so a step costs a little less than a synchronised forward).

    Args:
        draft: One draft pass over its trained block, confidences included.
        verify: The target forward (with its token choice and rollback) over
            L tokens, by L; 1 is a synchronised single-token forward (a
            plain step that cannot be pipelined). Other lengths are
            interpolated.
    """

    draft: float
    verify: Dict[int, float]

    def __post_init__(self):
        ok = self.verify and all(isinstance(k, int) and k >= 1 for k in self.verify)
        ok = ok and math.isfinite(self.draft) and self.draft >= 0
        if not (ok and all(math.isfinite(v) and v > 0 for v in self.verify.values())):
            raise ValueError(f"implausible costs: draft {self.draft!r}, verify {self.verify!r}")

    def verify_at(self, n: int) -> float:
        """The verify cost of ``n`` tokens, linear between measured lengths
        and extrapolated from the last two."""
        pts = sorted(self.verify.items())
        if n <= pts[0][0] or len(pts) == 1:
            return pts[0][1]
        for (a, ca), (b, cb) in zip(pts, pts[1:]):
            if n <= b:
                return ca + (cb - ca) * (n - a) / (b - a)
        (a, ca), (b, cb) = pts[-2:]
        return cb + max(cb - ca, 0.0) * (n - b) / (b - a)

    def to_dict(self) -> dict:
        return {"draft": self.draft, "verify": {str(k): v for k, v in sorted(self.verify.items())}}

    @classmethod
    def from_dict(cls, d: dict) -> "Costs":
        """Read :meth:`to_dict`'s output; ValueError if it is not sound."""
        return cls(float(d["draft"]), {int(k): float(v) for k, v in d["verify"].items()})


@dataclass
class Policy:
    """Chooses each round's length for one generation.

    Before the draft pass, :meth:`drafts` says whether to run it: yes while
    recent drafting rounds committed more tokens per unit of cost than plain
    steps (1 / ``plain``); otherwise take plain steps and probe again after
    1, 2, 4, ... of them. After the pass, :meth:`length` picks the L that
    maximises E(L) - r * verify(L), r being recent drafting's tokens per
    step (at least plain's), where a draft token's chance of
    being accepted (given the ones before) is how often guesses of its
    confidence at that depth in the block were accepted in this stretch of
    drafting, starting from the confidence itself; reading the confidences
    waits for the draft pass, so a round after one that looked verifies the
    length the last confidences chose without waiting, until they would
    choose less (:meth:`looks`). Each probe starts a fresh stretch and
    verifies at most ``probe_limit`` tokens: a confident but wrong draft
    would make every probe a long, wasted verify. What the policy learnt
    carries over from one generation to the next with the same draft
    (:meth:`recall`, :meth:`remember`): a draft found useless is not probed
    afresh, at a draft pass each, at the start of every generation.

    The measured costs are taken on a throwaway cache, forwards alone; in
    the loop, rounds also pay their bookkeeping, and a verify's attention
    reads the generation's own context. With ``clock``, :meth:`update` is
    given each round's wall time, and a plain step's cost in the model's
    units becomes (seconds per plain step) / (seconds per modelled unit of
    drafting rounds), both decaying averages, once each has a few rounds.

    Args:
        costs: The cost model.
        block_size: The draft's trained block size (the longest round).
        memory: Decay per drafting round of the acceptance statistics.
        recent: Decay per drafting round of the tokens and costs that
            measure drafting's speed.
        prior: Pseudo-trials behind "acceptance = confidence".
        max_wait: The longest run of plain steps between probes.
        probe_limit: The most tokens a probe verifies.
        shade: Probes after at least this many plain steps in a row are
            taken in the shadow of plain steps where the loop can
            (:meth:`shades`).
        bins: Confidence bins of the acceptance statistics.
        plain: The cost of a plain step: 1 (the unit) where the loop
            pipelines them, else (None) ``costs.verify_at(1)``.
        clock: Correct ``plain`` from the rounds' wall times (see above).
        decay: Decay per timed round of the same kind (plain or drafting).
    """

    costs: Costs
    block_size: int
    memory: float = 0.98
    recent: float = 0.9
    prior: float = 1.0
    max_wait: int = 128
    probe_limit: int = 4
    shade: int = 4
    bins: int = 10
    plain: Optional[float] = None
    clock: bool = False
    decay: float = 0.95
    made: float = field(init=False, default=0.0)  # tokens of recent drafting rounds
    spent: float = field(init=False, default=0.0)  # and their cost, in plain steps
    wait: int = field(init=False, default=0)
    skip: int = field(init=False, default=0)  # plain steps left before a probe
    probe: bool = field(init=False, default=True)
    blind: int = field(init=False, default=0)  # tokens verified without looking (see :meth:`looks`)
    # Decaying sums: plain seconds, plain steps, drafting seconds, their modelled cost.
    timed: List[float] = field(init=False, default_factory=lambda: [0.0] * 4)

    def __post_init__(self):
        if self.plain is None:
            self.plain = self.costs.verify_at(1)
        self._reset()

    def _reset(self):
        cells = self.bins * GROUPS  # by confidence bin and offset group (see cell)
        self.hits, self.trials = [0.0] * cells, [0.0] * cells
        self._seen: List[float] = []

    def recall(self, draft) -> "Policy":
        """Go on from where the last generation with ``draft`` left off."""
        for k, v in memo(draft).get("policy", {}).items():
            setattr(self, k, list(v) if isinstance(v, list) else v)
        return self

    def remember(self, draft) -> None:
        """Keep what this generation learnt for the next one with ``draft``."""
        keys = ("wait", "skip", "probe", "blind", "made", "spent", "hits", "trials", "timed")
        memo(draft)["policy"] = {k: getattr(self, k) for k in keys}

    @staticmethod
    def forget(draft) -> None:
        """Drop what generations with ``draft`` taught (e.g. after a warm-up
        on a throwaway prompt), so the next one starts afresh."""
        _learnt.pop(id(draft), None)

    def drafts(self, after: int = 0) -> bool:
        """Whether this round (or, with ``after`` plain steps taken first, a
        later one) runs the draft, else it is a plain step."""
        return self.skip <= after

    def shades(self) -> bool:
        """Whether this probe runs its draft pass beside plain steps and is
        judged by the tokens they choose, instead of verifying: a draft
        pass's cost instead of a synchronised verify's, for a draft found
        useless again and again (a few tokens later, where it is right)."""
        return self.probe and self.wait >= self.shade

    def looks(self) -> bool:
        """Whether this drafting round reads the confidences before choosing
        its length. Reading them waits for the draft pass (a host
        synchronisation before the verify can be queued), so after a round
        that looked, the next verifies ``blind`` tokens, what that round's
        confidences chose, and reads its own after its verify: they set the
        next length while they choose as many or more, else the next round
        looks (:meth:`saw`)."""
        return self.probe or not self.blind

    def cell(self, c: float, i: int) -> int:
        """The statistics' cell of the ``i``-th guess (from 0) of confidence
        ``c``: at one confidence, a draft's guesses are accepted more or less
        often by their depth in the block, so offsets 1, 2, 3-4, 5-8 and 9+
        count apart."""
        return min(i.bit_length(), GROUPS - 1) * self.bins + min(int(c * self.bins), self.bins - 1)

    def chance(self, c: float, i: int) -> float:
        """The estimated acceptance chance of the ``i``-th guess (from 0),
        of confidence ``c``."""
        k = self.cell(c, i)
        return (self.hits[k] + self.prior * c) / (self.trials[k] + self.prior)

    def length(self, conf: List[float], limit: int) -> int:
        """Tokens to verify (1..``limit``) after a draft pass whose top
        probabilities at offsets 1..limit-1 are ``conf``."""
        gain = self.expect(conf, limit)
        # Maximise E(L) - rate * cost(L), rate being drafting's recent tokens
        # per step (at least plain's): the choice that maximises the long-run
        # rate (a round's own ratio E/cost cuts good rounds short).
        rate = max(self.made / self.spent if self.spent else 0.0, 1 / self.unit())
        best, top = 1, -math.inf
        for n, e in enumerate(gain, 1):
            score = e - rate * self.costs.verify_at(n)
            if score > top:
                best, top = n, score
        self.blind = 0 if self.probe else best
        return self.chose(conf, best)

    def expect(self, conf: List[float], limit: int) -> List[float]:
        """Expected tokens committed by verifying 1, 2, ... tokens after a
        draft pass with confidences ``conf`` (a probe: at most ``probe_limit``)."""
        if self.probe:
            self._reset()
            limit = min(limit, self.probe_limit)
        reach, gain = 1.0, [1.0]
        for i, c in enumerate(conf[: limit - 1]):
            reach *= self.chance(c, i)
            gain.append(gain[-1] + reach)
        return gain

    def saw(self, conf: List[float], n: int) -> None:
        """The confidences of a round verified blind at ``n`` tokens, read
        after the verify: the next round verifies what they choose blind
        too, unless that is less than ``n`` (the draft grew unsure: look)."""
        if self.length(conf, len(conf) + 1) < n:
            self.blind = 0
        self.chose(conf, n)

    def chose(self, conf: List[float], n: int) -> int:
        """Record that ``n`` tokens are verified after this draft pass; ``n``."""
        self._seen = list(conf[: n - 1])
        return n

    def unit(self) -> float:
        """A plain step's cost in the model's units: ``plain``, or with
        ``clock`` and a few timed rounds of each kind, as measured."""
        ps, pn, ds, dn = self.timed
        if self.clock and pn >= 4 and dn >= 4 and ds > 0:
            return min(max((ps / pn) / (ds / dn), 0.5), 2.0)
        return self.plain

    def update(self, verified: int, accepted: int, drafted: bool, seconds: Optional[float] = None) -> None:
        """Learn from a round that verified ``verified`` tokens and accepted
        ``accepted`` drafts, after a draft pass or not, and took ``seconds``
        (wall time, if known)."""
        cost = self.costs.draft + self.costs.verify_at(verified) if drafted else 1.0
        if self.clock and seconds is not None:
            i = 2 if drafted else 0
            t, n = self.timed[i : i + 2]
            if n >= 4:  # a pause of the machine weighs like a slow round, no more
                seconds = min(seconds, 3 * cost * t / n)
            self.timed[i : i + 2] = [self.decay * t + seconds, self.decay * n + cost]
        if not drafted:
            self.skip = max(self.skip - 1, 0)
            return
        self.hits = [h * self.memory for h in self.hits]
        self.trials = [t * self.memory for t in self.trials]
        for i, c in enumerate(self._seen[: accepted + 1]):
            k = self.cell(c, i)
            self.hits[k] += i < accepted
            self.trials[k] += 1
        keep = 0.0 if self.probe else self.recent
        self.made = keep * self.made + accepted + 1
        self.spent = keep * self.spent + cost
        self.probe = self.made * self.unit() < self.spent  # plain steps: 1 token each
        if self.probe:
            self.blind = 0
            self.wait = min(max(1, 2 * self.wait), self.max_wait)
            self.skip = self.wait
        else:
            self.wait = 0


# id(draft) -> what its generations learnt (see memo).
_learnt: Dict[int, dict] = {}


def memo(draft) -> dict:
    """What generations with ``draft`` learnt (the policy's state, the
    proposal's temperature), kept while the draft lives."""
    if id(draft) not in _learnt:
        _learnt[id(draft)] = {}
        weakref.finalize(draft, _learnt.pop, id(draft), None)
    return _learnt[id(draft)]


# (id(model), id(draft)) -> costs measured by all ranks of a distributed run.
_measured: Dict[tuple, Costs] = {}


# ------------------------------------------------------------ calibration


def measure_costs(target, draft, budget: float = 4.0, reps: int = 24, width: int = 1) -> Costs:
    """Time verify forwards of a few lengths and a draft pass on a throwaway
    cache, as a round runs them (token choice, rollback, synchronisation):
    up to ``reps`` passes over them all within about ``budget`` seconds,
    each op's median over the passes of its time in that pass's plain step,
    the unit: a plain step as the loop runs them, pipelined.

    With ``width`` B > 1, the verify forwards run on B rows at once (batched
    caches, :mod:`.batch`) and the costs are one row's share, in units of
    its share of a batched plain step: draft = t_draft / (t_B(1) / B),
    verify(L) = t_B(L) / t_B(1)."""
    from mlx_lm.models.cache import BatchKVCache

    from .rollback import rollback, trims_exactly
    from .sampling import greedy

    ids = draft.config.target_layer_ids
    cache, dcache = target.make_cache(), draft.make_cache()
    vocab = draft.config.draft_vocab
    head = target.head_over(mx.array(vocab)) if vocab else target.head
    bs = draft.block_size
    _, feats, _ = target.forward(mx.arange(CONTEXT) % target.vocab_rows, cache, ids)
    mx.eval(feats, [c.state for c in cache])
    new = [feats]
    if width > 1:
        cache = [BatchKVCache([0] * width) for _ in cache]
        _, f, _ = target.forward(mx.arange(CONTEXT * width).reshape(width, CONTEXT) % target.vocab_rows, cache, ids)
        mx.eval(f, [c.state for c in cache])

    def verify(n):
        if width > 1:
            logits, f, _ = target.forward(mx.ones((width, n), mx.int32), cache, ids)
            greedy(logits.reshape(width * n, -1))[0].tolist()
            for c in cache:
                c.trim(n - 1)
            mx.eval(f, [c.state for c in cache])
            return
        logits, f, tape = target.forward(mx.ones((n,), mx.int32), cache, ids, True)
        greedy(logits)[0].tolist()
        rollback(cache, tape, 1, n)
        mx.eval(f, [c.state for c in cache])

    def propose():
        logits = draft.propose(mx.ones((1,), mx.int32), new[0], dcache, target.embed, head, bs)
        mx.eval(mx.argmax(logits, axis=-1), confidence(logits))
        new[0] = feats[:, -1:]

    def plain(k=4):
        # Steps as the loop runs them: each queued on the previous lazy token.
        y = mx.ones((1,), mx.int32)
        for _ in range(k):
            logits, _, _ = target.forward(y, cache, ids)
            nxt = mx.argmax(logits[-1:], axis=-1).astype(mx.int32)
            mx.async_eval(nxt)
            y.tolist()
            y = nxt
        y.tolist()
        for c in cache:
            c.trim(k)
        return k

    ops = {n: (lambda n=n: verify(n)) for n in sorted({*(L for L in LENGTHS if L <= bs), bs})}
    ops["draft"] = propose
    if width == 1 and all(trims_exactly(c) for c in cache):  # as the loop pipelines
        ops["plain"] = plain
    # Each pass times every op once; a pass's costs are its times over its
    # own unit, and the median pass is kept: the machine's pace drifts
    # between passes (the fastest time of each op, taken apart, came out
    # 40% apart on one pair from one measurement to the next).
    passes = []
    start = time.perf_counter()
    for r in range(reps + 1):  # the first pass warms up
        t = {}
        for k, op in ops.items():
            tic = time.perf_counter()
            steps = op() or 1
            t[k] = (time.perf_counter() - tic) / steps
        if r:
            unit = min(t[1], t.get("plain", math.inf))
            passes.append({k: v / unit for k, v in t.items()})
        if r >= 2 and time.perf_counter() - start > budget:
            break
    mid = {k: statistics.median(p[k] for p in passes) for k in passes[0]}
    verify_costs, last = {}, 0.0
    for n in sorted(k for k in mid if isinstance(k, int)):
        last = max(last, mid[n])  # timing noise must not make longer cheaper
        verify_costs[n] = last
    return Costs(mid["draft"] * width, verify_costs)


def cache_key(target, draft) -> dict:
    """What the costs depend on: both models' shapes and configs, the device,
    the platform and the library versions."""
    import mlx_lm

    model = target.model
    args = getattr(model, "args", None)
    args = asdict(args) if is_dataclass(args) else getattr(args, "__dict__", None)
    shapes = [
        [(k, v.shape, str(v.dtype)) for k, v in tree_flatten(m.parameters())] for m in (model, draft)
    ]
    config = json.dumps([args, draft.config.to_dict(), shapes], default=str, sort_keys=True)
    return {
        "version": VERSION,
        "model": type(model).__module__,
        "models": hashlib.sha256(config.encode()).hexdigest(),
        "device": str(mx.default_device()),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "openblas": "openblas" in os.environ.get("LD_PRELOAD", ""),
    }


def cached_costs(target, draft, root: Optional[Path] = None, width: int = 1) -> Costs:
    """The cost model of this pair on this machine (for ``width`` rows
    decoded together, see :func:`measure_costs`): read from
    ``<root>/costs/`` (default :func:`dflash_mlx.models.gguf.cache_root`), or
    measured (a few seconds) and saved. An unreadable file is measured
    again, with a warning."""
    from ..models import distributed
    from ..models.gguf import cache_root

    if distributed.group() is not None:
        # Every rank measures the same number of times (the target's collectives
        # must match), then all use rank 0's costs, so they choose the same lengths.
        # Once per process and pair: every rank serves the same generations.
        key = (id(target.model), id(draft))
        if key not in _measured:
            costs = measure_costs(target, draft, budget=math.inf)
            keys = sorted(costs.verify)
            values = distributed.agree_floats([costs.draft] + [costs.verify[k] for k in keys])
            _measured[key] = Costs(values[0], dict(zip(keys, values[1:])))
            weakref.finalize(draft, _measured.pop, key, None)
        return _measured[key]
    key = cache_key(target, draft)
    if width > 1:
        key["width"] = width
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    path = Path(root or cache_root()) / "costs" / f"{name}.json"
    if path.exists():
        try:
            d = json.loads(path.read_text())
            if d.get("key") != key:
                raise ValueError("it was made for other models or another machine")
            return Costs.from_dict(d)
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
            warnings.warn(f"Ignoring the unreadable cost cache {path} ({e}); measuring again.")
    costs = measure_costs(target, draft, width=width)
    try:
        _write(path, {"key": key, **costs.to_dict()})
    except OSError as e:
        warnings.warn(f"Could not save the cost cache {path} ({e}).")
    return costs


def _write(path: Path, data: dict) -> None:
    """Write JSON atomically: readers see the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "x") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
