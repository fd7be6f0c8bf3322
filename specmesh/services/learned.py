"""What a replica learns from the mesh's outputs log: every finished, non-private session's output
(specmesh/rpc/outputs_log.py) into a SuffixIndex of its own, within --suffix-tokens. The n-gram
drafters draft method suffix from it, the verifiers the suffix rides of plain steps
(specmesh.core.rides). The log is read on the event loop and the index read on other threads (the
verifier's model thread), so every access holds `lock`."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis

from specmesh.core.suffix import SuffixIndex
from specmesh.rpc import outputs_log


class LearnedOutputs:
    """`index` filled from the outputs log at `redis_url` (replayed from its start, then followed:
    `start`/`close`), or by `add` (a drafter without the log learns its own sessions). `tokens`:
    a metrics gauge of what the index holds."""

    def __init__(self, index: SuffixIndex, redis_url: str, tokens: Any) -> None:
        self.index, self.lock = index, threading.Lock()
        self._redis_url, self._gauge = redis_url, tokens
        self._follower: asyncio.Task | None = None
        self._redis: Any = None

    @property
    def follows(self) -> bool:
        """Whether the log is its source (else: what `add` is given)."""
        return bool(self._redis_url)

    def start(self) -> None:
        if self._redis_url:
            self._redis = aioredis.Redis.from_url(self._redis_url)
            self._follower = asyncio.create_task(outputs_log.follow(self._redis, self.add))

    async def close(self) -> None:
        if self._follower is not None:
            self._follower.cancel()
            await asyncio.gather(self._follower, return_exceptions=True)
            await self._redis.aclose()
            self._follower = None

    def add(self, tokens: Sequence[int]) -> None:
        with self.lock:
            self.index.add(tokens)
        self.measure()

    def measure(self) -> None:
        """The gauge, after the index changed (here or by its owner, under `lock`)."""
        with self.lock:
            held = self.index.tokens
        self._gauge.set(held)
