"""Toy "language models" for model-free tests: logits are a fixed random function of the path.

Both the draft and the target depend on the whole context, and the target is made deliberately
far from the draft (independent seeds, sharper logits), so wrong verification rules show up.
"""

from __future__ import annotations

import torch

from specmesh.core.sampling import SamplingParams, warp


class ToyModel:
    def __init__(self, vocab_size: int, seed: int, scale: float, base: ToyModel | None = None) -> None:
        """base: a model this one is a noisy copy of (a draft that agrees often with its target)."""
        self.vocab_size = vocab_size
        self.seed = seed
        self.scale = scale
        self.base = base
        self._memo: dict[tuple[int, ...], torch.Tensor] = {}

    def row(self, path: tuple[int, ...]) -> torch.Tensor:
        row = self._memo.get(path)
        if row is None:
            g = torch.Generator().manual_seed(hash((self.seed, *path)) & 0x7FFFFFFF)
            row = torch.randn(self.vocab_size, generator=g) * self.scale
            if self.base is not None:
                row = row + self.base.row(path)
            self._memo[path] = row
        return row

    def logits(self, paths: list[tuple[int, ...]]) -> torch.Tensor:
        return torch.stack([self.row(tuple(p)) for p in paths])

    def next_logits(self, context: tuple[int, ...]):
        """The `next_logits` callable build_tree expects, for paths below `context`."""
        return lambda paths: self.logits([(*context, *p) for p in paths])

    def dist(self, path: tuple[int, ...], params: SamplingParams) -> torch.Tensor:
        return warp(self.row(path), params)

    def greedy(self, context: tuple[int, ...], n: int) -> list[int]:
        out = list(context)
        for _ in range(n):
            out.append(int(self.row(tuple(out)).argmax()))
        return out[len(context) :]
