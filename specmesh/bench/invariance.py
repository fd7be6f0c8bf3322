"""`specmesh bench invariance`: does a row's logits depend on the forward it shares?

The bitwise self-test of batch invariance. One row -- the target's logits after a fixed prompt and
one more token -- is computed alone first (a one-row decode in a fresh runner), then the same row
inside forwards laid out the ways serving lays them out, each compared with the alone row bit for
bit:

  own k      the last of k causal rows of its own session (a prefill chunk, a resync)
  beside k   one of k sessions' one-row steps in one forward (a tick of plain decoding)
  tree k     a tree node among k - 1 siblings (a verification)
  late       alone again, after every case above filled the cache (its cells elsewhere)
  churned    alone, after its own session's rejected tree left holes where its cells go
  reordered  alone, after its last 8 prompt tokens were a tree path, each beside a rejected
             sibling: holes before their cells, where a reusing cache puts the row's
  cached prefix   in a session that took its prompt's KV from a released session's, kept
             (prefix caching: only the row is fed)
  shared prefix   likewise from a live session's committed tokens
  chunked 16 after its prompt was fed by prefill steps of 16 tokens (chunked prefill)

k runs over 2, 4, 8 and 32. A row that equals the alone row in every case is batch invariant for
that backend and dtype: the same seed gives the same text whatever else the server runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from specmesh.runtime.backend import ModelBackend, Step

SIZES = (2, 4, 8, 32)
PROMPT = (
    "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n"
    '    """Merge two sorted lists into one sorted list, keeping duplicates."""\n'
    "    out, i, j = [], 0, 0\n"
    "    while i < len(a) and j < len(b):\n"
)
OTHER = "The quick brown fox jumps over the lazy dog while the cat sleeps by the warm fire."


@dataclass(frozen=True)
class Case:
    """One layout of the row and how its logits compare with the alone row's."""

    name: str
    rows: int  # rows in the forward that computed it
    differing: int  # logits not bit-identical to the alone row's
    max_abs_diff: float
    argmax_moved: bool

    @property
    def identical(self) -> bool:
        return self.differing == 0


def _compare(name: str, rows: int, row: np.ndarray, alone: np.ndarray) -> Case:
    diff = np.abs(row.astype(np.float64) - alone.astype(np.float64))
    return Case(
        name,
        rows,
        int(np.count_nonzero(row != alone)),
        float(diff.max()),
        int(row.argmax()) != int(alone.argmax()),
    )


def _row(logits: Any, index: int = -1) -> np.ndarray:
    return logits[index].float().cpu().numpy()


