"""What ``block_size="auto"`` learnt about a target and draft, kept between
runs of the command line (in a process, the policy already carries over).

A fresh policy spends the first rounds of a generation finding out which
length pays; in a one-shot run of 128 tokens that cost 15-19% (toy target,
a good held-out draft, 2026-12-06). Each run starts from what the last one
with the same target, draft and settings left, and adapts from there as it
does between generations in one process. The file is a cache: unreadable or
not matching, it is ignored (and replaced at the end of the run).
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

from .policy import Policy, memo


def folder() -> Path:
    """Where the policies are kept: ``$DFLASH_MLX_CACHE``, else
    ``$XDG_CACHE_HOME/dflash_mlx`` (``~/.cache/dflash_mlx``)."""
    root = os.environ.get("DFLASH_MLX_CACHE")
    if not root:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dflash_mlx"
    return Path(root) / "auto"


def _file(key: str) -> Path:
    name = f"{key}|{mx.__version__}|{platform.machine()}|{mx.default_device()}"
    return folder() / (hashlib.sha256(name.encode()).hexdigest()[:20] + ".json")


def recall(draft, key: str) -> bool:
    """Start ``draft``'s policy from what the last run with ``key`` (the
    target, the draft and their settings) left, if anything; whether it did."""
    try:
        state = json.loads(_file(key).read_text())
        policy = _policy(draft.block_size, state)
    except (OSError, ValueError, TypeError, KeyError):
        return False
    memo(draft)["policy"] = policy
    return True


def keep(draft, key: str) -> None:
    """Save what ``draft``'s policy learnt, for the next run with ``key``
    (written whole or not at all; a failure to write is not an error)."""
    p = memo(draft).get("policy")
    if p is None:
        return
    state = {
        "block_size": p.block_size,
        "times": [[w, n, s, r] for (w, n), (s, r) in p.times.items()],
        "own": {str(n): c for n, c in p.own.items()},
        "spent": p.spent,
        "lost": p.lost,
    }
    path, tmp = _file(key), None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(state, f)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


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
    for n, (hits, trials) in state["own"].items():
        n = int(n)
        if n not in p.lengths or len(hits) != n - 1 or len(trials) != n - 1:
            raise ValueError(f"counts of length {n}")
        p.own[n] = [[_number(h) for h in hits], [_number(t) for t in trials]]
    p.spent, p.lost = _number(state["spent"]), _number(state["lost"])
    return p


def _number(x) -> float:
    """``x`` as a float, if it is one a policy can hold (finite, not negative)."""
    x = float(x)
    if not 0 <= x < math.inf:
        raise ValueError(f"{x} out of range")
    return x


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
