"""A session's committed tokens as Redis holds them, and the one path by which rounds add to
them (`Transcript`): cut a round's tokens at a stop token, max_new_tokens or a stop sequence,
commit them with `commit_round(expected_round=…)` (atomic, fenced by the owner token), and
hand the client exactly what was committed. Serial rounds (gateway/rounds.py) and DSI
(gateway/dsi.py) both commit through it: `cut`, `commit_then`, `committed`, `apply`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc

from gateway.env import GatewayEnv, GatewayError, Piece
from gateway.requests import GenerationPlan
from gateway.session_store import NotOwner, Session
from gateway.text import TextStream
from specmesh.core.rounds import keep_emitted
from specmesh.core.stats import GenerationStats
from specmesh.rpc.round_client import RoundResult


class Transcript:
    """One session's committed state (as in Redis) and its commits. resumed: a session taken
    over from Redis, whose committed state it starts from. lost(): told when a commit finds that
    another gateway took the session over."""

    def __init__(
        self,
        session_id: str,
        plan: GenerationPlan,
        env: GatewayEnv,
        text: TextStream,
        resumed: Session | None,
        lost: Callable[[], None],
    ) -> None:
        self.id, self.plan, self.env, self.text, self._lost = session_id, plan, env, text, lost
        self.tokens = list(plan.prompt_ids)  # committed, as in Redis
        self.round = 0
        self.stats = GenerationStats()
        self.finish_reason: str | None = None
        self.owner = ""  # this gateway's owner token (gateway/session_store.py, "Ownership")
        if resumed is not None:
            self.tokens, self.round, self.stats = list(resumed.tokens), resumed.round, resumed.stats
            self.finish_reason, self.owner = resumed.finish_reason, resumed.owner

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.plan.prompt_ids)

    def left(self, tokens: list[int]) -> int:
        """Tokens of max_new_tokens still to come after `tokens` (at least 1: a round emits one)."""
        return max(1, self.plan.max_new_tokens - (len(tokens) - len(self.plan.prompt_ids)))

    def cut(self, tokens: list[int]) -> tuple[list[int], str | None]:
        """What of a round's tokens the session keeps, and whether it finished."""
        p = self.plan
        kept, finish = keep_emitted(tokens, self.generated, p.max_new_tokens, p.stop_token_ids)
        stop_at = self.text.stop_cut(kept)
        if stop_at is not None:
            return kept[:stop_at], "stop"
        return kept, finish

    def commit_then(
        self,
        kept: list[int],
        finish: str | None,
        stats: GenerationStats,
        lengths: dict[str, int],
        done: Callable[[bool | Exception], None],
    ) -> None:
        """The round's commit, sent now (pipelined with the other sessions' of this turn);
        done(outcome) gets its answer for `committed`, with the rest of the pipeline's."""
        self.env.store.commit_round_then(
            self.id, self.round, kept, stats, lengths, finish_reason=finish, owner=self.owner, done=done
        )

    def committed(self, outcome: bool | Exception) -> bool:
        """A commit's answer: whether Redis was at this round (else another round is there). Raises
        Redis's error, or ABORTED if another gateway has the session (it is then `lost`)."""
        if isinstance(outcome, NotOwner):
            self._lost()
            raise GatewayError(grpc.StatusCode.ABORTED, str(outcome)) from None
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def apply(
        self,
        kept: list[int],
        finish: str | None,
        stats: GenerationStats,
        began: float,
        start: float,
        result: RoundResult | None = None,
    ) -> Piece:
        """A committed round: the state moves on; -> what the client gets. began: when the round
        started, start: when its commit did (perf_counter), result: its calls, for the round's
        metrics."""
        end = time.perf_counter()
        calls = {f"{role}_call": t for role, t in (result.call_seconds if result else {}).items()}
        self.env.metrics.observe_round(
            stats, len(kept), {"commit": end - start, "round": end - began, **calls}
        )
        if result is not None and result.pre_draft_hit is not None:
            self.env.metrics.pre_drafts.labels("hit" if result.pre_draft_hit else "miss").inc()
        self.tokens += kept
        self.round += 1
        self.stats += stats
        self.finish_reason = finish
        logprobs = result.logprobs[: len(kept)] if result is not None else []
        return Piece(kept, self.text.push(kept, final=finish is not None), finish, logprobs)

    async def resume_from_store(self) -> Piece:
        """A commit found another round number (only possible if an earlier commit that seemed to
        fail went through): take Redis's state, hand out what we lacked."""
        session = await self.env.store.load(self.id)
        if session is None:
            raise GatewayError(grpc.StatusCode.ABORTED, f"session {self.id} expired or was deleted")
        if session.round < self.round or session.tokens[: len(self.tokens)] != self.tokens:
            # Redis lost rounds this run committed and streamed (it came back from an older AOF,
            # or a failover promoted a replica that lacked them): resuming from it would send the
            # client tokens it already has. End here; the client has exactly what was committed.
            raise GatewayError(
                grpc.StatusCode.ABORTED,
                f"session {self.id}: the session store lost committed rounds (Redis is at round "
                f"{session.round}, this gateway committed {self.round})",
            )
        new = session.tokens[len(self.tokens) :]
        self.tokens, self.round, self.stats = session.tokens, session.round, session.stats
        self.finish_reason = session.finish_reason
        return Piece(new, self.text.push(new, final=self.finished), self.finish_reason)
