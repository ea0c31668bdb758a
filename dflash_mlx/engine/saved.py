"""What ``block_size="auto"`` learnt about a target and draft, kept between
runs of the command line and restarts of the server (in a process, the
policy already carries over).

A fresh policy spends the first rounds of a generation finding out which
length pays: in one-shot runs of 128 tokens on the toy target with its two
good drafts it made 0.72-0.81 of the best fixed block, a recalled one
0.91-0.98 (docs/measurements.md, 2026-12-06). Each run starts from what the last one
with the same target, draft and settings left (a policy for greedy generations
and one for sampled ones), and adapts from there as it does between
generations in one process. The file is a cache: unreadable or
not matching, it is ignored (and replaced when the policy is next kept).
"""

import hashlib
import json
import math
import os
import platform
import tempfile
from pathlib import Path
from typing import Optional

import mlx.core as mx

from ..models.gguf import cache_root
from .policy import Policy, memo


def folder() -> Path:
    """Where the policies are kept: ``auto/`` in the cache root (``$DFLASH_MLX_CACHE``,
    else ``$XDG_CACHE_HOME/dflash_mlx``, ``~/.cache/dflash_mlx``)."""
    return cache_root() / "auto"


FILES = 64  # the most policies kept: the least recently kept go first


FORMAT = 2  # what the file's numbers mean: changed with the Policy's fields


def _file(key: str) -> Path:
    name = f"{FORMAT}|{key}|{mx.__version__}|{platform.machine()}|{mx.default_device()}"
    return folder() / (hashlib.sha256(name.encode()).hexdigest()[:20] + ".json")


REGIMES = {"greedy": False, "sampled": True}  # a file's policies: Policy.of(draft, sampled)


def recall(draft, key: str) -> bool:
    """Start ``draft``'s policies (greedy, sampled) from what the last run
    with ``key`` (the target, the draft and their settings) left, if
    anything; whether it did."""
    try:
        state = json.loads(_file(key).read_text())
        if not state or set(state) - set(REGIMES):
            raise ValueError("no policy or an unknown one")
        policies = {name: _policy(draft.block_size, s) for name, s in state.items()}
    except Exception:  # a cache: whatever is wrong with it, start afresh
        return False
    for name, p in policies.items():
        memo(draft)[("policy", REGIMES[name])] = p
    return True


def keep(draft, key: Optional[str]) -> None:
    """Save what ``draft``'s policies learnt, for the next run with ``key``
    (written whole or not at all; a failure to write is not an error), and
    drop the oldest beyond :data:`FILES`. Nothing is kept where :func:`start`
    gave no key."""
    found = {name: memo(draft).get(("policy", sampled)) for name, sampled in REGIMES.items()}
    state = {name: _state(p) for name, p in found.items() if p is not None}
    if key is None or not state:
        return
    tmp = None
    try:
        path = _file(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(state, f)
        os.replace(tmp, path)
        tmp = None
        by_age = sorted(path.parent.glob("*.json"), key=lambda f: f.stat().st_mtime, reverse=True)
        for old in by_age[FILES:]:
            old.unlink(missing_ok=True)
    except Exception:  # a cache: never worth failing a run for
        pass
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def _state(p: Policy) -> dict:
    """``p``'s times, counts and budget, as JSON."""
    return {"block_size": p.block_size, "times": [[w, n, s, r] for (w, n), (s, r) in p.times.items()],
            "counts": [p.hits, p.trials], "spent": p.spent, "lost": p.lost}


def _policy(block_size: int, state: dict) -> Policy:
    """A policy with ``state``'s times, counts and budget; ValueError if it
    does not fit a draft of ``block_size``."""
    p = Policy(block_size)
    if state["block_size"] != block_size:
        raise ValueError("another block size")
    for w, n, s, r in state["times"]:
        if n not in range(1, block_size + 1) or w not in range(1, 1 << 16):
            raise ValueError(f"a time of length {n}, width {w}")
        p.times[(w, n)] = [_number(s), _number(r)]
        if r and not s > 0:  # a round takes time: a zero would divide
            raise ValueError(f"a zero time of length {n}")
    hits, trials = state["counts"]
    if len(hits) != block_size - 1 or len(trials) != block_size - 1:
        raise ValueError("counts of another block size")
    p.hits, p.trials = [_number(h) for h in hits], [_number(t) for t in trials]
    if any(h > t for h, t in zip(p.hits, p.trials)):
        raise ValueError("more hits than trials")
    # lost may be below zero (plain steps next to a probe that ran faster than
    # their mean), never above what was spent
    p.spent, p.lost = _number(state["spent"]), float(state["lost"])
    if not -math.inf < p.lost <= p.spent:
        raise ValueError(f"lost {p.lost} out of range")
    return p


def _number(x) -> float:
    """``x`` as a float, if it is one a policy can hold (finite, not negative)."""
    x = float(x)
    if not 0 <= x < math.inf:
        raise ValueError(f"{x} out of range")
    return x


def start(draft, model: str, draft_path: Optional[str], block_size, fresh: bool = False,
          **settings) -> Optional[str]:
    """Start ``draft``'s policy from the last run's (see :func:`recall`) and
    return the key to :func:`keep` it under at the end, or None where nothing
    is kept (``fresh``, or see :func:`key_of`)."""
    key = None if fresh else key_of(model, draft_path, block_size, **settings)
    if key is not None:
        recall(draft, key)
    return key


def key_of(model: str, draft: Optional[str], block_size, **settings) -> Optional[str]:
    """The key under which runs with this target and draft, as named on the
    command line (local folders by their full path), keep what "auto" learnt,
    with ``settings`` that change their speed; None where nothing is kept: no
    draft, a fixed block size, or under mlx.launch (every rank must start alike)."""
    from ..models.distributed import group

    if draft is None or block_size != "auto" or group() is not None:
        return None

    def name(x: str) -> str:
        return str(Path(x).resolve()) if Path(x).exists() else x

    extra = ",".join(f"{k}={v}" for k, v in sorted(settings.items()))
    return f"{name(model)}|{name(draft)}|{extra}"
