"""Log-probabilities of emitted tokens, as an OpenAI client asks for them (`logprobs`,
`top_logprobs`).

They are the target's, of the distribution each token is drawn from: after the request's
temperature, top-k and top-p (tokens those filter out have none and are never listed). Greedy
decoding draws from nothing, so at temperature 0 they are the raw model's log-softmax, the
distribution whose argmax greedy takes (docs/decisions.md). Every emitted token has the target's
log-probability whatever produced it, a draft accepted or a token recovered from a residual: a
lossless rule emits each token with exactly the target's probability.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specmesh.core.extras import missing
from specmesh.core.sampling import SamplingParams, warp

try:
    import torch
except ModuleNotFoundError as exc:  # a gateway-only install (specmesh.core.extras)
    torch = missing(exc)

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat top_logprobs
# JSON has no -inf: a token outside the kept set (an MTAD draft, say) reports this (vLLM's floor)
LOGPROB_FLOOR = -9999.0


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token, logprob), most likely first


def log_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Raw logits [K, V] -> log of the distribution [K, V] tokens are drawn from (-inf: never)."""
    if params.greedy:
        return torch.log_softmax(logits.float(), dim=-1)
    return warp(logits, params).log()


def token_logprobs(
    logits: torch.Tensor, tokens: Sequence[int], params: SamplingParams, top: int
) -> tuple[TokenLogprob, ...]:
    """logits [K, V]: row k the target's logits before tokens[k]; top: alternatives per token."""
    logp = log_distribution(logits, params)
    chosen = logp.gather(-1, torch.tensor(tokens, dtype=torch.long).unsqueeze(-1)).squeeze(-1).tolist()
    best = logp.topk(top, dim=-1) if top else None
    out = []
    for k, token in enumerate(tokens):
        alternatives: tuple[tuple[int, float], ...] = ()
        if best is not None:
            pairs = zip(best.indices[k].tolist(), best.values[k].tolist(), strict=True)
            alternatives = tuple((t, v) for t, v in pairs if v != float("-inf"))
        out.append(TokenLogprob(int(token), max(chosen[k], LOGPROB_FLOOR), alternatives))
    return tuple(out)
