"""n-gram rides replayed against the target's forward costs: what a ride policy gives on real
answers, and the ceiling no policy can pass with this lookup, without a stack run per policy.

    specmesh up --no-demo &     # then:
    specmesh bench rides --sets edit quote rewrite --json rides.json

Each prompt's answer comes from the stack with method `none` (the target's own tokens: greedy, or
a seeded sample). The target's forward is measured here by rows (every row with logits, as a
ride's are), and each answer is replayed step by step, in calls of --plain-steps steps:

- `none`: one row per step;
- `default`: `FamilyPolicy` as the gateway runs it, believing the replica's start-up probe
  (`measure_forward_cost`'s defaults);
- `oracle`: every step rides exactly the proposal tokens that will be accepted, when that beats a
  plain step: the ceiling of rides from this lookup.

A proposal token x is accepted iff the answer's next token is x: the rule of proposed tokens, which
keeps a proposal while it equals the draws of plain steps, so the stack's own answer with rides
is this same answer (llama.cpp's rows move slightly with the rows beside them, which may flip a
rare draw). The replay counts forwards and
the calls' fixed cost only: what the mesh adds on top is what `bench default` measures.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence

from specmesh.bench.measure import PROMPT_SETS, prompt_set, run_gateway
from specmesh.core.adaptive import MAX_LOOKUP, FamilyPolicy
from specmesh.core.drafting import TreeSpec
from specmesh.core.methods import Method
from specmesh.core.ngram import NgramIndex

Curve = Mapping[int, float]  # rows -> seconds of one forward
# (tokens so far, this step's match length, the proposal, the answer's tokens from here) -> depth
Rider = Callable[[list[int], int, list[int], list[int]], int]


def replay(prompt: Sequence[int], answer: Sequence[int], ride: Rider, cost: Curve) -> tuple[float, int]:
    """(seconds of the forwards, forwards) of decoding `answer` after `prompt` where each step
    rides `ride(...)` tokens of the lookup's proposal (0: a plain step) and emits the accepted
    ones and one more."""
    index, tokens = NgramIndex(), list(prompt)
    index.sync(tokens)
    seconds, forwards, i = 0.0, 0, 0
    while i < len(answer):
        m, proposal = index.lookup(MAX_LOOKUP)
        rest = list(answer[i:])
        depth = min(ride(tokens, m, proposal, rest) if proposal else 0, len(rest) - 1, len(proposal))
        accepted = _agreeing(proposal[:depth], rest)
        seconds, forwards = seconds + cost[1 + depth], forwards + 1
        tokens += rest[: accepted + 1]
        index.extend(rest[: accepted + 1])
        i += accepted + 1
    return seconds, forwards


def _agreeing(proposal: Sequence[int], rest: Sequence[int]) -> int:
    """How many of the proposal's first tokens the answer goes on with: what a ride of them accepts."""
    return next((j for j, (x, y) in enumerate(zip(proposal, rest, strict=False)) if x != y), len(proposal))


def oracle(cost: Curve) -> Rider:
    """Rides exactly the tokens that will be accepted, where (a + 1) tokens for cost[1 + a] beat
    one for cost[1]."""

    def ride(tokens: list[int], m: int, proposal: list[int], rest: list[int]) -> int:
        a = min(_agreeing(proposal, rest), MAX_LOOKUP)
        return a if a and (a + 1) / cost[1 + a] > 1 / cost[1] else 0

    return ride


def _plain(tokens: list[int], m: int, proposal: list[int], rest: list[int]) -> int:
    return 0


def default_policy(belief: Curve, call_overhead: float, plain_steps: int, prompt_length: int) -> Rider:
    """The gateway's FamilyPolicy (no draft model): a plan per call of `plain_steps` steps."""
    policy = FamilyPolicy(belief, call_overhead, plain_steps, prompt_length)
    state = {"left": 0, "depth": 0, "min": 0}

    def ride(tokens: list[int], m: int, proposal: list[int], rest: list[int]) -> int:
        if state["left"] == 0:
            plan = policy.plan(tokens)
            state.update(left=plain_steps, depth=plan.lookup_depth, min=plan.lookup_min_ngram)
        state["left"] -= 1
        return state["depth"] if m >= max(1, state["min"]) else 0

    return ride


