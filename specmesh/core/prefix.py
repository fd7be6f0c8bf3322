"""Prefixes kept across requests: a token sequence cut into blocks of BLOCK_TOKENS, each named by a
hash of its tokens and of the hash before it (vLLM v1's chained block hashes), and an index of who
holds which blocks (a model replica's live sessions and kept prefixes).

A block's hash names the whole prefix up to its end, so the longest cached prefix of a prompt is
found by walking its block hashes while the index knows them: the owner of the deepest known block
holds every block before it. The first block's hash is seeded by a salt: requests whose salts
differ (tenants that must not share, `docs/decisions.md`, "Prefix caching") never find each other's
blocks, and neither can a caller tell them apart by timing.

Worked example (BLOCK_TOKENS 4 for short lines; the salt b""):

    owner "a" holds [5, 6, 7, 8, 9, 1, 2, 3, 4, 0]     blocks h0 = H(seed, 5 6 7 8), h1 = H(h0, 9 1 2 3)
    query          [5, 6, 7, 8, 9, 1, 2, 3, 7, 7, 7]   hashes h0, h1, H(h1, 7 7 7 ...) ...
    -> h0, h1 known, both "a"'s: 8 tokens by blocks; then token by token against "a"'s tokens,
       [4] != [7]: the match is 8 tokens; the query feeds [7, 7, 7] after them.

The index is pure bookkeeping (no KV, no model): the backends (specmesh.runtime) keep what the
owners' KV is; the gateway hashes prompts the same way to route them (`summary`, `route_hashes`).
Hashes are 64-bit blake2b digests as ints: stable across processes and machines.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

BLOCK_TOKENS = 16  # tokens per block (vLLM's default block size)
ROUTE_EVERY = 4  # a replica's summary names every 4th block's hash: one per 64 tokens


def salt_seed(salt: bytes) -> int:
    """The hash a salt's first block chains from."""
    return int.from_bytes(hashlib.blake2b(b"specmesh-prefix:" + salt, digest_size=8).digest(), "little")


def chain_hashes(
    tokens: Sequence[int], salt: bytes = b"", start: int = 0, previous: int | None = None
) -> list[int]:
    """The chained hashes of the full blocks of `tokens` from block `start` on (`previous`: the hash
    of block start - 1, given when start > 0). -> one int per full block."""
    return list(_hashes(tokens, salt, start, previous))


def _hashes(tokens: Sequence[int], salt: bytes, start: int = 0, previous: int | None = None) -> Iterator[int]:
    n_blocks = len(tokens) // BLOCK_TOKENS
    if start >= n_blocks:
        return
    h = salt_seed(salt) if start == 0 else previous
    if h is None:
        raise ValueError("previous: the hash of the block before `start` is needed")
    raw = np.asarray(tokens[start * BLOCK_TOKENS : n_blocks * BLOCK_TOKENS], dtype="<u4").tobytes()
    size = 4 * BLOCK_TOKENS
    for at in range(0, len(raw), size):
        digest = hashlib.blake2b(h.to_bytes(8, "little") + raw[at : at + size], digest_size=8).digest()
        h = int.from_bytes(digest, "little")
        yield h


def route_hashes(hashes: Sequence[int]) -> list[int]:
    """The hashes a summary names (every ROUTE_EVERY-th block: the end of each 64-token stretch)."""
    return list(hashes[ROUTE_EVERY - 1 :: ROUTE_EVERY])


def route_bytes(hashes: Sequence[int]) -> list[bytes]:
    """Hashes as the 8-byte strings a summary is stored as (Redis set members)."""
    return [h.to_bytes(8, "little") for h in hashes]


@dataclass
class _Owner:
    tokens: list[int]  # what it holds KV for, from position 0
    salt: bytes
    hashes: list[int] = field(default_factory=list)  # of its full blocks


@dataclass(frozen=True)
class Match:
    """The longest prefix an owner holds: `owner` (a key of the index) and `length` tokens."""

    owner: str
    length: int


