"""In-process speculative decoding: one draft model, one target model, many sessions.

This is the reference the services must match token for token (same trees, same verdicts, same
randomness) and the baseline that shows what the network costs. One round of a session:

  1. draft   every tree asks for one level at a time; each level is one draft forward over the
             level's nodes of every session (tree attention over the draft KV cache).
  2. verify  one target forward over [the tokens the target has not seen] + the whole tree, for
             all sessions at once; verify_tree picks the accepted path and one more token.
  3. commit  the target's KV keeps only prefix + accepted path right away; the draft's keeps the
             accepted nodes it ran when the next round starts (an accepted leaf of the last
             level, and the new token, are fed to it then).

The rules of each step are specmesh.core.rounds and specmesh.runtime.rounds, the same the drafter
and verifier services follow. `TreeSpec(Method.NONE)` is plain autoregressive decoding of the
target through the same code.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import count

import torch

from specmesh.core.adaptive import AdaptivePolicy, Load, PolicyMemory
from specmesh.core.drafting import Path, TreeSpec
from specmesh.core.methods import Method
from specmesh.core.rounds import Request, keep_emitted, session_seed
from specmesh.core.sampling import SamplingParams
from specmesh.core.stats import GenerationResult, GenerationStats
from specmesh.core.suffix import SHARED_TOKENS, SuffixDrafts, lookup_tree
from specmesh.core.tree import DraftTree
from specmesh.runtime.backend import ModelBackend
from specmesh.runtime.costs import measure_forward_cost
from specmesh.runtime.models import LoadedModel, check_pair
from specmesh.runtime.rounds import DraftJob, VerifyJob, draft_steps, reusable_nodes, run_ticked, verify_steps
from specmesh.runtime.runner import ModelRunner

__all__ = ["Request", "SpeculativeEngine"]  # Request: core.rounds, re-exported


@dataclass
class _Session:
    id: str
    request: Request
    seed: int
    tokens: list[int]  # prompt + generated (committed)
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: GenerationStats = field(default_factory=GenerationStats)
    tree: DraftTree | None = None
    draft_nodes: dict[Path, int] = field(default_factory=dict)  # path -> the drafter's pending node
    policy: AdaptivePolicy | None = None
    spec: TreeSpec = field(default_factory=lambda: TreeSpec(Method.NONE))  # this round's
    last_round: tuple[int, int] = (0, 0)  # (tree nodes, accepted) of the last verified round


class SpeculativeEngine:
    """generate(prompt_ids, spec, params, max_new_tokens) -> GenerationResult (token_ids, stats)."""

    def __init__(self, draft, target, *, max_cache_tokens: int | None = None) -> None:
        """draft, target: `LoadedModel`s (their backend's runner), transformers causal LMs (the
        torch backend), or runners (`specmesh.runtime.backend.ModelBackend`)."""
        if isinstance(draft, LoadedModel) and isinstance(target, LoadedModel):
            check_pair(draft, target)
        self.drafter = _runner(draft, max_cache_tokens)
        self.verifier = _runner(target, max_cache_tokens)
        if self.drafter.vocab_size != self.verifier.vocab_size:
            raise ValueError(
                f"draft vocabulary ({self.drafter.vocab_size}) differs from the target's "
                f"({self.verifier.vocab_size})"
            )
        self._ids = count()
        self.policies = PolicyMemory()
        self.forward_cost: dict[int, float] | None = None  # the target's, measured for adaptive sessions
        self.suffix = SuffixDrafts(SHARED_TOKENS)  # method suffix: what earlier sessions generated

    def generate(
        self,
        prompt_ids: Sequence[int],
        spec: TreeSpec,
        params: SamplingParams,
        max_new_tokens: int,
        stop_token_ids: Sequence[int] | None = None,
        *,
        adaptive: bool = False,
    ) -> GenerationResult:
        request = Request(prompt_ids, spec, params, max_new_tokens, tuple(stop_token_ids or ()), adaptive)
        return self.generate_many([request])[0]

    def generate_many(self, requests: Sequence[Request]) -> list[GenerationResult]:
        """Run sessions concurrently; each round batches their draft levels and verifications."""
        sessions = [self._start(r) for r in requests]
        try:
            active = [s for s in sessions if s.finish_reason is None]
            while active:
                for s in active:
                    s.spec = s.policy.next_spec() if s.policy else s.request.spec
                start = time.perf_counter()
                self._draft(active)
                mid = time.perf_counter()
                load = self._verify(active)
                end = time.perf_counter()
                for s in active:
                    s.stats.draft_seconds += mid - start
                    s.stats.verify_seconds += end - mid
                    s.stats.total_seconds += end - start
                    if s.policy:
                        self._learn(s, active, mid - start, end - mid, load)
                active = [s for s in active if s.finish_reason is None]
        finally:
            for s in sessions:
                self.suffix.finish(s.id, s.tokens)
                self.drafter.release(s.id)
                self.verifier.release(s.id)
                if s.policy:
                    self.policies.remember(s.policy, s.request.params)
        return [GenerationResult(s.generated, s.finish_reason or "length", s.stats) for s in sessions]

    @staticmethod
    def _learn(
        s: _Session, active: list[_Session], draft_seconds: float, verify_seconds: float, load: Load
    ) -> None:
        """Feed an adaptive session's policy its round, charged for the draft levels it took part in
        (the batch ran as many levels as its deepest tree)."""
        depths = [x.spec.depth for x in active if x.spec.method.drafts]
        depth = s.spec.depth
        share = draft_seconds * depth / max(depths) if depth else 0.0
        nodes, accepted = s.last_round
        round_stats = GenerationStats.for_round(
            drafted_tokens=nodes,
            accepted_tokens=accepted,
            tree_depth=depth,
            draft_seconds=share,
            verify_seconds=verify_seconds,
            total_seconds=share + verify_seconds,
        )
        s.policy.observe(s.spec, round_stats, load)

    def _start(self, request: Request) -> _Session:
        seed = session_seed(request.params)
        policy = None
        if request.adaptive:
            if self.forward_cost is None:
                self.forward_cost = measure_forward_cost(self.verifier)
            policy = self.policies.new_policy(request.spec, request.params, self.forward_cost)
        sid = f"engine-{next(self._ids)}"
        return _Session(sid, request, seed, [int(t) for t in request.prompt_ids], policy=policy)

    def _draft(self, sessions: list[_Session]) -> None:
        for s in sessions:
            if s.spec.method.model_free:  # no draft model: a lookup (and suffix's earlier sessions)
                s.tree = lookup_tree(self.suffix, s.id, s.tokens, s.spec, self.verifier.vocab_size)
        drafting = [s for s in sessions if s.spec.method.needs_model]
        if not drafting:
            return
        jobs = []
        for s in drafting:
            feed = self._resume_draft(s)
            s.draft_nodes = {}
            p = s.request.params
            jobs.append(DraftJob(s.id, feed, s.spec, p, s.seed, len(s.tokens), nodes=s.draft_nodes))
        for s, out in zip(drafting, run_ticked(draft_steps(jobs), self.drafter.forward), strict=True):
            if out.error is not None:
                raise out.error
            s.tree = out.tree
            s.stats.draft_calls += s.spec.depth

    def _resume_draft(self, s: _Session) -> list[int]:
        """Keep the drafter's pending nodes on the committed path; -> the tokens it must still run."""
        held = self.drafter.committed_tokens(s.id)
        if held is None:
            return list(s.tokens)
        new = s.tokens[len(held) :]
        keep = reusable_nodes(s.draft_nodes, new)
        self.drafter.commit(s.id, keep)
        return new[len(keep) :]

    def _verify(self, sessions: list[_Session]) -> Load:
        """One target forward for every session's round; -> what that forward held."""
        jobs = []
        for s in sessions:
            tree = s.tree if s.spec.method.drafts else None  # None: a plain step
            known = len(self.verifier.committed_tokens(s.id) or ())
            jobs.append(VerifyJob(s.id, s.tokens[known:], tree, s.request.params, s.seed, len(s.tokens)))
        outcomes = run_ticked(verify_steps(jobs, self.verifier.commit), self.verifier.forward)
        for s, job, out in zip(sessions, jobs, outcomes, strict=True):
            if out.error is not None:
                raise out.error
            verdict = out.verdict
            assert verdict is not None
            s.stats.record(job.tree, len(verdict.accepted_nodes))
            s.last_round = (job.tree.num_nodes if job.tree is not None else 0, len(verdict.accepted_nodes))
            self._emit(s, verdict.emitted_tokens)
            s.tree = None
        rows = sum(len(j.new_tokens) + (j.tree.num_nodes if j.tree is not None else 0) for j in jobs)
        return Load(len(jobs), rows)

    @staticmethod
    def _emit(s: _Session, tokens: list[int]) -> None:
        kept, s.finish_reason = keep_emitted(
            tokens, len(s.generated), s.request.max_new_tokens, s.request.stop_token_ids
        )
        s.tokens += kept
        s.generated += kept


def _runner(model: object, max_cache_tokens: int | None) -> ModelBackend:
    if isinstance(model, LoadedModel):
        return model.open_runner(max_cache_tokens=max_cache_tokens)
    if isinstance(model, torch.nn.Module):
        return ModelRunner(model, max_cache_tokens=max_cache_tokens)
    return model  # already a runner
