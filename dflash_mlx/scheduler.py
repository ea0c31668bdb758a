"""The server's generation thread: requests join one :class:`.batch.Batch` as
they arrive and leave it when they finish or their client goes."""

import collections
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Generator, List, Optional

import mlx.core as mx
from mlx_lm.generate import generation_stream

from .batch import Batch
from .decoding import GenerationResponse

log = logging.getLogger(__name__)


@dataclass
class _Job:
    args: tuple
    kwargs: dict
    logprobs: bool = False
    out: queue.Queue = field(default_factory=queue.Queue)
    gone: threading.Event = field(default_factory=threading.Event)


class Scheduler:
    """Runs every generation of a model on one thread, up to ``width`` at a
    time in one batch; the others wait in arrival order.

    Args:
        batch: The (empty) batch the generations share.
        width: The most generations decoded together.
    """

    def __init__(self, batch: Batch, width: int = 4):
        self.batch, self.width = batch, width
        self._waiting: collections.deque = collections.deque()
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="dflash-scheduler", daemon=True)
        self._thread.start()

    def stream(self, prompt: List[int], max_tokens: int, logprobs: bool = False,
               **kwargs) -> Generator[GenerationResponse, None, None]:
        """Like :func:`.stream_generate` on the batch's pair (``kwargs``: the
        sampling settings, ``prompt_cache`` and ``draft_cache``). Closing the
        generator takes the generation out of the batch. ``logprobs``: the
        responses' log-probabilities are read (evaluated here, in float32:
        MLX evaluates lazy arrays on the thread that made them)."""
        job = _Job((prompt, max_tokens), kwargs, logprobs)
        with self._wake:
            self._waiting.append(job)
            self._wake.notify()
        try:
            while True:
                r = job.out.get()
                if isinstance(r, BaseException):
                    raise r
                yield r
                if r.finish_reason:
                    return
        finally:
            job.gone.set()
            with self._wake:
                self._wake.notify()

    def _loop(self) -> None:
        jobs = {}
        with mx.stream(generation_stream):
            try:  # measured now (once per machine), not in the middle of requests
                self.batch.calibrate(self.width)
            except Exception:
                log.exception("Could not measure the batched costs; they are measured when needed.")
            while True:
                try:
                    self._turn(jobs)
                except Exception as e:  # never expected: fail the rows in it, keep serving
                    log.exception("Batched generation failed")
                    for job in jobs.values():
                        job.out.put(e)
                    jobs.clear()
                    self.batch.clear()

    def _turn(self, jobs: dict) -> None:
        """Admit waiting requests, drop the ones whose client left, run a round."""
        with self._wake:
            while not jobs and not self._waiting:
                self._wake.wait()
            admit = []
            while self._waiting and len(jobs) + len(admit) < self.width:
                admit.append(self._waiting.popleft())
        for job in admit:
            if job.gone.is_set():
                continue
            try:
                jobs[self.batch.add(*job.args, **job.kwargs)] = job
            except Exception as e:  # a bad request: its own error, the others go on
                job.out.put(e)
        for key in [k for k, j in jobs.items() if j.gone.is_set()]:
            log.info("A client left: its generation stopped after %d tokens.", self.batch.rows[key].n)
            self.batch.remove(key)
            del jobs[key]
        if jobs:
            for key, r in self.batch.step():
                if jobs[key].logprobs:
                    r.logprobs = r.logprobs.astype(mx.float32)
                    mx.eval(r.logprobs)
                jobs[key].out.put(r)
                if r.finish_reason:
                    del jobs[key]
