"""Dynamic batching of model steps: concurrent ticks' step groups become one runner forward.

A tick (specmesh.runtime.rounds) asks for one forward at a time: a group of steps, one per session
(a draft level, a verification, a plain step). Continuous batching: when the model is free it takes
what is queued, at once, unless a group is known to be coming: a registered participant (a tick
with more levels or plain steps to go) that has not asked for its next forward yet. Then it waits
for them, at most --max-wait-ms, or until the batch is full (--max-batch-size sessions or
--max-batch-tokens tokens). Nothing else ever waits. While a forward runs, new groups accumulate, so
under load batches form without any waiting. A group that does not fit waits for the next batch, in
arrival order. Every forward runs on ONE model thread, so the runner never sees two calls at once
and the event loop never blocks on the model; each group's `finish` (sampling, verification) runs
there too, right after its forward.
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
from specmesh.services.config import BatchLimits, ForwardFloor
from specmesh.services.metrics import ServiceMetrics

log = logging.getLogger("specmesh.services.batching")


@dataclass(frozen=True)
class BatchInfo:
    """What one step's forward looked like (reported back to the caller)."""

    size: int
    tokens: int
    queue_seconds: float
    forward_seconds: float


@dataclass
class More:
    """What a group's `finish` returns to ask for another forward: its next steps."""

    steps: list[Step]


@dataclass(eq=False)
class _Item:
    """A group of steps that wait for the same forward: a tick's level, one plain step of its runs."""

    steps: list[Step]
    before: dict[str, Callable[[], None]]  # session -> on the model thread, right before the forward
    finish: Callable[[list[torch.Tensor | Exception]], Any] | None  # on the model thread, on the results
    future: asyncio.Future
    queued_at: float
    tokens: int = 0

    def __post_init__(self) -> None:
        self.tokens = sum(st.rows for st in self.steps)


