"""One generation at a time, honestly: requests wait in arrival order and one worker thread
runs them through the Speculator, whose target cache a request sharing an earlier prefix
reuses.

A job posts what happens to it (Started, each token, Finished or Failed) through the
callback it was made with; the HTTP side turns those into responses. A job that is
cancelled (its client went away, or the server is stopping) stops within one step of the
engine; one cancelled while it waits never starts. Nothing here knows of HTTP.
"""

from __future__ import annotations

import math
import queue
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Union

from speccli.config import SamplingConfig, SpecConfig
from speccli.events import FinishEvent, TokenEvent

if TYPE_CHECKING:  # pragma: no cover
    from speccli.api import Generation, Speculator


@dataclass(frozen=True)
class Started:
    """The job left the queue: its generation begins."""


@dataclass(frozen=True)
class Token:
    event: TokenEvent


@dataclass(frozen=True)
class Finished:
    """The generation ended (also when it was cancelled: `generation.finished` says which)."""

    generation: Generation
    seconds: float


@dataclass(frozen=True)
class Failed:
    message: str
    stopping: bool = False  # the server is shutting down, not a fault of the request


Update = Union[Started, Token, Finished, Failed]


@dataclass
class Job:
    """One request's generation: token ids, settings, and where its updates go."""

    prompt_ids: list[int]
    sampling: SamplingConfig
    spec: SpecConfig
    post: Callable[[Update], None]
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()


class QueueFull(Exception):
    def __init__(self, waiting: int, retry_after: int) -> None:
        super().__init__(f"{waiting} requests are already waiting")
        self.waiting = waiting
        self.retry_after = retry_after


class ShuttingDown(Exception):
    pass


@dataclass
class Counts:
    """What the server has done since it started (GET /health shows them)."""

    finished: int = 0  # generations that ran to their end
    cancelled: int = 0  # stopped early or never started: the client went away, or the server stopped
    failed: int = 0
    tokens: int = 0  # tokens generated, cancelled generations included

    def as_dict(self) -> dict:
        return {"finished": self.finished, "cancelled": self.cancelled, "failed": self.failed, "tokens": self.tokens}


class GenerationService:
    """The worker thread and its queue over one Speculator."""

    def __init__(
        self,
        speculator: Speculator,
        max_queue: int,
    ) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be 0 or more, got {max_queue}")
        self.speculator = speculator
        self.max_queue = max_queue
        self.counts = Counts()
        self._waiting: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._running: Job | None = None
        self._stopping = False
        self._durations: deque[float] = deque(maxlen=16)
        self._thread = threading.Thread(target=self._work, name="specgen-generation", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return self._waiting.qsize()

    @property
    def busy(self) -> bool:
        return self._running is not None

    @property
    def stopping(self) -> bool:
        return self._stopping

    def submit(self, job: Job) -> None:
        """Queue a job, or refuse it: QueueFull past max_queue waiting, ShuttingDown once stopping."""
        with self._lock:
            if self._stopping:
                raise ShuttingDown()
            waiting = self._waiting.qsize()
            if self._running is not None and waiting >= self.max_queue:
                raise QueueFull(waiting, self._retry_after())
            self._waiting.put(job)

    def _retry_after(self) -> int:
        """Seconds until a place is likely free: a place frees when the running generation ends,
        priced at the mean of the recent ones (1 s before any has finished)."""
        mean = sum(self._durations) / len(self._durations) if self._durations else 1.0
        return max(1, math.ceil(mean))

    def stop(self, timeout: float = 10.0) -> None:
        """Refuse new jobs, cancel the running one and every waiting one, and end the worker."""
        with self._lock:
            self._stopping = True
            running = self._running
        if running is not None:
            running.cancel()
        self._waiting.put(None)
        self._thread.join(timeout)

    def _work(self) -> None:
        while True:
            job = self._waiting.get()
            if job is None:
                self._drain()
                return
            with self._lock:
                if self._stopping:
                    self._refuse(job)
                    continue
                self._running = job
            try:
                if job.cancelled.is_set():  # its client went away while it waited
                    self.counts.cancelled += 1
                    continue
                self._generate(job)
            except Exception as error:  # noqa: BLE001 - one request's fault must not end the server
                self.counts.failed += 1
                print("specgen: a generation failed (the server goes on):", file=sys.stderr)
                traceback.print_exc(file=sys.stderr)
                job.post(Failed(f"the generation failed: {type(error).__name__}: {error}"))
            finally:
                with self._lock:
                    self._running = None

    def _drain(self) -> None:
        while True:
            try:
                job = self._waiting.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                self._refuse(job)

    def _refuse(self, job: Job) -> None:
        self.counts.cancelled += 1
        job.post(Failed("the server is shutting down", stopping=True))

    def _generate(self, job: Job) -> None:
        started = time.perf_counter()
        generation = self.speculator.stream(job.prompt_ids, job.sampling, job.spec)
        job.post(Started())
        posted = False
        for response in generation:
            if job.cancelled.is_set():
                generation.close()  # what it held back is not sent: nobody is listening
                break
            token = response.token
            if token is not None:
                job.post(Token(token))
            elif isinstance(response.event, FinishEvent):
                # The answer is complete: the client has it now, while what `k auto` learned is
                # kept (on disk) after the last event, before the next job starts.
                self._finished(job, generation, started)
                posted = True
        if not posted:
            self._finished(job, generation, started)

    def _finished(self, job: Job, generation: Generation, started: float) -> None:
        seconds = time.perf_counter() - started
        self.counts.tokens += len(generation.tokens)
        if generation.finished:
            self.counts.finished += 1
            self._durations.append(seconds)
        else:
            self.counts.cancelled += 1
        job.post(Finished(generation, seconds))