class PrefixIndex:
    """Which owner holds which blocks; the longest prefix of a query held by one owner.

    Owners are keys the backend chooses (a session id, a kept prefix's id). `update` follows an
    owner's tokens (grown, or cut back: a rollback), `remove` forgets it. `version` grows whenever
    the set of route hashes held (`summary`) changes, so a caller knows when to read it again."""

    def __init__(self) -> None:
        self._owners: dict[str, _Owner] = {}
        self._holders: dict[int, dict[str, None]] = {}  # block hash -> its owners, latest last
        self._route_counts: dict[int, int] = {}  # route hash -> owners holding it
        self.version = 0

    def __contains__(self, key: str) -> bool:
        return key in self._owners

    def tokens(self, key: str) -> list[int]:
        return self._owners[key].tokens

    def update(self, key: str, tokens: list[int], salt: bytes = b"") -> None:
        """The owner `key` holds KV for `tokens` now (a new owner, or one whose tokens grew or were
        cut back). Only full blocks are indexed; `tokens` is kept by reference, not copied."""
        owner = self._owners.get(key)
        if owner is None or owner.salt != salt:
            if owner is not None:
                self.remove(key)
            owner = self._owners[key] = _Owner(tokens, salt)
        old = owner.tokens
        owner.tokens = tokens
        keep = len(owner.hashes)
        if old is not tokens or len(tokens) < keep * BLOCK_TOKENS:
            # cut back, or a new list: keep the blocks whose tokens are the same
            keep = min(keep, len(tokens) // BLOCK_TOKENS)
            same = 0
            while same < keep and _block(old, same) == _block(tokens, same):
                same += 1
            keep = same
        if keep < len(owner.hashes):
            self._drop_hashes(key, owner.hashes[keep:], keep)
            del owner.hashes[keep:]
        new = chain_hashes(tokens, salt, keep, owner.hashes[-1] if keep else None)
        for i, h in enumerate(new, start=keep):
            self._holders.setdefault(h, {})[key] = None
            if (i + 1) % ROUTE_EVERY == 0:
                self._count_route(h, +1)
        owner.hashes += new

    def rename(self, old: str, new: str) -> None:
        """The same KV under another key (a session's kept as a prefix)."""
        owner = self._owners.pop(old)
        self._owners[new] = owner
        for h in owner.hashes:
            holders = self._holders[h]
            del holders[old]
            holders[new] = None

    def remove(self, key: str) -> None:
        owner = self._owners.pop(key, None)
        if owner is not None:
            self._drop_hashes(key, owner.hashes, 0)

    def match(self, tokens: Sequence[int], salt: bytes = b"", limit: int | None = None,
              exclude: str | None = None) -> Match | None:  # fmt: skip
        """The longest prefix of `tokens` (at most `limit` tokens) that one owner other than
        `exclude` holds: blocks by their hashes, then token by token against that owner's tokens."""
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        best: str | None = None
        blocks = 0
        for h in _hashes(tokens[:limit], salt):  # lazily: a miss stops the hashing
            holders = self._holders.get(h)
            if not holders:
                break
            found = next((k for k in reversed(holders) if k != exclude), None)
            if found is None:
                break
            best, blocks = found, blocks + 1
        if best is None:
            return None
        held = self._owners[best].tokens
        n = blocks * BLOCK_TOKENS
        if held[:n] != list(tokens[:n]):  # a hash collision (2^-64): believe the tokens
            return None
        end = min(limit, len(held))
        while n < end and held[n] == tokens[n]:
            n += 1
        return Match(best, n)

    def summary(self) -> list[int]:
        """The route hashes held (every ROUTE_EVERY-th block of every owner), in no order."""
        return list(self._route_counts)

    def _drop_hashes(self, key: str, hashes: Sequence[int], first: int) -> None:
        for i, h in enumerate(hashes, start=first):
            holders = self._holders.get(h)
            if holders is not None:
                holders.pop(key, None)
                if not holders:
                    del self._holders[h]
            if (i + 1) % ROUTE_EVERY == 0:
                self._count_route(h, -1)

    def _count_route(self, h: int, delta: int) -> None:
        n = self._route_counts.get(h, 0) + delta
        if n > 0:
            self._route_counts[h] = n
            if n == delta:  # 0 -> held
                self.version += 1
        else:
            self._route_counts.pop(h, None)
            self.version += 1


def _block(tokens: Sequence[int], i: int) -> Sequence[int]:
    return tokens[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS]
