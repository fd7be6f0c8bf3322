"""Grammar masks with llguidance (specmesh.core.grammar): a matcher per session, kept in step
with the session's committed tokens, asked for the allowed tokens after each path of a tree.

Why llguidance (docs/decisions.md): it compiles JSON schemas, regexes and Lark grammars, computes a
mask in tens of microseconds without precomputing per-state tables, rolls back consumed tokens
(what walking a tree's paths needs), reads a transformers tokenizer offline, and ships as one
abi3 wheel with no torch. vLLM, SGLang and llama.cpp use it as a backend.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from specmesh.core.grammar import Grammar, Path


@functools.cache
def _lltokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's view of a model's tokenizer (about a second for 152k tokens: once per model)."""
    import llguidance.hf

    try:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    except ValueError as exc:  # e.g. a word-level tokenizer: no byte decoding
        raise ValueError(f"grammar: llguidance cannot use this model's tokenizer: {exc}") from None


class GrammarMasks:
    """One session's constraint: which tokens `grammar` allows after its committed tokens and a
    path. The matcher follows the committed tokens by their common prefix with what it consumed
    (a rollback, then the rest), so a resync, a failover or a pre-draft's guess needs no hook."""

    def __init__(self, grammar: Grammar, tokenizer: Any, vocab_size: int) -> None:
        import llguidance

        self.grammar, self.vocab_size = grammar, vocab_size
        self.matcher = llguidance.LLMatcher(_lltokenizer(tokenizer, vocab_size), grammar.text, log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"grammar: {self.matcher.get_error()}")
        self.consumed: list[int] = []

    def allowed(self, committed: Sequence[int], paths: Sequence[Path]) -> torch.Tensor:
        """-> [len(paths), V] bool. A path the grammar does not allow (a draft outside it) gets an
        all-true row: its node is never accepted, so the row is never read."""
        self._follow(list(committed))
        out = torch.ones(len(paths), self.vocab_size, dtype=torch.bool)
        for k, path in enumerate(paths):
            n = self.matcher.try_consume_tokens(list(path)) if path else 0
            if n == len(path):  # a finished grammar allows only the end-of-sequence token
                out[k] = self._mask()
            if n:
                self.matcher.rollback(n)
        return out

    def _follow(self, committed: list[int]) -> None:
        same = 0
        for a, b in zip(self.consumed, committed, strict=False):
            if a != b:
                break
            same += 1
        if same < len(self.consumed):
            self.matcher.rollback(len(self.consumed) - same)
            del self.consumed[same:]
        rest = committed[same:]
        n = self.matcher.try_consume_tokens(rest) if rest else 0
        self.consumed += rest[:n]  # tokens past a stop (or outside the grammar) are not followed

    def _mask(self) -> torch.Tensor:
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        return torch.from_numpy(np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool))


class SessionGrammars:
    """The replica's matchers, one per session with a grammar (dropped with the session)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._masks: dict[str, GrammarMasks] = {}

    def get(self, session_id: str, grammar: Grammar) -> GrammarMasks:
        masks = self._masks.get(session_id)
        if masks is None or masks.grammar != grammar:
            masks = self._masks[session_id] = GrammarMasks(grammar, self.tokenizer, self.vocab_size)
        return masks

    def drop(self, session_id: str) -> None:
        self._masks.pop(session_id, None)