def probe(open_runner: Callable[[], ModelBackend], prompt: list[int], other: list[int]) -> list[Case]:
    """Every layout of the row (module docstring), each compared with the row computed alone.
    prompt: the session's tokens, its last one the row's; other: tokens the other sessions use."""
    if len(prompt) < max(SIZES) + 1 or len(other) < max(SIZES) + 1:
        raise ValueError(f"the prompt and the other tokens need at least {max(SIZES) + 1} tokens")
    head, last = prompt[:-1], prompt[-1]

    def alone(runner: ModelBackend, sid: str) -> np.ndarray:
        runner.forward([Step(sid, head)])
        return _row(runner.forward([Step(sid, [last])])[0])

    runner = open_runner()
    reference = alone(runner, "alone")
    cases = []
    for k in SIZES:  # the row closes a k-row chunk of its own session
        sid = f"own-{k}"
        runner.forward([Step(sid, prompt[: len(prompt) - k])])
        cases.append(_compare(f"own {k}", k, _row(runner.forward([Step(sid, prompt[-k:])])[0]), reference))
    for k in SIZES:  # one row among k sessions' rows; the others' prompts are of other lengths
        sid, others = f"beside-{k}", [f"beside-{k}-{j}" for j in range(k - 1)]
        runner.forward([Step(sid, head), *(Step(o, other[: 3 + j]) for j, o in enumerate(others))])
        steps = [Step(o, [other[(7 * j + 5) % len(other)]]) for j, o in enumerate(others)]
        steps.insert(len(steps) // 2, Step(sid, [last]))
        out = runner.forward(steps)
        cases.append(_compare(f"beside {k}", k, _row(out[len(others) // 2]), reference))
    for k in SIZES:  # a tree node among siblings under the root
        sid = f"tree-{k}"
        runner.forward([Step(sid, head)])
        siblings = [last, *(other[j] for j in range(k - 1))]
        out = runner.forward([Step(sid, node_tokens=siblings, node_parents=[-1] * k)])[0]
        cases.append(_compare(f"tree {k}", k, _row(out, 0), reference))
    cases.append(_compare("late", 1, alone(runner, "late"), reference))
    runner.forward([Step("churned", head[:-8])])  # a tree of 8 nodes, all rejected
    runner.forward([Step("churned", node_tokens=other[:8], node_parents=[-1, 0, 1, 2, 3, 4, 5, 6])])
    runner.commit("churned", [])
    runner.forward([Step("churned", head[-8:])])
    cases.append(_compare("churned", 1, _row(runner.forward([Step("churned", [last])])[0]), reference))
    # head's last 8 tokens as a tree path, each after a rejected sibling: holes before its cells
    runner.forward([Step("reordered", head[:-8])])
    tokens, parents = [], []
    for j, tok in enumerate(head[-8:]):
        tokens += [other[j], tok]
        parents += [2 * j - 1] * 2  # both hang from the previous kept node (-1: the root)
    runner.forward([Step("reordered", node_tokens=tokens, node_parents=parents)])
    runner.commit("reordered", list(range(1, 16, 2)))
    cases.append(_compare("reordered", 1, _row(runner.forward([Step("reordered", [last])])[0]), reference))
    cases += _prefix_cases(open_runner(), head, last, reference)
    return cases


def _prefix_cases(runner: ModelBackend, head: list[int], last: int, reference: np.ndarray) -> list[Case]:
    """The row after a prefix taken from another session's KV (kept, or live), and after its
    prompt was fed in prefill chunks (a runner with the prefix cache on)."""
    runner.enable_prefix_cache()  # type: ignore[attr-defined]
    runner.forward([Step("kept", head)])
    runner.release("kept")
    cached = _row(runner.forward([Step("cached", [*head, last])])[0])
    assert runner.reused_tokens("cached") == len(head), "the kept prefix was not taken"
    runner.forward([Step("live", head, salt=b"live")])  # a salt of its own: "live"'s KV alone matches
    shared = _row(runner.forward([Step("sharing", [*head, last], salt=b"live")])[0])
    assert runner.reused_tokens("sharing") == len(head), "the live prefix was not taken"
    fed, out = 0, None
    while out is None or not len(out):  # fresh tokens (a salt of its own), 16 a step, then whole
        out = runner.forward([Step("chunked", [*head, last][fed:], feed_limit=16, salt=b"chunked")])[0]
        fed = runner.committed_length("chunked") or 0
    chunked = _row(out)
    return [
        _compare("cached prefix", 1, cached, reference),
        _compare("shared prefix", 1, shared, reference),
        _compare("chunked 16", 16, chunked, reference),
    ]


def markdown(title: str, cases: list[Case]) -> str:
    same = sum(c.identical for c in cases)
    lines = [
        f"**{title}**: {same} of {len(cases)} layouts bit-identical to the row alone",
        "",
        "| layout | rows | logits differing | max abs diff | argmax moved |",
        "|---|---:|---:|---:|---|",
    ]
    for c in cases:
        moved = "yes" if c.argmax_moved else "no"
        lines.append(f"| {c.name} | {c.rows} | {c.differing} | {c.max_abs_diff:.3g} | {moved} |")
    return "\n".join(lines)


def bench_invariance(
    model: str = "default-target",
    backend: str = "auto",
    dtype: str = "bf16",
    deterministic: bool = False,
    long: bool = False,
) -> tuple[str, list[Case]]:
    """The probe on one model, backend and dtype -> (the setting in words, its cases). long: a
    prompt of ~700 tokens (512+ cells in use: one-row forwards take other attention kernels)."""
    from specmesh.runtime.backend import Backend
    from specmesh.runtime.models import load_model

    loaded = load_model(model, dtype=dtype, backend=backend)
    # open_runner refuses `deterministic` on a backend that has no such setting
    open_runner = functools.partial(loaded.open_runner, deterministic=deterministic)
    if loaded.backend is Backend.LLAMA_CPP:
        setting = f"llama.cpp {loaded.gguf.name if loaded.gguf else model}"
    else:
        setting = f"{loaded.backend} {str(loaded.dtype).removeprefix('torch.')} {model}"
    tokenizer = loaded.tokenizer
    prompt = tokenizer(PROMPT * (12 if long else 1))["input_ids"]
    other = tokenizer(OTHER)["input_ids"] * 3
    setting += f", {'deterministic' if deterministic else 'default'}, {len(prompt)}-token prompt"
    return setting, probe(open_runner, prompt, other)
