"""Micro-benchmark of verify_tree alone: synthetic trees over a real-size vocabulary.

Draft and target logits are random but correlated (the target is the draft plus noise), so
walks go several levels deep and rejections compute residuals over the whole vocabulary.
"""

from __future__ import annotations

import statistics
import time

import torch

from specmesh.core.drafting import TreeSpec, build_tree
from specmesh.core.methods import Method
from specmesh.core.sampling import SamplingParams
from specmesh.core.verification import verify_tree

SHAPES = {
    16: [
        TreeSpec("chain", depth=16),
        TreeSpec("rsd_s", depth=4, beam_width=4),
        TreeSpec("mcsd", depth=2, branching=(4, 3), replacement=True),
    ],
    64: [
        TreeSpec("rsd_s", depth=8, beam_width=8),
        TreeSpec("rsd_c", depth=4, branching=(4, 2, 2, 2)),
        TreeSpec("mcsd", depth=3, branching=(4, 3, 4), replacement=True),
    ],
}
PARAMS = {
    "T=1": SamplingParams(1.0),
    "T=1 top-k 50": SamplingParams(1.0, top_k=50),
    "T=1 top-p 0.9": SamplingParams(1.0, top_p=0.9),
    "greedy": SamplingParams(0.0),
}


def _random_tree(spec: TreeSpec, vocab: int, params: SamplingParams, g: torch.Generator):
    rows: dict[tuple[int, ...], torch.Tensor] = {}

    def draft_logits(paths):
        out = []
        for p in paths:
            if p not in rows:
                rows[p] = torch.randn(vocab, generator=g) * 3
            out.append(rows[p])
        return torch.stack(out)

    tree = build_tree(spec, draft_logits, params, g)
    paths = [()] + [tuple(tree.path(i)) for i in range(tree.num_nodes)]
    noise = torch.randn(len(paths), vocab, generator=g)
    target = torch.stack([rows.get(p, torch.randn(vocab, generator=g) * 3) for p in paths]) + noise
    return tree, target


def bench_verify(vocab: int = 151_936, repeats: int = 20, threads: int | None = None) -> list[dict]:
    if threads:
        torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    results = []
    for nodes, specs in SHAPES.items():
        for spec in specs:
            for name, params in PARAMS.items():
                times, depths = [], []
                for _ in range(repeats):
                    tree, target = _random_tree(spec, vocab, params, g)
                    assert tree.num_nodes <= nodes
                    start = time.perf_counter()
                    verdict = verify_tree(tree, target, params, g)
                    times.append(time.perf_counter() - start)
                    depths.append(len(verdict.accepted_nodes))
                results.append(
                    dict(
                        nodes=nodes,
                        method=spec.method,
                        shape=_shape(spec),
                        params=name,
                        median_ms=1e3 * statistics.median(times),
                        max_ms=1e3 * max(times),
                        mean_accepted=statistics.mean(depths),
                    )
                )
    return results


def _shape(spec: TreeSpec) -> str:
    if spec.method.beamed:
        return f"{spec.beam_width}x{spec.depth}"
    if spec.method is Method.CHAIN:
        return f"L={spec.depth}"
    return "x".join(map(str, spec.branching))


def print_table(results: list[dict]) -> None:
    header = ("nodes", "method", "shape", "params", "median ms", "max ms", "accepted")
    print("{:>5} {:<7} {:<8} {:<14} {:>9} {:>7} {:>8}".format(*header))
    for r in results:
        print(
            f"{r['nodes']:>5} {r['method']:<7} {r['shape']:<8} {r['params']:<14} "
            f"{r['median_ms']:>9.2f} {r['max_ms']:>7.2f} {r['mean_accepted']:>8.2f}"
        )
