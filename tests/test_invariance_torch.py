"""The torch backend's deterministic setting (specmesh.runtime.invariant_ops) in bf16: the self-test
(specmesh/bench/invariance.py) finds every layout bit-identical where the default sdpa and oneDNN
path differs, and every method's greedy ids equal `none`'s, one session at a time and 8 at once,
where the default path's do not."""

from __future__ import annotations

import pytest
import torch

from specmesh.bench.invariance import SIZES, probe
from specmesh.bench.tiny import tiny_pair
from specmesh.core.drafting import TreeSpec
from specmesh.core.rounds import Request
from specmesh.core.sampling import SamplingParams
from specmesh.runtime.engine import SpeculativeEngine
from specmesh.runtime.invariant_ops import invariant_attention, invariant_linear
from specmesh.runtime.runner import ModelRunner

PROMPT = [4 + (i * 7) % 90 for i in range(60)]
OTHER = [4 + (i * 13 + 3) % 90 for i in range(60)]
METHODS = {
    "none": TreeSpec("none", depth=0),
    "chain": TreeSpec("chain", depth=4),
    "mcsd": TreeSpec("mcsd", depth=2, branching=(2, 2)),
    "rsd_c": TreeSpec("rsd_c", depth=3, branching=(2, 2, 1)),
    "rsd_s": TreeSpec("rsd_s", depth=3, beam_width=2),
    "ngram": TreeSpec("ngram", depth=4),
}


@pytest.fixture(scope="module")
def bf16_pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """Qwen2 (biased q/k/v projections, grouped heads, as the default pair), in bf16."""
    draft, target = tiny_pair("qwen2", hidden_size=128, intermediate_size=256, num_attention_heads=4)
    return draft.to(torch.bfloat16), target.to(torch.bfloat16)


def test_every_layout_is_bit_identical_with_the_deterministic_setting(bf16_pair) -> None:
    target = bf16_pair[1]
    cases = probe(lambda: ModelRunner(target, deterministic=True), PROMPT, OTHER)
    assert len(cases) == 3 * len(SIZES) + 6
    assert {c.name: c.differing for c in cases} == {c.name: 0 for c in cases}


def test_the_self_test_catches_the_default_bf16_path(bf16_pair) -> None:
    """sdpa's CPU kernels block the keys and queries by the forward's shape: rows differ."""
    cases = probe(lambda: ModelRunner(bf16_pair[1]), PROMPT, OTHER)
    assert any(c.differing for c in cases)


def test_the_invariant_ops_compute_what_the_torch_ones_do() -> None:
    """Same function, other summation order: equal to fp32 rounding, masks and groups honoured."""
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(45, 64, generator=g), torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    assert torch.allclose(invariant_linear(x, w, b), torch.nn.functional.linear(x, w, b), atol=1e-4)
    q, k, v = (
        torch.randn(2, 4, 5, 16, generator=g),
        torch.randn(2, 2, 9, 16, generator=g),
        torch.randn(2, 2, 9, 16),
    )
    mask = torch.rand(2, 1, 5, 9, generator=g) > 0.3
    mask[..., 0] = True
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert torch.allclose(invariant_attention(q, k, v, attn_mask=mask), want, atol=1e-5)
    causal = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.allclose(invariant_attention(q, k, v, is_causal=True), causal, atol=1e-5)
    mask[1, 0, 2] = False  # a row that sees nothing (a pad query) stays finite
    assert torch.isfinite(invariant_attention(q, k, v, attn_mask=mask)).all()


def _greedy(pair, deterministic: bool) -> dict[str, tuple[list[list[int]], list[list[int]]]]:
    """-> per method: each prompt's ids generated alone, and all 8 at once."""
    draft, target = pair
    engine = SpeculativeEngine(
        ModelRunner(draft, deterministic=deterministic), ModelRunner(target, deterministic=deterministic)
    )
    prompts = [PROMPT[i : 20 + 3 * i] for i in range(8)]
    out = {}
    for name, spec in METHODS.items():
        requests = [Request(p, spec, SamplingParams(0.0), 40) for p in prompts]
        alone = [engine.generate_many([r])[0].token_ids for r in requests]
        together = [r.token_ids for r in engine.generate_many(requests)]
        out[name] = (alone, together)
    return out


def test_every_methods_greedy_ids_equal_nones_alone_and_8_at_once(bf16_pair) -> None:
    runs = _greedy(bf16_pair, deterministic=True)
    reference = runs["none"][0]
    assert {name: (alone, together) for name, (alone, together) in runs.items()} == {
        name: (reference, reference) for name in runs
    }


def test_the_default_bf16_path_fails_the_same_check(bf16_pair) -> None:
    """Without the setting the same check fails: a session's greedy ids change with the sessions
    beside it (on this pair, `none` itself 5 of 8 when 8 run at once)."""
    runs = _greedy(bf16_pair, deterministic=False)
    reference = runs["none"][0]
    assert any(together != reference for _, together in runs.values())


def test_int8_weights_refuse_the_deterministic_setting(tmp_path) -> None:
    """--deterministic on an int8 replica (dynamic quantization: its own matmul kernels, not
    F.linear) is refused at start, naming the setting, not silently ignored."""
    from specmesh.bench.tiny import save_tiny_pair
    from specmesh.runtime.models import load_model

    draft = load_model(save_tiny_pair(tmp_path)["draft"], dtype="int8", backend="torch")
    with pytest.raises(ValueError, match=r"deterministic: int8 weights"):
        draft.open_runner(deterministic=True)
