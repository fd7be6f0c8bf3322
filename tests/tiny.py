"""Tiny random causal LMs for tests (never downloaded): specmesh.bench.tiny, which benchmarks share."""

from specmesh.bench.tiny import ARCHS, tiny_lm

__all__ = ["ARCHS", "tiny_lm"]
