"""The rules every round follows, written once for every place a round runs: the in-process
engine, the round client (gateway, tests, benchmarks), the drafter and the verifier service.

A session is a `Request` plus a seed; a round drafts a tree after the committed tokens
(`draft_round`), verifies it (`verify_round`), and the session keeps what `keep_emitted` says.
Both halves draw their randomness from `Draws.derive(seed, committed length, purpose)`, so any
replica that runs the same round draws the same numbers, whatever other sessions share its tick:
a failover cannot change the output, nor can the load.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from enum import StrEnum

from specmesh.core.drafting import NextLogits, TreeSpec, build_tree
from specmesh.core.extras import missing
from specmesh.core.logprobs import token_logprobs
from specmesh.core.sampling import Draws, SamplingParams
from specmesh.core.tree import DraftTree
from specmesh.core.verification import Verdict, verify_many

try:
    import torch
except ModuleNotFoundError as exc:  # a gateway-only install (specmesh.core.extras)
    torch = missing(exc)


@dataclass
class Request:
    """One generation as the engine and the round client take it."""

    prompt_ids: Sequence[int]
    spec: TreeSpec
    params: SamplingParams
    max_new_tokens: int
    stop_token_ids: Sequence[int] = ()
    adaptive: bool = False  # spec is then the tree family and the first round's depth

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


class Pipelining(StrEnum):
    """Whether round r+1 is drafted while round r is verified (specmesh.core.ahead)."""

    OFF = "off"  # serial rounds: draft, then verify
    AUTO = "auto"  # when the measured costs and acceptance say it pays
    ON = "on"  # every round (benchmarks, tests)

    @classmethod
    def parse(cls, value: str) -> Pipelining:
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"--pipeline must be one of {', '.join(cls)}; got {value!r}") from None

    @property
    def enabled(self) -> bool:
        return self is not Pipelining.OFF


def session_seed(params: SamplingParams) -> int:
    """The seed every round of a session derives its randomness from: the request's, or a fresh
    one drawn once (and then stored with the session, so that a failover reuses it)."""
    return params.seed if params.seed is not None else random.getrandbits(63)


def draft_round(
    spec: TreeSpec, next_logits: NextLogits, params: SamplingParams, seed: int, committed_length: int
) -> DraftTree:
    """The tree a drafter proposes after `committed_length` committed tokens."""
    return build_tree(spec, next_logits, params, draft_draws(seed, committed_length))


def draft_draws(seed: int, committed_length: int) -> Draws:
    """The randomness of a round's draft after `committed_length` committed tokens."""
    return Draws.derive(seed, committed_length, "draft")


def verify_round(
    tree: DraftTree | None,
    logits: torch.Tensor,
    params: SamplingParams,
    seed: int,
    committed_length: int,
    top_logprobs: int | None = None,
) -> Verdict:
    """The verifier's decision for one round: `verify_rounds` of one session."""
    return verify_rounds([tree], [logits], [params], [seed], [committed_length], [top_logprobs])[0]


def verify_rounds(
    trees: Sequence[DraftTree | None],
    logits: Sequence[torch.Tensor],
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    committed_lengths: Sequence[int],
    top_logprobs: Sequence[int | None],
) -> list[Verdict]:
    """The verifier's decisions for a tick's sessions, each what it would be alone.

    logits[b]: [1 + num_nodes, V] target logits, row 0 after the committed tokens, row i + 1 after
    node i; a tree None is a plain autoregressive step (one row). top_logprobs[b]: the verdict
    carries its emitted tokens' log-probabilities with this many alternatives each (None: none;
    they cost a log-softmax per emitted token)."""
    draws = [Draws.derive(s, n, "verify") for s, n in zip(seeds, committed_lengths, strict=True)]
    verdicts = verify_many(trees, logits, params, draws)
    for b, top in enumerate(top_logprobs):
        if top is not None:
            v = verdicts[b]
            rows = logits[b][v.emitted_rows]
            logprobs = token_logprobs(rows, v.emitted_tokens, params[b], top)
            verdicts[b] = dataclasses.replace(v, logprobs=logprobs)
    return verdicts


def keep_emitted(
    tokens: Sequence[int], generated: int, max_new_tokens: int, stop_token_ids: Collection[int]
) -> tuple[list[int], str | None]:
    """The part of a round's tokens a session keeps, and why it finished (None: it goes on).

    A session ends right after a stop token ("stop") or once it has max_new_tokens ("length");
    `generated` is how many it had before this round."""
    stop = set(stop_token_ids)
    kept: list[int] = []
    for token in tokens:
        kept.append(int(token))
        if token in stop:
            return kept, "stop"
        if generated + len(kept) >= max_new_tokens:
            return kept, "length"
    return kept, None
