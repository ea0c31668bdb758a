"""The server's model thread: every MLX operation of the server runs on it.

MLX gives each thread its own streams, and a lazy array can only be evaluated
on the thread whose stream made it. So the HTTP threads never touch the model,
its caches or any array: they hand a :class:`Job` to this thread and read back
plain Python values. Up to ``width`` jobs are decoded together in one
:class:`.batch.Batch` when the target allows it, else one at a time with
:func:`.stream_generate`.
"""

import collections
import logging
import threading
from typing import Callable, Optional, Protocol

import mlx.core as mx
from mlx_lm.generate import generation_stream

from ..engine.batch import Batch
from ..engine.decoding import GenerationResponse, stream_generate
from ..errors import GenerationArgumentError, UnsupportedModelError

log = logging.getLogger(__name__)


class Job(Protocol):
    """A generation as the model thread runs it (all its calls are made there)."""

    gone: threading.Event  # set by the client's side: stop as soon as you can

    def start(self) -> dict:
        """The keyword arguments of :meth:`.Batch.add` (prompt, max_tokens,
        sampling, prompt_cache, draft_cache)."""

    def feed(self, r: GenerationResponse) -> bool:
        """Take the next response; False: stop here (e.g. a stop string)."""

    def end(self, clean: bool) -> None:
        """The generation is over; ``clean``: its prompt cache holds exactly
        the tokens fed (it may be kept for later requests)."""

    def fail(self, e: BaseException) -> None:
        """The generation failed with ``e`` (``end`` is not called)."""


class Scheduler:
    """The thread that owns a model and runs every job on it.

    Args:
        model, draft, tokenizer, block_size: The pair, as for :func:`.stream_generate`.
        width: The most jobs decoded together (1: one at a time).
        sticky: Run every job to its end even if its client goes (ranks of a
            sharded target must all run the same forwards).
        idle: Called on the model thread whenever the last job has ended and
            none waits (e.g. to save what ``auto`` learnt).
    """

    def __init__(self, model, draft, tokenizer, block_size="auto", width: int = 4, sticky: bool = False,
                 idle: Optional[Callable[[], None]] = None):
        self.model, self.draft, self.tokenizer, self.block_size = model, draft, tokenizer, block_size
        self.width, self.sticky, self.idle = width, sticky, idle
        self.batch: Optional[Batch] = None
        self._waiting: collections.deque = collections.deque()
        self._wake = threading.Condition()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dflash-model", daemon=True)
        self._thread.start()
        self._ready.wait()

    def submit(self, job: Job) -> None:
        """Queue ``job`` (jobs start in arrival order)."""
        with self._wake:
            self._waiting.append(job)
            self._wake.notify()

    def wake(self) -> None:
        """Look at the jobs again now (a client went)."""
        with self._wake:
            self._wake.notify()

    def call(self, fn: Callable):
        """Run ``fn()`` on the model thread between rounds and return its result."""
        done, out = threading.Event(), {}

        def run():
            try:
                out["value"] = fn()
            except BaseException as e:
                out["error"] = e
            done.set()

        self.submit(run)
        done.wait()
        if "error" in out:
            raise out["error"]
        return out.get("value")

    def _loop(self) -> None:
        with mx.stream(generation_stream):
            self.batch = self._make_batch()
            self._ready.set()
            jobs = {}
            while True:
                try:
                    self._turn(jobs)
                except Exception as e:  # never expected: fail the jobs in it, keep serving
                    log.exception("Generation failed")
                    for job in jobs.values():
                        job.fail(e)
                    jobs.clear()
                    if self.batch is not None:
                        self.batch.clear()

    def _make_batch(self) -> Optional[Batch]:
        if self.width <= 1:
            return None
        try:
            return Batch(self.model, self.draft, self.tokenizer, self.block_size)
        except (GenerationArgumentError, UnsupportedModelError) as e:  # mlx.launch, recurrent caches
            log.info("Requests run one at a time: %s", e)
            return None

    def _turn(self, jobs: dict) -> None:
        """Admit waiting jobs, drop those whose client left, run a round."""
        with self._wake:
            while not jobs and not self._waiting:
                self._wake.wait()
            admit = []
            width = self.width if self.batch is not None else 1
            while self._waiting and (callable(self._waiting[0]) or len(jobs) + len(admit) < width):
                admit.append(self._waiting.popleft())
        for job in admit:
            if callable(job):
                job()
            elif self.batch is None:
                self._alone(job)
            elif not job.gone.is_set():
                try:
                    jobs[self.batch.add(**job.start())] = job
                except Exception as e:  # a bad request: its own error, the others go on
                    job.fail(e)
        for key in [k for k, j in jobs.items() if j.gone.is_set() and not self.sticky]:
            log.info("A client left: its generation stopped after %d tokens.", self.batch.rows[key].n)
            self.batch.remove(key)
            jobs.pop(key).end(False)
        if jobs:
            for key, r in self.batch.step():
                job = jobs.get(key)
                if job is None:  # stopped earlier in this step
                    continue
                more = job.feed(r)
                if r.finish_reason:  # it has left the batch
                    jobs.pop(key).end(True)
                elif not more:  # a stop string: the rest is not wanted
                    self.batch.remove(key)
                    jobs.pop(key).end(False)
        if self.idle is not None and not jobs and not self._waiting:
            self.idle()

    def _alone(self, job: Job) -> None:
        """Run ``job`` on its own with :func:`.stream_generate`."""
        if job.gone.is_set() and not self.sticky:
            return job.end(False)
        try:
            kw = job.start()
            inner = stream_generate(self.model, self.draft, self.tokenizer, kw.pop("prompt"),
                                    block_size=self.block_size, **kw)
            fed = False
            try:
                for r in inner:
                    fed = True
                    if not job.feed(r) or (job.gone.is_set() and not self.sticky):
                        break
            finally:
                inner.close()
        except Exception as e:
            return job.fail(e)
        job.end(fed)

