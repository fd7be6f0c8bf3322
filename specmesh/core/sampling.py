"""Sampling parameters, logit warping and the Gumbel helpers every drafting method uses.

Everything here is model-free tensor code. `warp` is the one place where temperature, top-k and
top-p turn logits into a distribution, so the draft p and the target q are always warped the
same way (a mismatch there silently breaks losslessness).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specmesh.core.extras import missing

try:
    import torch
except ModuleNotFoundError as exc:  # a gateway-only install (specmesh.core.extras)
    torch = missing(exc)

# A top-p cut over the whole vocabulary needs a full sort (about 11 ms at V = 152k on this CPU).
# The kept set is almost always small, so look at the top candidates first and sort everything
# only when they do not reach the mass (exact either way; topk 1024 / 8192 cost 0.5 / 2 ms).
_TOP_P_PROBES = (1024, 8192)
# Below this a temperature or a top-p is its limit, greedy (vLLM's _SAMPLING_EPS): logits / 1e-40
# overflow fp32 to inf (softmax then gives NaN), and a top-p under fp32's resolution keeps nothing.
# Every replica builds its SamplingParams here, so the gateway, drafters, verifiers and the engine
# all see the same greedy request.
SAMPLING_EPS = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are sampled. temperature 0 means greedy; top_k 0 and top_p 1 mean no filter."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.temperature < SAMPLING_EPS or self.top_p < SAMPLING_EPS:  # their limit: greedy
            object.__setattr__(self, "temperature", 0.0)
            object.__setattr__(self, "top_p", 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def warp_rows(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """`warp` of each row [R, V] with its own params: rows that share params are warped together,
    so a tick of sessions with one setting costs one warp. Every row's result is what `warp` gives
    it alone (each step of the warp is a per-row reduction)."""
    if len(params) != logits.shape[0]:
        raise ValueError(f"{len(params)} params for {logits.shape[0]} rows")
    groups: dict[tuple[float, int, float], list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault((p.temperature, p.top_k, p.top_p), []).append(i)
    if len(groups) == 1:
        return warp(logits, params[0])
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for rows in groups.values():
        index = torch.tensor(rows, device=logits.device)
        out[index] = warp(logits[index], params[rows[0]])
    return out


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Raw logits [..., V] -> the fp32 distribution [..., V] that tokens are sampled from.

    Order: temperature, then top-k, then top-p (the smallest set of most likely tokens whose mass
    reaches top_p; the most likely token is always kept). Greedy gives the one-hot argmax.
    """
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    if params.temperature != 1.0:  # x / 1.0 is x: T = 1 spares a vocabulary-wide copy
        logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        top = logits.topk(params.top_k, dim=-1).indices
        keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, top, True)
        logits = logits.masked_fill(~keep, -math.inf)
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = _top_p_filter(probs, params.top_p)
    return probs


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    flat = probs.reshape(-1, probs.shape[-1])
    top = None
    for k in _TOP_P_PROBES:
        if k >= flat.shape[-1]:
            break
        top = flat.topk(k, dim=-1)
        if bool((top.values.sum(-1) >= top_p).all()):
            break
        top = None
    if top is None:
        top = flat.sort(dim=-1, descending=True)
    mass_before = top.values.cumsum(-1) - top.values
    keep_sorted = mass_before < top_p  # the first token always has mass_before 0
    keep = torch.zeros_like(flat, dtype=torch.bool).scatter_(-1, top.indices, keep_sorted)
    kept = flat.masked_fill(~keep, 0.0)
    return (kept / kept.sum(-1, keepdim=True)).reshape(probs.shape)


