"""N-gram (prompt-lookup) drafts: proposals copied from the session's own tokens, no draft model.

The proposal after tokens t_1..t_n is what followed the latest earlier occurrence of the longest
suffix of t that occurred before (n-grams of `max_ngram` down to `min_ngram` tokens), as vLLM's
`ngram` proposer, SGLang's n-gram and llama.cpp's lookup decoding do. Worked example
(max_ngram 3, depth 3):

    tokens   = [5, 6, 7, 9, 5, 6, 7]
    suffix [5, 6, 7] occurred at 0..2, followed by [9, 5, 6]   -> proposal [9, 5, 6]

The proposal is a deterministic function of the committed tokens, so it is a draft whose
distribution is one-hot: q(x) = 1 for the proposed token. Rejection sampling then accepts x with
probability min(1, p(x)) = p(x) and otherwise samples the residual (p - q)+, which is p without
x: lossless through the chain rule every drafter uses (`verification.verify_tree`, mode IID). At
T = 0 it accepts exactly the target's argmax. A tree is a chain; no match drafts nothing (the
round is a plain step).

`prompt_hit_rate` is the share of the prompt's own positions the lookup would have guessed: what
the gateway's default choice takes as the acceptance of n-gram drafts before any round ran (a
deterministic input, so a seeded request gives the same text every time).
"""

from __future__ import annotations

from collections.abc import Sequence

from specmesh.core.extras import missing
from specmesh.core.tree import DraftTree, SamplingMode

try:
    import torch
except ModuleNotFoundError as exc:  # a gateway-only install (specmesh.core.extras)
    torch = missing(exc)

MAX_NGRAM = 3
MIN_NGRAM = 1
WINDOW = 4096  # tokens searched back from the end: a lookup stays cheap on long sessions


def propose(
    tokens: Sequence[int], depth: int, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM
) -> list[int]:
    """Up to `depth` tokens that followed the latest earlier occurrence of the longest suffix of
    `tokens` (of max_ngram .. min_ngram tokens); [] when no suffix occurred before."""
    window = list(tokens[-WINDOW:])
    end = len(window)
    for n in range(min(max_ngram, end - 1), min_ngram - 1, -1):
        suffix, last = window[end - n :], window[-1]
        # the latest occurrence ending at e < end (so that window[e] follows it): the last token
        # is compared first, the slice only on a hit
        for e in range(end - 1, n - 1, -1):
            if window[e - 1] == last and window[e - n : e] == suffix:
                return window[e : e + depth]
    return []


def prompt_hit_rate(prompt: Sequence[int], max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> float:
    """The share of the prompt's positions (past its first quarter, so that there is something to
    look up) whose token `propose` on the tokens before it gives first. 0 for short prompts.
    One pass: per n, each n-gram's latest end so far (what `propose` finds, without its window)."""
    start = max(8, len(prompt) // 4)
    if start >= len(prompt):
        return 0.0
    tokens = [int(t) for t in prompt]
    ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram + 1)]
    hits = 0
    for i in range(len(tokens)):
        if i >= start:
            guess = None
            for n in range(min(max_ngram, i - 1), min_ngram - 1, -1):
                e = ends[n].get(tuple(tokens[i - n : i]))
                if e is not None:
                    guess = tokens[e]
                    break
            hits += guess == tokens[i]
        for n in range(min_ngram, min(max_ngram, i) + 1):  # the n-grams ending at i, followed by tokens[i]
            ends[n][tuple(tokens[i - n : i])] = i
    return hits / (len(tokens) - start)


def chain_tree(proposal: Sequence[int], vocab_size: int) -> DraftTree | None:
    """The proposal as a chain with one-hot draft distributions; None for an empty proposal.

    draft_probs [k, V]: row j is one-hot on proposal[j], the distribution node j-1 (the root for
    j = 0) drew its child from."""
    k = len(proposal)
    if k == 0:
        return None
    tokens = torch.tensor(list(proposal), dtype=torch.long)
    probs = torch.zeros(k, vocab_size)
    probs[torch.arange(k), tokens] = 1.0
    prob_rows = torch.cat([torch.arange(k), torch.tensor([-1])])  # the leaf drew nothing
    return DraftTree(
        tokens=tokens,
        parents=torch.arange(-1, k - 1),
        mode=SamplingMode.IID,
        draft_probs=probs,
        prob_rows=prob_rows,
    )


def draft_ngram(tokens: Sequence[int], depth: int, vocab_size: int) -> DraftTree | None:
    """The n-gram drafter's tree after the committed `tokens`: at most `depth` nodes, or None."""
    return chain_tree(propose(tokens, depth), vocab_size)
