"""Routing by cached prefix (docs/gateway.md, "Routing by cached prefix"): each replica's summary
of the prefixes it holds, kept in Redis beside the sessions, and the replica a new session goes to.

Every tick result says the replica's summary version (`prefix_version`). A gateway that sees a new
one asks the replica for its summary (`Prefixes`: the chained hash of every 64-token stretch of its
live sessions' and kept prefixes' tokens, specmesh/core/prefix.py), off the hot path and at most
every `min_interval` per replica, and writes it to Redis, where a newer write wins
(`SessionStore.put_prefixes`). Every gateway places from Redis, so the turns of one conversation
land where its history is whichever gateway takes them.

A session without a replica (new, resumed, or moved off a failed one) goes to the healthy replica
that holds the longest prefix of its tokens, with its salt: the route hashes of its tokens looked
up in every candidate's summary in one Redis round trip. Unless that replica has more than
`balance` sessions above the least loaded one (SGLang's router: a cache-aware choice while the
load is balanced, the shortest queue once it is not): then, and when no replica holds any of it,
the pool's own choice (least loaded). Where it goes, its route hashes are added to that replica's
summary at once (`placed`): the next turn of a conversation finds them there even before the
replica's own summary is read again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence

import grpc
import numpy as np

from gateway.pools import ReplicaPool
from gateway.session_store import SessionStore, StoreError
from specmesh.core.prefix import BLOCK_TOKENS, ROUTE_EVERY, chain_hashes, route_hashes
from specmesh.rpc.proto import pb2, pb2_grpc
from specmesh.rpc.tick_client import Role

log = logging.getLogger("specmesh.gateway.prefixes")

MIN_INTERVAL = 0.5  # seconds between two reads of one replica's summary
PREFIXES_TIMEOUT = 5.0


class PrefixRouting:
    """One pool's replicas' prefix summaries (written to and read from Redis), and placement."""

    def __init__(
        self, store: SessionStore, pool: ReplicaPool, balance: int, min_interval: float = MIN_INTERVAL
    ) -> None:
        self.store, self.pool, self.balance, self.min_interval = store, pool, balance, min_interval
        self._seen: dict[str, int] = {}  # address -> the version it last said
        self._read: dict[str, int] = {}  # address -> the version last written to Redis from here
        self._reading: dict[str, asyncio.Task] = {}
        self._last: dict[str, float] = {}  # address -> when it was last read (monotonic)

    def seen(self, address: str, version: int) -> None:
        """A tick result from `address` said its summary's version (event loop, every result)."""
        if self._seen.get(address) == version and address in self._read:
            return
        self._seen[address] = version
        if address not in self._reading and self._read.get(address) != version:
            self._reading[address] = asyncio.ensure_future(self._refresh(address))

    async def _refresh(self, address: str) -> None:
        """Read the summary until Redis has the latest version seen (at most every min_interval)."""
        try:
            while self._read.get(address) != self._seen.get(address):
                wait = self._last.get(address, -1e9) + self.min_interval - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                self._last[address] = time.monotonic()
                stub = pb2_grpc.VerifierStub if self.pool.role is Role.VERIFIER else pb2_grpc.DrafterStub
                reply = await stub(self.pool.channel(address)).Prefixes(
                    pb2.PrefixesRequest(), timeout=PREFIXES_TIMEOUT
                )
                if reply.block_tokens != BLOCK_TOKENS or reply.route_every != ROUTE_EVERY:
                    log.warning(
                        "a replica hashes prefixes otherwise; not routed by them", extra={"replica": address}
                    )
                    return
                hashes = np.frombuffer(reply.hashes, "<u8")
                members = [f"{int(h):016x}" for h in hashes.tolist()]
                await self.store.put_prefixes(address, reply.incarnation, reply.version, members)
                self._read[address] = reply.version
                self._seen.setdefault(address, reply.version)
        except (grpc.aio.AioRpcError, StoreError) as exc:  # the next version seen tries again
            log.info("could not refresh a replica's prefixes", extra={"replica": address, "error": str(exc)})
            self._read.pop(address, None)
        finally:
            self._reading.pop(address, None)

    async def choose(self, tokens: Sequence[int], salt: bytes) -> tuple[str | None, list[str]]:
        """(the replica for a session with these committed tokens, module docstring: None for the
        pool's own choice; their route hashes, for `placed`)."""
        hashes = [f"{h:016x}" for h in route_hashes(chain_hashes(tokens[: len(tokens) - 1], salt))]
        candidates = self.pool.healthy()  # the last token is fed anyway: not in the hashes
        if not hashes or not candidates:
            return None, hashes
        try:
            held = await self.store.held_prefixes(candidates, hashes)
        except StoreError:  # no view: the pool places it
            return None, hashes
        load = {a: self.pool.load(a) for a in candidates}
        best = max(candidates, key=lambda a: (held[a], -load[a]))
        if not held[best] or load[best] - min(load.values()) > self.balance:
            return None, hashes
        return best, hashes

    async def placed(self, address: str, hashes: Sequence[str]) -> None:
        """A session with these route hashes went to `address` (module docstring)."""
        with contextlib.suppress(StoreError):  # the replica's own summary says it later
            await self.store.add_prefixes(address, hashes)

    async def close(self) -> None:
        tasks = list(self._reading.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
