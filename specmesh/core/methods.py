"""The drafting methods: a closed set, so an enum whose predicates name the method groups.

Every place that asks "does this method draft?", "does it take per-level branching?" asks the
enum, never a tuple of strings. `Method` is a StrEnum: it compares equal to its string, prints as
it, and is what travels in protos, JSON and Redis.
"""

from __future__ import annotations

from enum import StrEnum


class Method(StrEnum):
    NONE = "none"  # plain autoregressive decoding of the target (the baseline)
    CHAIN = "chain"  # one child per node: classic speculative decoding
    MCSD = "mcsd"  # per-level k-config, children i.i.d. or without replacement
    RSD_C = "rsd_c"  # per-level branching, Gumbel-top-k siblings
    RSD_S = "rsd_s"  # stochastic beam search
    MTAD = "mtad"  # beam sampling, the best beam verified by a joint test (not lossless)
    NGRAM = "ngram"  # a chain copied from the session's own tokens (prompt lookup), no draft model
    # a tree looked up in the session's tokens and in what other sessions generated (suffix
    # decoding, specmesh.core.suffix), no draft model
    SUFFIX = "suffix"

    @property
    def needs_model(self) -> bool:
        """Its drafts come from a draft model's forwards."""
        return self.drafts and not self.model_free

    @property
    def model_free(self) -> bool:
        """Its drafts are lookups, served by the model-free drafters (--backend ngram)."""
        return self in (Method.NGRAM, Method.SUFFIX)

    @property
    def drafts(self) -> bool:
        """It drafts a tree (everything but NONE)."""
        return self is not Method.NONE

    @property
    def branched(self) -> bool:
        """Its shape is a per-level branching factor (TreeSpec.branching)."""
        return self in (Method.MCSD, Method.RSD_C)

    @property
    def beamed(self) -> bool:
        """Its shape is a beam width (TreeSpec.beam_width; SUFFIX: its trees hold at most
        beam_width * depth nodes)."""
        return self in (Method.RSD_S, Method.MTAD, Method.SUFFIX)

    @property
    def one_node_per_level(self) -> bool:
        """It sends the verifier a chain."""
        return self in (Method.CHAIN, Method.MTAD, Method.NGRAM)

    @property
    def lossless(self) -> bool:
        """Its verification keeps the target's distribution exactly."""
        return self is not Method.MTAD


METHODS: tuple[str, ...] = tuple(m.value for m in Method)