def answers(address: str, texts: list[str], tokenizer, temperature: float, max_new: int) -> list[dict]:
    """Each text's prompt tokens and the stack's `none` answer (seed 1000 + i, as bench default)."""
    m = asyncio.run(
        run_gateway(address, texts, TreeSpec(Method.NONE), False, temperature, max_new, 1, keep_ids=True)
    )
    return [
        dict(prompt=tokenizer.encode(t), answer=list(a)) for t, a in zip(texts, m["token_ids"], strict=True)
    ]


def measure_curves(target: str) -> tuple[dict[int, float], dict[int, float]]:
    """(belief, truth): the replica's start-up probe, and rows 1..MAX_LOOKUP + 1 after a 512-token
    context (the copying sets' answers run at 600-1600 tokens), both from a runner of `target`."""
    from specmesh.runtime.costs import measure_forward_cost
    from specmesh.runtime.llama_cpp import LlamaCppRunner
    from specmesh.runtime.tokenizers import gguf_file

    runner = LlamaCppRunner(str(gguf_file(target)), n_ctx=2048)
    try:
        belief = measure_forward_cost(runner)
        truth = measure_forward_cost(runner, rows=tuple(range(1, MAX_LOOKUP + 2)), context=512)
    finally:
        runner.close()
    return belief, truth


def bench_rides(
    address: str, sets: tuple[str, ...] = PROMPT_SETS, prompts: int = 4, max_new: int = 64,
    temperatures: tuple[float, ...] = (0.0, 1.0), target: str = "default-target", plain_steps: int = 4,
    call_overhead: float = 0.002,
) -> dict:  # fmt: skip
    from specmesh.runtime.tokenizers import gguf_file, load_tokenizer

    tokenizer, _ = load_tokenizer(gguf_file(target) or target)
    taken = {
        (name, t): answers(address, prompt_set(name, prompts, tokenizer), tokenizer, t, max_new)
        for name in sets
        for t in temperatures
    }
    belief, truth = measure_curves(target)
    print("forward ms by rows: " + "  ".join(f"{r}: {1000 * s:.1f}" for r, s in truth.items()), flush=True)
    rows = []
    for (name, t), pairs in taken.items():
        row: dict = dict(set=name, temperature=t)
        for engine in ("none", "default", "oracle"):
            seconds = forwards = tokens = 0
            for p in pairs:
                if engine == "default":
                    rider = default_policy(belief, call_overhead, plain_steps, len(p["prompt"]))
                else:
                    rider = oracle(truth) if engine == "oracle" else _plain
                s, f = replay(p["prompt"], p["answer"], rider, truth)
                calls = -(-f // plain_steps)
                seconds, forwards, tokens = (
                    seconds + s + calls * call_overhead,
                    forwards + f,
                    tokens + len(p["answer"]),
                )
            row[engine] = dict(
                seconds=seconds, forwards=forwards, tokens=tokens, block_efficiency=tokens / forwards
            )
        for engine in ("default", "oracle"):
            row[f"{engine}_over_none"] = row["none"]["seconds"] / row[engine]["seconds"]
        rows.append(row)
        print(
            f"{name:<7} T={t:<3}  default x{row['default_over_none']:.3f} (block efficiency "
            f"{row['default']['block_efficiency']:.2f})  oracle x{row['oracle_over_none']:.3f} "
            f"({row['oracle']['block_efficiency']:.2f})  over none",
            flush=True,
        )
    return dict(
        address=address, date=time.strftime("%Y-%m-%d %H:%M:%S"), belief=belief, truth=truth, rows=rows
    )
