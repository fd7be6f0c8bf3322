"""What one forward of a model costs, by the number of rows in it, measured on the machine itself.

The adaptive speculation policy (`specmesh.core.adaptive`) decides from this how deep a tree may
be and when speculation does not pay at all: on a CPU each extra row costs a sizeable share of a
one-row forward, on a GPU dozens of rows are nearly free. The model services measure it once at
start-up and report it in Info; the in-process engine measures it before its first adaptive
session.
"""

from __future__ import annotations

import time

from specmesh.core.adaptive import MAX_LOOKUP
from specmesh.runtime.backend import ModelBackend, Step

# Every row count up to 8 is measured, not interpolated: a ride takes up to 1 + MAX_LOOKUP rows
# and most draft chains fewer than 8. llama.cpp's CPU forward jumps at 8 rows (another matmul
# kernel; 1/4/8 rows: 1.0/3.3/7.5 one-row forwards), and a line from 4 rows to 8 put 5-7 rows 10-23 %
# too high, so the default rode 3 tokens of copies accepted 6 deep (docs/decisions.md, "The probe's
# rows").
PROBE_ROWS = (*range(1, max(MAX_LOOKUP + 1, 8) + 1), 16)
PROBE_SESSION = "__forward-cost-probe__"


def measure_forward_cost(
    runner: ModelBackend, rows: tuple[int, ...] = PROBE_ROWS, context: int = 32, repeats: int = 5
) -> dict[int, float]:
    """-> {rows: seconds of one forward}, the best of `repeats` (5: services measure while others
    start beside them on the same cores; with 2, the 1.5B's one-row forward read 100 ms on 2 cores
    instead of 75-85, and a draft model's rounds looked worth probing). Each forward is what a round's
    verification looks like: one new committed token and a chain of rows - 1 tree nodes, after
    a `context`-token prefix. The probe session is released afterwards."""
    vocab = runner.vocab_size
    tokens = [(7 * i + 1) % vocab for i in range(context + max(rows) + repeats * len(rows))]
    cost = dict.fromkeys(rows, float("inf"))
    try:
        runner.forward([Step(PROBE_SESSION, new_tokens=tokens[:context])])
        used = context
        for _ in range(repeats):  # row counts in turn: a burst of other work spoils one try of each
            for n in rows:
                step = Step(
                    PROBE_SESSION,
                    new_tokens=[tokens[used]],
                    node_tokens=tokens[used + 1 : used + n],
                    node_parents=list(range(-1, n - 2)),
                )
                start = time.perf_counter()
                runner.forward([step])
                cost[n] = min(cost[n], time.perf_counter() - start)
                runner.commit(PROBE_SESSION, [])
                used += 1
    finally:
        runner.release(PROBE_SESSION, keep=False)  # not a prefix anyone will send
    return cost
