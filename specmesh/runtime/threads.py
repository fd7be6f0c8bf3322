"""How OpenMP worker threads wait between the steps of a forward, chosen per process before torch
or llama.cpp is loaded: both use one libgomp, which reads its environment once, when it loads.
So the service entrypoints (`python -m verifier_service`, `python -m drafter_service`) call
`set_thread_wait` first thing; a variable already in the environment wins.

Sleeping at once (OMP_WAIT_POLICY=PASSIVE) costs a lone llama.cpp forward 1.5-2x on 2 cores
(about 600 thread barriers per forward, each a futex wake-up). Spinning for a while first
(GOMP_SPINCOUNT=30000, about 0.1 ms) makes it as fast as llama-bench, but two spinning processes
computing at once on the same cores slow each other ~14x. A verifier spins (every round waits for
its forward), a drafter sleeps (beside a spinning verifier it loses no more than beside another
sleeper). Measured in docs/decisions.md.
"""

from __future__ import annotations

import os


def set_thread_wait(spin: bool) -> None:
    """spin: spin ~0.1 ms, then sleep; else sleep at once. Before torch or llama.cpp is imported."""
    if spin:
        os.environ.setdefault("GOMP_SPINCOUNT", "30000")
    else:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
