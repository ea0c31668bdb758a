"""Running on a target sharded over several processes (``mlx.launch``).

Every rank loads the whole draft and its shard of the target, and runs the same
rounds; the target's collectives keep the ranks in step. Only rank 0 speaks.
A process counts as launched when ``mlx.launch`` (or MPI) set its rank in the
environment; otherwise nothing here touches ``mx.distributed``.
"""

import ctypes
import json
import os
import socket
import sys
import threading
import zlib
from contextlib import contextmanager
from typing import Optional

import mlx.core as mx

from ..errors import DFlashError

_LAUNCH_VARS = ("MLX_RANK", "MLX_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
_group = None
# Seconds a collective may wait for the other ranks before this rank gives up.
TIMEOUT_VAR = "DFLASH_MLX_COLLECTIVE_TIMEOUT"


class DistributedError(DFlashError, RuntimeError):
    """The ranks of a distributed run lost each other or disagree."""


def group() -> Optional[mx.distributed.Group]:
    """The group of all ranks when launched with more than one, else None."""
    global _group
    if _group is None:
        if not any(v in os.environ for v in _LAUNCH_VARS):
            _group = False
        else:
            g = mx.distributed.init()
            _group = g if g.size() > 1 else False
            if _group:
                _share_cores(g)
    return _group or None


def _share_cores(g: mx.distributed.Group) -> None:
    """Ranks on one machine share its cores: give each one's OpenBLAS (the
    Linux CPU backend) its share of threads, unless OPENBLAS_NUM_THREADS is
    set. Two local ranks running 2 BLAS threads each on 2 cores ran DFlash
    2.1x slower than with 1 each, its draft pass 4x slower."""
    if sys.platform != "linux" or "OPENBLAS_NUM_THREADS" in os.environ:
        return
    try:
        set_threads = ctypes.CDLL(None).openblas_set_num_threads
    except (OSError, AttributeError):  # OpenBLAS not loaded
        return
    host = zlib.crc32(socket.gethostname().encode()) & 0x3FFFFFFF
    mine = mx.where(mx.arange(g.size()) == g.rank(), host, 0).astype(mx.int32)
    local = mx.distributed.all_sum(mine, group=g).tolist().count(host)
    set_threads(max(1, (os.cpu_count() or 1) // local))


def rank() -> int:
    g = group()
    return g.rank() if g is not None else 0


def quiet_followers() -> None:
    """Send the standard output of every rank but 0 to /dev/null; errors
    still reach stderr."""
    if rank() != 0:
        sys.stdout = open(os.devnull, "w")


def agree(values: mx.array, same: Optional[mx.array] = None) -> mx.array:
    """Rank 0's ``values`` (an int array) on every rank, in one small
    collective; with ``same``, raise DistributedError unless it is equal on
    all ranks (the block each rank verified). One process: ``values``."""
    g = group()
    if g is None:
        return values
    values = values.astype(mx.int32)
    # Zeros computed from the values: each rank's sum must wait for the
    # target's own collectives, or ranks would pair up different all_sums.
    mine = values * int(g.rank() == 0)
    same = mx.zeros((0,), mx.int32) if same is None else same.reshape(-1).astype(mx.int32)
    total = sum_ranks(mx.concatenate([mine, same]))
    n = values.shape[0]
    if same.size and not mx.array_equal(total[n:], same * g.size()).item():
        raise DistributedError(
            f"rank {g.rank()} verified other tokens than the other ranks: the ranks "
            "diverged (different drafts, weights or library versions?)."
        )
    return total[:n]


def agree_floats(values):
    """Rank 0's list of floats on every rank (e.g. measured costs)."""
    g = group()
    if g is None:
        return list(values)
    x = mx.array(values, mx.float32)
    return sum_ranks(x * int(g.rank() == 0)).tolist()


def share(obj=None):
    """Rank 0's JSON-able ``obj`` on every rank; the others pass nothing and
    wait for it (as long as it takes: a serving follower waits for requests).
    One process: ``obj``."""
    g = group()
    if g is None:
        return obj
    data = json.dumps(obj).encode() if g.rank() == 0 else b""
    n = sum_ranks(mx.array([len(data)], mx.int32), None).item()
    got = sum_ranks(mx.array(list(data.ljust(n, b"\0")) if data else [0] * n, mx.int32), None)
    return json.loads(bytes(got.tolist()))


def sum_ranks(x: mx.array, during: Optional[str] = "a round") -> mx.array:
    """The sum of ``x`` over all ranks, evaluated now; a lost peer raises
    DistributedError, and waiting longer than the watchdog allows ends the
    process (``during`` names the wait; None: no limit, e.g. an idle follower)."""
    try:
        out = mx.distributed.all_sum(x, group=group())
        if during is None:
            mx.eval(out)
        else:
            with watchdog(during):
                mx.eval(out)
    except RuntimeError as e:
        raise lost(e) from None
    return out


@contextmanager
def watchdog(what: str):
    """Exit this process (code 1, one clear line) if the block does not finish
    within $DFLASH_MLX_COLLECTIVE_TIMEOUT seconds (default 600): a rank that
    is alive but stuck, or ranks waiting in different collectives, would
    otherwise hang every rank for ever, spinning."""
    try:
        seconds = float(os.environ.get(TIMEOUT_VAR, "600"))
    except ValueError:
        seconds = 600.0

    def fire():
        sys.stderr.write(
            f"rank {rank()}: the other ranks did not answer for {seconds:g} s during {what}; "
            f"one is stuck or gone. Exiting (set ${TIMEOUT_VAR} to wait longer).\n"
        )
        sys.stderr.flush()
        os._exit(1)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def lost(e: Exception) -> DistributedError:
    """The error of a rank whose peers are gone."""
    return DistributedError(
        f"rank {rank()}: lost the connection to another rank ({str(e).splitlines()[0]}); "
        "it probably failed, see its error above."
    )
