"""Dynamic batching of model steps: concurrent requests' steps become one runner forward.

Continuous batching: when the model is free it takes what is queued, at once, unless a step is
known to be coming: a registered participant (the drafter's running tree builders, the verifier's
plain runs of several steps) that has not asked for its next step yet. Then it waits for them, at
most --max-wait-ms, or until the batch is full (--max-batch-size sessions or --max-batch-tokens
tokens). Nothing else ever waits: a Verify, or a Draft with no other builder running, goes straight
to the model when it is free. While a forward runs, new steps accumulate, so under load batches
form without any waiting. A step that does not fit waits for the next batch, in arrival order.
Every forward runs on ONE model thread, so the runner never sees two calls at once and the event
loop never blocks on the model.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from specmesh.runtime.backend import ModelBackend, Step
from specmesh.services.metrics import ServiceMetrics

log = logging.getLogger("specmesh.services.batching")


@dataclass(frozen=True)
class BatchLimits:
    max_batch_size: int
    max_batch_tokens: int
    max_wait_s: float


@dataclass(frozen=True)
class ForwardFloor:
    """A benchmark knob: the least a forward of `rows` rows lasts, fixed + per_row x rows seconds
    (the rest is slept on the model thread). A GPU's forward is nearly flat in rows, so a tiny
    model with this floor stands in for a real pair (--forward-latency-ms, --forward-ms-per-row)."""

    fixed: float = 0.0
    per_row: float = 0.0

    def __call__(self, rows: int) -> float:
        if not (self.fixed or self.per_row):
            return 0.0
        return self.fixed + self.per_row * rows


@dataclass(frozen=True)
class BatchInfo:
    """What one step's forward looked like (reported back to the caller)."""

    size: int
    tokens: int
    queue_seconds: float
    forward_seconds: float


@dataclass(eq=False)
class _Item:
    step: Step
    before: Callable[[], None] | None  # on the model thread, right before the forward
    finish: Callable[[torch.Tensor], Any] | None  # on the model thread, on this step's logits
    future: asyncio.Future
    queued_at: float

    @property
    def tokens(self) -> int:
        return len(self.step.new_tokens) + len(self.step.node_tokens)


