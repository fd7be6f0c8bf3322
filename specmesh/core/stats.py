"""Generation statistics: one definition for the in-process engine, the services and the gateway.

Counters only; ratios (block efficiency, acceptance per depth) are derived, so one round's stats
are a delta that adds up (the gateway's session store adds them atomically in Redis). No torch
here, and no wire or storage format: the public proto is built by the gateway (gateway/api.py),
the Redis hash form lives with the session store (gateway/session_store.py). `network_seconds`
is a round's wall time minus what the drafter and the verifier report as their own compute (0
in-process).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass
class GenerationStats:
    rounds: int = 0  # = target forwards
    draft_calls: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    round_tokens: int = 0  # accepted + 1 per round, before truncation to max_new_tokens
    accepted_per_depth: list[int] = field(default_factory=list)  # rounds whose path reached depth d+1
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    network_seconds: float = 0.0
    total_seconds: float = 0.0
    cached_prompt_tokens: int = 0  # prompt tokens the target took from its prefix cache (first round)

    @classmethod
    def for_round(
        cls,
        *,
        drafted_tokens: int,
        accepted_tokens: int,
        tree_depth: int,
        draft_calls: int = 0,
        draft_seconds: float = 0.0,
        verify_seconds: float = 0.0,
        total_seconds: float = 0.0,
        plain_steps: int = 1,
    ) -> GenerationStats:
        """The delta of one round; network time is what the round took beyond both services' compute.
        plain_steps: a plain call that decoded that many tokens counts as that many rounds."""
        depth = max(tree_depth, accepted_tokens)
        return cls(
            rounds=plain_steps,
            draft_calls=draft_calls,
            drafted_tokens=drafted_tokens,
            accepted_tokens=accepted_tokens,
            round_tokens=accepted_tokens + plain_steps,
            accepted_per_depth=[1] * accepted_tokens + [0] * (depth - accepted_tokens),
            draft_seconds=draft_seconds,
            verify_seconds=verify_seconds,
            network_seconds=max(0.0, total_seconds - draft_seconds - verify_seconds),
            total_seconds=total_seconds,
        )

    @property
    def target_calls(self) -> int:
        return self.rounds

    @property
    def block_efficiency(self) -> float:
        """eta: tokens emitted per target forward (accepted + 1, averaged over rounds)."""
        return self.round_tokens / self.rounds if self.rounds else 0.0

    @property
    def acceptance_per_depth(self) -> list[float]:
        return [n / self.rounds for n in self.accepted_per_depth] if self.rounds else []

    def record(self, tree: Any, accepted: int) -> None:
        """Add one round: its DraftTree (None for autoregressive decoding) and accepted depth."""
        self += GenerationStats.for_round(
            drafted_tokens=tree.num_nodes if tree is not None else 0,
            accepted_tokens=accepted,
            tree_depth=int(tree.depths().max()) if tree is not None else 0,
        )

    def __iadd__(self, other: GenerationStats) -> GenerationStats:
        """In place (a session adds every round's delta): no new object, no dict per round."""
        for name in _SCALARS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        a, b = self.accepted_per_depth, other.accepted_per_depth
        if b:  # a new list: the old one may be another's too
            self.accepted_per_depth = [
                (a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(max(len(a), len(b)))
            ]
        return self

    def __add__(self, other: GenerationStats) -> GenerationStats:
        depth = max(len(self.accepted_per_depth), len(other.accepted_per_depth))
        a = self.accepted_per_depth + [0] * (depth - len(self.accepted_per_depth))
        b = other.accepted_per_depth + [0] * (depth - len(other.accepted_per_depth))
        summed = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        return GenerationStats(**{**summed, "accepted_per_depth": [x + y for x, y in zip(a, b, strict=True)]})

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(
            target_calls=self.target_calls,
            block_efficiency=self.block_efficiency,
            acceptance_per_depth=self.acceptance_per_depth,
        )
        return out


_SCALARS = tuple(f.name for f in fields(GenerationStats) if f.name != "accepted_per_depth")


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: str  # "length" | "stop"
    stats: GenerationStats
