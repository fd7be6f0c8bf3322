"""The model side of a round on a ModelRunner, shared by the in-process engine and the two model
services: the drafter's level forwards and KV reuse, the verifier's verdict-then-commit.

Drafter. `level_forwards` turns build_tree's one-call-per-level requests into runner steps. After
a round the session's tree stays pending in the drafter's runner, with a map path -> pending node.
The next round's new tokens (those committed since: normally the accepted path plus the recovered
or bonus token) decide what to keep: `reusable_nodes` are the pending nodes whose paths are proper
prefixes of them, exactly the accepted nodes the draft has run (an accepted leaf of the last
level never ran). They are committed before the next root forward and the rest of the new tokens
is fed; the last new token is always fed, its logits are the root of the next tree. Whatever the
caller sends (a verdict from another replica, a restart) is handled the same way, because a kept
node's KV is the KV of that token at that position.

Verifier. `verify_and_commit` decides the round (core.rounds.verify_round) and compacts the KV to
the accepted path right away, so a session's state never holds half a round.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specmesh.core.drafting import NextLogits, Path
from specmesh.core.rounds import verify_round
from specmesh.core.sampling import SamplingParams
from specmesh.core.tree import DraftTree
from specmesh.core.verification import Verdict
from specmesh.runtime.runner import ModelRunner, Step


def level_forwards(
    runner_forward: Callable[[Step], torch.Tensor],
    session_id: str,
    new_tokens: list[int],
    nodes: dict[Path, int],
) -> NextLogits:
    """The model-backed `next_logits` for build_tree: one draft forward per tree level.

    The root call feeds the committed tokens the draft has not seen; later calls append the
    requested paths' last tokens as tree nodes under their (already cached) parents. `nodes`
    records path -> the runner's pending node index, for `reusable_nodes` next round.
    """

    def next_logits(paths: list[Path]) -> torch.Tensor:
        if paths == [()]:
            return runner_forward(Step(session_id, new_tokens=list(new_tokens)))
        # i.i.d. siblings can repeat a token: run each distinct path once
        unique = list(dict.fromkeys(paths))
        base = len(nodes)
        parents = [nodes[p[:-1]] if len(p) > 1 else -1 for p in unique]
        logits = runner_forward(Step(session_id, node_tokens=[p[-1] for p in unique], node_parents=parents))
        nodes.update((p, base + i) for i, p in enumerate(unique))
        return logits[[nodes[p] - base for p in paths]]

    return next_logits


def reusable_nodes(pending: dict[Path, int], new_tokens: list[int]) -> list[int]:
    """The pending nodes to commit: those whose paths are proper prefixes of new_tokens, root first."""
    keep = []
    for end in range(1, len(new_tokens)):
        node = pending.get(tuple(new_tokens[:end]))
        if node is None:
            break
        keep.append(node)
    return keep


def verify_and_commit(
    runner: ModelRunner,
    session_id: str,
    tree: DraftTree | None,
    logits: torch.Tensor,
    params: SamplingParams,
    seed: int,
    committed_length: int,
    top_logprobs: int | None = None,
) -> Verdict:
    """The round's verdict, then the session's KV compacted to prefix + accepted path."""
    verdict = verify_round(tree, logits, params, seed, committed_length, top_logprobs)
    runner.commit(session_id, verdict.accepted_nodes)
    return verdict