class ForwardBatcher:
    """Merges steps of concurrent requests into one runner forward on the model thread.

    Use from the event loop (`enqueue`, `withdraw`, `join`, `leave`) or from a worker thread
    (`run_threadsafe`). See the module docstring for when a batch is dispatched. With
    participants, the max-wait clock also restarts when the model becomes idle, so a builder that
    is still sampling its level gets the same grace after every forward.
    """

    def __init__(
        self,
        runner: ModelBackend,
        model_thread: ThreadPoolExecutor,
        limits: BatchLimits,
        metrics: ServiceMetrics,
        floor: ForwardFloor = ForwardFloor(),
    ) -> None:
        """floor: a benchmark knob, the least a forward lasts by its rows (ForwardFloor)."""
        self._runner, self._model_thread, self._limits, self._metrics = runner, model_thread, limits, metrics
        self._floor = floor
        self._loop = asyncio.get_running_loop()
        self._queue: collections.deque[_Item] = collections.deque()
        self._busy = False
        self._idle_since = 0.0
        self._participants = 0
        self._timer: asyncio.TimerHandle | None = None

    # ---- loop side -----------------------------------------------------------------------------

    def join(self) -> None:
        self._participants += 1

    def leave(self) -> None:
        self._participants -= 1
        self._poke()

    def enqueue(
        self,
        step: Step,
        *,
        before: Callable[[], None] | None = None,
        finish: Callable[[torch.Tensor], Any] | None = None,
    ) -> asyncio.Future:
        """-> a future of (finish(logits) or logits, BatchInfo)."""
        item = _Item(step, before, finish, self._loop.create_future(), self._loop.time())
        self._queue.append(item)
        self._poke()
        return item.future

    def withdraw(self, future: asyncio.Future) -> None:
        """Take a step back if its forward has not started (then nothing happened to its session)."""
        for item in self._queue:
            if item.future is future:
                self._queue.remove(item)
                future.cancel()
                self._poke()
                return

    def run_threadsafe(self, step: Step, before: Callable[[], None] | None = None) -> torch.Tensor:
        """From a worker thread: queue the step and block until its logits are back."""

        async def queued() -> tuple[torch.Tensor, BatchInfo]:
            return await self.enqueue(step, before=before)

        return asyncio.run_coroutine_threadsafe(queued(), self._loop).result()[0]

    def _poke(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._busy or not self._queue:
            return
        deadline = self._deadline()
        if not self._ready() and self._loop.time() < deadline:
            self._timer = self._loop.call_at(deadline, self._poke)
            return
        batch = self._take()
        if batch:
            self._dispatch(batch)

    def _ready(self) -> bool:
        queued = len(self._queue)
        if queued >= self._limits.max_batch_size:
            return True
        if sum(item.tokens for item in self._queue) >= self._limits.max_batch_tokens:
            return True
        return self._participants <= queued  # no participant: nothing to wait for

    def _deadline(self) -> float:
        oldest = self._queue[0].queued_at
        start = max(oldest, self._idle_since) if self._participants else oldest
        return start + self._limits.max_wait_s

    def _take(self) -> list[_Item]:
        batch: list[_Item] = []
        tokens = 0
        while self._queue and len(batch) < self._limits.max_batch_size:
            item = self._queue[0]
            if item.future.done():  # cancelled, withdrawal pending
                self._queue.popleft()
                continue
            if batch and tokens + item.tokens > self._limits.max_batch_tokens:
                break
            batch.append(self._queue.popleft())
            tokens += item.tokens
        return batch

    def _dispatch(self, batch: list[_Item]) -> None:
        self._busy = True
        dispatched = self._loop.time()
        job = self._loop.run_in_executor(self._model_thread, self._execute, batch)
        job.add_done_callback(functools.partial(self._finished, batch, dispatched))

    def _finished(self, batch: list[_Item], dispatched: float, job: asyncio.Future) -> None:
        self._busy = False
        self._idle_since = self._loop.time()
        try:
            outcomes, forward_s = job.result()
        except BaseException:  # the model thread was shut down
            outcomes, forward_s = [RuntimeError("the model thread stopped")] * len(batch), 0.0
        tokens = sum(item.tokens for item in batch)
        self._metrics.batch_size.observe(len(batch))
        self._metrics.batch_tokens.observe(tokens)
        self._metrics.forward_time.observe(forward_s)
        for item, outcome in zip(batch, outcomes, strict=True):
            waited = dispatched - item.queued_at
            self._metrics.queue_wait.observe(waited)
            if item.future.done():
                continue
            if isinstance(outcome, BaseException):
                item.future.set_exception(outcome)
            else:
                item.future.set_result((outcome, BatchInfo(len(batch), tokens, waited, forward_s)))
        # one loop turn later: the callers these results wake (a plain run's next token, a level's
        # next forward) enqueue their next steps first, and make the next batch together
        self._loop.call_soon(self._poke)

    # ---- model thread --------------------------------------------------------------------------

    def _execute(self, batch: list[_Item]) -> tuple[list[Any], float]:
        outcomes: list[Any] = [None] * len(batch)
        ready = []
        for i, item in enumerate(batch):
            try:
                if item.before is not None:
                    item.before()
            except Exception as exc:  # this step fails alone and stays out of the forward
                outcomes[i] = exc
            else:
                ready.append(i)
        start = time.perf_counter()
        logits = self._forward([batch[i].step for i in ready])
        if ready:
            rows = sum(batch[i].tokens for i in ready)
            time.sleep(max(0.0, start + self._floor(rows) - time.perf_counter()))
        forward_s = time.perf_counter() - start
        for i, out in zip(ready, logits, strict=True):
            outcomes[i] = _finish(batch[i], out)
        self._metrics.observe_runner(self._runner)
        return outcomes, forward_s

    def _forward(self, steps: list[Step]) -> list[torch.Tensor | Exception]:
        """One forward for all steps; if it fails, each step alone, so that a step that cannot run
        fails only its own request (the runner validates a whole call before changing anything)."""
        if not steps:
            return []
        try:
            return self._runner.forward(steps)
        except Exception as exc:
            if len(steps) == 1:
                return [exc]
            log.warning("batched forward failed; running its steps one by one", extra={"error": repr(exc)})
            return [self._forward([step])[0] for step in steps]


def _finish(item: _Item, logits: torch.Tensor | Exception) -> Any:
    if isinstance(logits, Exception) or item.finish is None:
        return logits
    try:
        return item.finish(logits)
    except Exception as exc:
        return exc
