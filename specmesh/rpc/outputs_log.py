"""The mesh's log of finished outputs: a Redis stream the gateways append to and every suffix
drafter reads, so that each one learns what the whole mesh generates, not only the sessions it
served (docs/gateway.md, "Suffix drafts").

One entry per finished, non-private session: its generated tokens, packed little-endian uint32
(field `t`). The stream is capped (XADD MAXLEN ~, oldest entries first), so it is also what a
drafter that starts late, or restarts, replays: it reads from the start, then follows. The
gateways write it off the hot path, once per session; a reader that loses Redis retries and goes
on from the last entry it read.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

log = logging.getLogger("specmesh.outputs_log")

STREAM_NAME = "outputs"
STREAM = f"specmesh:{STREAM_NAME}"  # under the gateways' key prefix (SessionStore.prefix)
FIELD = b"t"
MAX_ENTRIES = 20000  # XADD MAXLEN ~: what a late drafter replays at most
READ_COUNT = 256  # entries per XREAD
BLOCK_MS = 1000  # an XREAD waits this long for new entries
RETRY_SECONDS = 1.0  # after Redis failed a read


def encode_output(tokens: Sequence[int]) -> dict[bytes, bytes]:
    """One log entry's fields."""
    return {FIELD: np.asarray(tokens, dtype="<u4").tobytes()}


def decode_output(fields: dict[Any, Any]) -> list[int] | None:
    """An entry's tokens (fields as a client without decode_responses reads them); None for one
    this version cannot read (skipped, never fatal)."""
    raw = fields.get(FIELD)
    if not isinstance(raw, bytes | bytearray) or len(raw) % 4:
        return None
    return np.frombuffer(raw, dtype="<u4").astype(np.int64).tolist()


async def publish(
    redis: Any, tokens: Sequence[int], stream: str = STREAM, max_entries: int = MAX_ENTRIES
) -> None:
    """Append one finished output (redis: a redis.asyncio client)."""
    await redis.xadd(stream, encode_output(tokens), maxlen=max_entries, approximate=True)


async def follow(
    redis: Any, learn: Callable[[list[int]], None], stream: str = STREAM, start: str = "0"
) -> None:
    """Read the log from `start` (the beginning: a replay of what the stream holds), then follow
    it, calling learn(tokens) per entry in order; runs until cancelled."""
    last = start
    while True:
        try:
            got = await redis.xread({stream: last}, count=READ_COUNT, block=BLOCK_MS)
        except Exception as exc:  # Redis gone or failing (a cancel is no Exception): the same entry again
            log.warning("reading the outputs log failed", extra={"error": str(exc)})
            await asyncio.sleep(RETRY_SECONDS)
            continue
        for _stream, entries in got or []:
            for entry_id, fields in entries:
                last = entry_id
                tokens = decode_output(fields)
                if tokens:
                    learn(tokens)