def gumbel_like(x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """i.i.d. Gumbel(0, 1) noise with the shape of x."""
    u = torch.rand(x.shape, generator=generator, dtype=torch.float64, device=x.device)
    u = u.clamp_(min=torch.finfo(torch.float64).tiny, max=1.0 - 1e-16)
    return -(-u.log()).log()


def gumbel_top_k(logp: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
    """Sample k tokens without replacement from exp(logp) (one row [V]), in sampling order.

    Gumbel-top-k: the k largest perturbed scores, sorted in decreasing order, are a sequential
    sample without replacement. Tokens with probability 0 are never returned, so fewer than k
    come back when the support is smaller than k.
    """
    scores = logp.double() + gumbel_like(logp, generator)
    k = min(k, int(torch.isfinite(logp).sum()))
    return scores.topk(k).indices


def argmax_rows(rows: torch.Tensor) -> list[int]:
    """Each row's first maximum, rows [R, V]. On a CPU float32 tensor numpy's argmax: torch's
    single-threaded one took 0.23 ms a row at V = 152k here (1.1 ms for a 5-row ride, every greedy
    step), numpy's 0.011 ms. Both return the first of tied maxima."""
    if rows.device.type == "cpu" and rows.dtype == torch.float32:
        return rows.detach().numpy().argmax(-1).tolist()
    return rows.argmax(-1).tolist()


def sample_rows(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: probs [R, V], u [R, K] uniforms in [0, 1) float64 -> [R, K] tokens, row r's
    drawn from probs[r]. Exact in float64, and at V = 152k about 20x cheaper than
    torch.multinomial (~11 ms a call on this CPU). Tokens with probability 0 are never drawn: their
    CDF step is empty."""
    cdf = probs.cumsum(-1, dtype=torch.float64)  # the bits of probs.double().cumsum(-1), no copy
    scaled = u.to(cdf.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, scaled.contiguous(), right=True).clamp_(max=probs.shape[-1] - 1)


def sample_iid(probs: torch.Tensor, k: int, draws: Draws | torch.Generator | None) -> torch.Tensor:
    """k tokens drawn independently (with replacement) from a distribution [V]."""
    return sample_rows(probs.unsqueeze(0), as_draws(draws).uniform(k).unsqueeze(0))[0]


def sample(probs: torch.Tensor, draws: Draws | torch.Generator | None) -> int:
    """One token from a distribution [V]."""
    return int(sample_iid(probs, 1, draws))


# ---- randomness ---------------------------------------------------------------------------------
# A round's randomness is a function of (session seed, committed length, purpose) only, so that
# any replica (or the in-process engine) running the same round draws the same numbers, whatever
# other sessions share its tick. `Draws` is that stream: counter-based (splitmix64 of a key and an
# index), so the uniforms of a whole tick are one numpy expression (`uniform_many`).

_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _counter_uniforms(keys: np.ndarray, counters: np.ndarray, n: int) -> np.ndarray:
    """keys, counters [B] uint64 -> [B, n] float64 in (0, 1): the draws counter .. counter + n - 1
    of each key's stream."""
    with np.errstate(over="ignore"):
        index = counters[:, None] + np.arange(1, n + 1, dtype=np.uint64)[None, :]
        bits = _mix(keys[:, None] + index * np.uint64(_GOLDEN))
    return ((bits >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53


def _key(seed: int, position: int, purpose: str) -> int:
    digest = hashlib.blake2b(f"{seed}:{position}:{purpose}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class Draws:
    """A stream of uniforms in (0, 1): counter-based from a key (`derive`), or a torch generator's
    `torch.rand` (`from_generator`: tests that share one generator over many rounds). Tree builders
    that need noise over a whole vocabulary (Gumbel-top-k) take `generator()` instead."""

    def __init__(
        self,
        key: int | None = None,
        generator: torch.Generator | None = None,
        origin: tuple[int, int, str] | None = None,
    ) -> None:
        self.key, self.counter, self._generator = key, 0, generator
        self.origin = origin  # (seed, position, purpose) of a derived stream

    @classmethod
    def derive(cls, seed: int, position: int, purpose: str) -> Draws:
        """The stream of one round's `purpose` ("draft", "verify") after `position` committed tokens."""
        return cls(key=_key(seed, position, purpose), origin=(seed, position, purpose))

    @classmethod
    def from_generator(cls, generator: torch.Generator | None) -> Draws:
        return cls(generator=generator if generator is not None else torch.default_generator)

    def uniform(self, n: int) -> torch.Tensor:
        """The next n draws, float64 [n]."""
        if self.key is None:
            return torch.rand(n, generator=self._generator, dtype=torch.float64)
        out = _counter_uniforms(np.array([self.key], np.uint64), np.array([self.counter], np.uint64), n)
        self.counter += n
        return torch.from_numpy(out[0])

    def _position_keys(self, n: int) -> list[int]:
        """The keys of the streams of this position and the n - 1 after it (a derived stream)."""
        if n == 0:
            return []
        seed, position, purpose = self.origin
        return [self.key, *(_key(seed, position + j, purpose) for j in range(1, n))]

    def generator(self) -> torch.Generator:
        """A torch generator for noise over the vocabulary: the wrapped one, or one seeded from the
        key (made once per stream)."""
        if self._generator is None:
            self._generator = torch.Generator().manual_seed(self.key & 0x7FFF_FFFF_FFFF_FFFF)
        return self._generator


def as_draws(draws: Draws | torch.Generator | None) -> Draws:
    return draws if isinstance(draws, Draws) else Draws.from_generator(draws)


def per_position_many(streams: Sequence[Draws], lengths: Sequence[int]) -> torch.Tensor:
    """float64 [sum(lengths)]: per stream, for its position and the n - 1 after it, the first draw
    of the stream `Draws.derive` gives that position (what a plain step there draws), the stream's
    own first draw first; concatenated, in one numpy expression for the whole tick when every
    stream is fresh and derived (the verifier's). A stream not derived from positions (a
    generator), or one that has drawn already, gives its next n: independent draws still, only
    not a plain step's."""
    fresh = [d.origin is not None and not d.counter for d in streams]
    if not all(fresh):  # a generator, or a stream that has drawn: stream by stream
        parts = zip(streams, lengths, fresh, strict=True)
        return torch.cat([per_position_many([d], [n]) if f else d.uniform(n) for d, n, f in parts])
    keys = [k for d, n in zip(streams, lengths, strict=True) for k in d._position_keys(n)]
    for d, n in zip(streams, lengths, strict=True):
        d.counter = min(n, 1)
    counters = np.zeros(len(keys), np.uint64)
    return torch.from_numpy(_counter_uniforms(np.array(keys, np.uint64), counters, 1)[:, 0])


def uniform_many(streams: Sequence[Draws], n: int) -> torch.Tensor:
    """The next n draws of each stream, float64 [len(streams), n]: one numpy expression when all
    are counter-based (a tick's sessions), else stream by stream."""
    if not streams:
        return torch.zeros(0, n, dtype=torch.float64)
    if any(d.key is None for d in streams):
        return torch.stack([d.uniform(n) for d in streams])
    keys = np.fromiter((d.key for d in streams), np.uint64, len(streams))
    counters = np.fromiter((d.counter for d in streams), np.uint64, len(streams))
    for d in streams:
        d.counter += n
    return torch.from_numpy(_counter_uniforms(keys, counters, n))