class ForwardBatcher:
    """Merges the step groups of concurrent ticks into runner forwards on the model thread.

    Use from the event loop (`enqueue`, `withdraw`, `join`, `leave`). See the module docstring for
    when a batch is dispatched. With participants, the max-wait clock also restarts when the model
    becomes idle, so a tick that is still sampling its level gets the same grace after every
    forward. A batch larger than the limits (one big tick) runs as several forwards in a row.
    """

    def __init__(
        self,
        runner: ModelBackend,
        model_thread: ThreadPoolExecutor,
        limits: BatchLimits,
        metrics: ServiceMetrics,
        floor: ForwardFloor = ForwardFloor(),  # noqa: B008 (frozen: one shared value is safe)
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
        steps: list[Step],
        *,
        before: dict[str, Callable[[], None]] | None = None,
        finish: Callable[[list[torch.Tensor | Exception]], Any] | None = None,
    ) -> asyncio.Future:
        """-> a future of (finish(results) or results, BatchInfo); results: per step its logits or
        the exception that failed it alone."""
        item = _Item(list(steps), before or {}, finish, self._loop.create_future(), self._loop.time())
        self._queue.append(item)
        self._poke()
        self._metrics.waiting.set(sum(len(i.steps) for i in self._queue))
        return item.future

    def withdraw(self, future: asyncio.Future) -> None:
        """Take a group back if its forward has not started (then nothing happened to its sessions)."""
        for item in self._queue:
            if item.future is future:
                self._queue.remove(item)
                future.cancel()
                self._poke()
                return

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
        if sum(len(item.steps) for item in self._queue) >= self._limits.max_batch_size:
            return True
        if sum(item.tokens for item in self._queue) >= self._limits.max_batch_tokens:
            return True
        return self._participants <= queued  # no participant: nothing to wait for

    def _deadline(self) -> float:
        oldest = self._queue[0].queued_at
        start = max(oldest, self._idle_since) if self._participants else oldest
        return start + self._limits.max_wait_s

    def _take(self) -> list[_Item]:
        """Groups in arrival order while they fit; a group is never split across batches (one that
        is larger than the limits alone runs as several forwards, `_execute`)."""
        batch: list[_Item] = []
        steps = tokens = 0
        while self._queue:
            item = self._queue[0]
            if item.future.done():  # cancelled, withdrawal pending
                self._queue.popleft()
                continue
            full = steps + len(item.steps) > self._limits.max_batch_size
            if batch and (full or tokens + item.tokens > self._limits.max_batch_tokens):
                break
            batch.append(self._queue.popleft())
            steps, tokens = steps + len(item.steps), tokens + item.tokens
        return batch

    def _dispatch(self, batch: list[_Item]) -> None:
        self._busy = True
        self._metrics.waiting.set(sum(len(i.steps) for i in self._queue))
        dispatched = self._loop.time()
        job = self._loop.run_in_executor(self._model_thread, self._execute, batch)
        job.add_done_callback(functools.partial(self._finished, batch, dispatched))

    def _finished(self, batch: list[_Item], dispatched: float, job: asyncio.Future) -> None:
        self._busy = False
        self._idle_since = self._loop.time()
        try:
            outcomes, info = job.result()
        except BaseException:  # the model thread was shut down
            outcomes, info = [RuntimeError("the model thread stopped")] * len(batch), (0, 0, 0.0)
        size, tokens, forward_s = info
        for item, outcome in zip(batch, outcomes, strict=True):
            waited = dispatched - item.queued_at
            self._metrics.queue_wait.observe(waited)
            if item.future.done():
                continue
            if isinstance(outcome, BaseException):
                item.future.set_exception(outcome)
            else:
                item.future.set_result((outcome, BatchInfo(size, tokens, waited, forward_s)))
        # one loop turn later: the ticks these results wake (a plain run's next step, a level's
        # next forward) enqueue their next groups first, and make the next batch together
        self._loop.call_soon(self._poke)

    # ---- model thread --------------------------------------------------------------------------

    def _execute(self, batch: list[_Item]) -> tuple[list[Any], tuple[int, int, float]]:
        """Run the groups' steps (their sessions' `before` first; a step whose before fails stays
        out and fails alone) in as few forwards as the limits allow, then each group's finish."""
        results: list[list[Any]] = [[None] * len(item.steps) for item in batch]
        ready: list[tuple[int, int]] = []  # (group, step)
        for g, item in enumerate(batch):
            for k, step in enumerate(item.steps):
                hook = item.before.get(step.session_id)
                try:
                    if hook is not None:
                        hook()
                except Exception as exc:  # this step fails alone and stays out of the forward
                    results[g][k] = exc
                else:
                    ready.append((g, k))
        size = tokens = 0
        forward_s = 0.0
        for chunk in self._chunks(batch, ready):
            steps = [batch[g].steps[k] for g, k in chunk]
            rows = sum(st.rows for st in steps)
            start, cpu = time.perf_counter(), time.thread_time()
            logits = self._forward(steps)
            self._metrics.forward_cpu.inc(time.thread_time() - cpu)
            left = start + self._floor(rows) - time.perf_counter()
            if left > 0:  # not sleep(0): it still takes ~0.1 ms (the kernel's timer slack) a forward
                time.sleep(left)
            seconds = time.perf_counter() - start
            self._metrics.batch_size.observe(len(steps))
            self._metrics.batch_tokens.observe(rows)
            self._metrics.forward_time.observe(seconds)
            size, tokens, forward_s = max(size, len(steps)), max(tokens, rows), forward_s + seconds
            for (g, k), out in zip(chunk, logits, strict=True):
                results[g][k] = out
        outcomes = [_finish(item, out) for item, out in zip(batch, results, strict=True)]
        # A tick alone on the replica goes on with its next forward right here: no hop to the
        # event loop and back per draft level or plain step. Another tick queued (or still
        # sampling its level) meanwhile sends it back, to merge with it in the next batch.
        while (
            len(batch) == 1 and isinstance(outcomes[0], More) and not self._queue and self._participants <= 1
        ):
            item = _Item(outcomes[0].steps, {}, batch[0].finish, batch[0].future, batch[0].queued_at)
            more, (s2, t2, f2) = self._execute([item])
            return more, (max(size, s2), max(tokens, t2), forward_s + f2)
        self._metrics.observe_runner(self._runner)
        return outcomes, (size, tokens, forward_s)

    def _chunks(self, batch: list[_Item], ready: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
        """The ready steps cut into forwards within --max-batch-size and --max-batch-tokens."""
        chunks: list[list[tuple[int, int]]] = []
        current: list[tuple[int, int]] = []
        tokens = 0
        for g, k in ready:
            st = batch[g].steps[k]
            rows = st.rows
            if current and (
                len(current) >= self._limits.max_batch_size or tokens + rows > self._limits.max_batch_tokens
            ):
                chunks.append(current)
                current, tokens = [], 0
            current.append((g, k))
            tokens += rows
        if current:
            chunks.append(current)
        return chunks

    def _forward(self, steps: list[Step]) -> list[torch.Tensor | Exception]:
        """One forward for all steps; if it fails, each step alone, so that a step that cannot run
        fails only its own session (the runner validates a whole call before changing anything)."""
        if not steps:
            return []
        try:
            return self._runner.forward(steps)
        except Exception as exc:
            if len(steps) == 1:
                return [exc]
            log.warning("batched forward failed; running its steps one by one", extra={"error": repr(exc)})
            return [self._forward([step])[0] for step in steps]


def _finish(item: _Item, results: list[torch.Tensor | Exception]) -> Any:
    if item.finish is None:
        return results
    try:
        return item.finish(results)
    except Exception as exc:
        return exc
