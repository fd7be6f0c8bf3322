"""`specmesh bench same-text`: does every method give plain decoding's greedy tokens, alone and
beside other sessions? Run against a stack (`specmesh up`), e.g. in the deterministic setting.

For each method, every prompt is generated greedily one at a time, then all of them at once, and
each stream's token ids are compared with `none`'s one-at-a-time ids. Lossless verification makes
them equal in exact arithmetic; they are equal in floating point only where a row's logits do not
depend on the forward it shares (docs/decisions.md, "Batch invariance").
"""

from __future__ import annotations

import asyncio

from specmesh.bench.measure import prompt_set, run_gateway
from specmesh.core.drafting import TreeSpec

# method -> (tree shape, DSI parallel or None)
SHAPES: dict[str, tuple[TreeSpec, int | None]] = {
    "none": (TreeSpec("none", depth=0), None),
    "chain": (TreeSpec("chain", depth=4), None),
    "mcsd": (TreeSpec("mcsd", depth=2, branching=(2, 2)), None),
    "rsd_c": (TreeSpec("rsd_c", depth=3, branching=(2, 2, 1)), None),
    "rsd_s": (TreeSpec("rsd_s", depth=3, beam_width=2), None),
    "ngram": (TreeSpec("ngram", depth=4), None),
    "dsi": (TreeSpec("chain", depth=4), 1),
}


def bench_same_text(
    address: str,
    target: str = "default-target",
    prompts: int = 8,
    max_new_tokens: int = 48,
    sessions: int = 8,
) -> dict:
    """-> per method: streams equal to none's greedy ids, alone and `sessions` at once."""
    from specmesh.runtime.tokenizers import gguf_file, load_tokenizer

    tokenizer, _ = load_tokenizer(gguf_file(target) or target)
    half = prompts // 2
    texts = prompt_set("chat", prompts - half, tokenizer) + prompt_set("code", half, tokenizer)

    def ids(spec: TreeSpec, dsi: int | None, concurrency: int) -> list[list[int]]:
        run = run_gateway(address, texts, spec, False, 0.0, max_new_tokens, concurrency, dsi, keep_ids=True)
        return asyncio.run(run)["token_ids"]

    reference, results = None, {}
    for name, (spec, dsi) in SHAPES.items():
        alone = ids(spec, dsi, 1)
        together = ids(spec, dsi, sessions)
        reference = reference or alone
        results[name] = {
            "alone": sum(a == r for a, r in zip(alone, reference, strict=True)),
            "together": sum(a == r for a, r in zip(together, reference, strict=True)),
            "prompts": len(texts),
        }
        row = results[name]
        print(
            f"{name:6} alone {row['alone']}/{len(texts)}  {sessions} at once {row['together']}/{len(texts)}",
            flush=True,
        )
    return {"sessions": sessions, "max_new_tokens": max_new_tokens, "methods": results}
