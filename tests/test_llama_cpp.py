"""The llama.cpp backend (specmesh.runtime.llama_cpp) on a tiny GGUF written by the tests.

The reference is llama.cpp itself: a tree node's logits must equal decoding its path one token at
a time in a fresh session, whatever the tree, the number of calls, the other sessions in the call,
a commit or an eviction. The same weights through transformers are a second reference."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from specmesh.core.sampling import SamplingParams
from specmesh.runtime.backend import Backend, Step, UnknownSessionError
from specmesh.runtime.engine import SpeculativeEngine
from specmesh.runtime.llama_cpp import LlamaCppRunner
from specmesh.runtime.models import load_model, resolve_backend
from specmesh.runtime.runner import ModelRunner
from tests.test_engine import PROMPT, SPECS, tiny_pair
from tests.tiny import tiny_lm
from tests.tiny_gguf import save_tiny_gguf, save_tiny_gguf_pair, vocabulary

TOL = 1e-4
N_WORDS = 64


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory: pytest.TempPathFactory):
    return save_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", n_words=N_WORDS)


@pytest.fixture
def runner(gguf_path) -> LlamaCppRunner:
    r = LlamaCppRunner(gguf_path, n_ctx=2048, n_seq_max=64, threads=1, kv_type="f32")
    yield r
    r.close()


def sequential(runner: LlamaCppRunner, tokens: list[int]) -> torch.Tensor:
    """Logits after each prefix of `tokens`, one token per call, in a fresh session: [len, V]."""
    sid = f"ref-{random.getrandbits(32)}"
    rows = [runner.forward([Step(sid, new_tokens=[tokens[0]])])[0]]
    for tok in tokens[1:]:
        rows.append(runner.forward([Step(sid, new_tokens=[tok])])[0])
    runner.release(sid)
    return torch.cat(rows)


def random_tree(rng: random.Random, n: int, vocab: int) -> tuple[list[int], list[int]]:
    tokens, parents = [], []
    for i in range(n):
        parents.append(rng.randrange(-1, i))
        tokens.append(rng.randrange(3, vocab))
    return tokens, parents


def path(parents: list[int], node: int) -> list[int]:
    out = []
    while node != -1:
        out.append(node)
        node = parents[node]
    return out[::-1]


def test_vocabulary_size(runner) -> None:
    assert runner.vocab_size == len(vocabulary(N_WORDS))


@pytest.mark.parametrize("seed", range(4))
def test_every_tree_node_equals_decoding_its_path(runner, seed: int) -> None:
    rng = random.Random(seed)
    prompt = [rng.randrange(3, runner.vocab_size) for _ in range(rng.randrange(1, 9))]
    tokens, parents = random_tree(rng, rng.randrange(1, 16), runner.vocab_size)
    out = runner.forward([Step("s", prompt, tokens, parents)])[0]
    assert out.shape == (1 + len(tokens), runner.vocab_size)
    assert torch.allclose(out[0], sequential(runner, prompt)[-1], atol=TOL)
    for node in range(len(tokens)):
        ref = sequential(runner, prompt + [tokens[n] for n in path(parents, node)])[-1]
        assert torch.allclose(out[1 + node], ref, atol=TOL), node


def test_level_by_level_equals_one_call(runner) -> None:
    prompt, tokens, parents = [5, 9, 7], [10, 11, 12, 13, 14, 15], [-1, -1, 0, 0, 1, 4]
    one = runner.forward([Step("one", prompt, tokens, parents)])[0]
    root = runner.forward([Step("lvl", new_tokens=prompt)])[0]
    first = runner.forward([Step("lvl", node_tokens=tokens[:2], node_parents=parents[:2])])[0]
    second = runner.forward([Step("lvl", node_tokens=tokens[2:5], node_parents=parents[2:5])])[0]
    third = runner.forward([Step("lvl", node_tokens=tokens[5:], node_parents=parents[5:])])[0]
    assert torch.allclose(torch.cat([root, first, second, third]), one, atol=TOL)
    assert runner.pending_tokens("lvl") == tokens


@pytest.mark.parametrize("keep", [[], [0], [1, 4], [1, 4, 5], [0, 3]])
def test_commit_then_continue_equals_a_fresh_decode(runner, keep: list[int]) -> None:
    prompt, tokens, parents = [4, 8, 6], [10, 11, 12, 13, 14, 15], [-1, -1, 0, 0, 1, 4]
    runner.forward([Step("c", prompt, tokens, parents)])
    runner.commit("c", keep)
    committed = prompt + [tokens[n] for n in keep]
    assert runner.committed_tokens("c") == committed and runner.pending_tokens("c") == []
    nxt = runner.forward([Step("c", [20], [21, 22], [-1, 0])])[0]
    ref = sequential(runner, [*committed, 20, 21, 22])
    assert torch.allclose(nxt, ref[-3:], atol=TOL)
    # the sequences of the dropped branches are free again
    assert len(runner._free) == runner.n_seq_max - 2  # the main sequence + this call's one leaf


def test_truncate_then_continue_equals_a_fresh_decode(runner) -> None:
    """DSI's rollback: the dropped positions leave the main sequence, the tree's leaves are freed."""
    free = len(runner._free)
    runner.forward([Step("t", [4, 8, 6, 9], [10, 11], [-1, 0])])
    runner.commit("t", [0, 1])
    runner.forward([Step("t", [12], [13, 14], [-1, -1])])
    runner.truncate("t", 3)
    assert runner.committed_tokens("t") == [4, 8, 6] and runner.pending_tokens("t") == []
    assert len(runner._free) == free - 1  # only the main sequence is left
    nxt = runner.forward([Step("t", [20], [21], [-1])])[0]
    assert torch.allclose(nxt, sequential(runner, [4, 8, 6, 20, 21])[-2:], atol=TOL)
    runner.release("t")


def test_sessions_in_one_call_equal_each_alone(runner) -> None:
    steps = [
        Step("a", [3, 4, 5], [10, 11, 12], [-1, 0, 0]),
        Step("b", [6], [13], [-1]),
        Step("c", [7, 8, 9, 10, 11, 12, 13], [], []),
    ]
    together = runner.forward(steps)
    for sid in ("a", "b", "c"):
        runner.release(sid)
    for st, out in zip(steps, together, strict=True):
        alone = runner.forward([Step("x" + st.session_id, st.new_tokens, st.node_tokens, st.node_parents)])[0]
        assert torch.allclose(out, alone, atol=TOL)


def test_eviction_and_rebuild_give_the_same_logits(gguf_path) -> None:
    runner = LlamaCppRunner(
        gguf_path, n_ctx=2048, n_seq_max=16, threads=1, max_cache_tokens=24, kv_type="f32"
    )
    try:
        runner.forward([Step("old", list(range(3, 19)), [30, 31], [-1, 0])])  # 18 cells
        out = runner.forward([Step("new", list(range(40, 50)))])  # 10 more: "old" is evicted
        assert runner.stats["evictions"] == 1 and runner.cached_positions() == 10
        again = runner.forward([Step("old", node_tokens=[32], node_parents=[1])])[0]  # re-fed in full
        assert runner.stats["rebuilds"] == 1
        ref = sequential(runner, [*range(3, 19), 30, 31, 32])[-1]
        assert torch.allclose(again[0], ref, atol=TOL)
        assert out[0].shape == (1, runner.vocab_size)
    finally:
        runner.close()


def test_bad_steps_change_nothing(runner) -> None:
    runner.forward([Step("s", [5, 6], [7], [-1])])
    with pytest.raises(ValueError, match="commit first"):
        runner.forward([Step("s", [8])])
    with pytest.raises(ValueError, match="out of range"):
        runner.forward([Step("s", node_tokens=[runner.vocab_size], node_parents=[0])])
    with pytest.raises(ValueError, match="not a root-to-node path"):
        runner.commit("s", [5])
    with pytest.raises(UnknownSessionError):
        runner.forward([Step("nobody", node_tokens=[5], node_parents=[-1])])
    assert runner.committed_tokens("s") == [5, 6] and runner.pending_tokens("s") == [7]


def test_same_weights_through_transformers_agree(gguf_path) -> None:
    """The GGUF carries tiny_lm's weights: llama.cpp and the torch backend compute the same."""
    torch.manual_seed(0)
    model = tiny_lm("llama", len(vocabulary(N_WORDS)), bos_token_id=1, eos_token_id=2)
    step = Step("t", [5, 9, 7, 300], [301, 302, 303], [-1, 0, 0])
    ours = LlamaCppRunner(gguf_path, n_ctx=512, n_seq_max=8, threads=1, kv_type="f32")
    try:
        a = ours.forward([step])[0]
    finally:
        ours.close()
    b = ModelRunner(model).forward([step])[0]
    assert torch.allclose(a, b, atol=1e-3), (a - b).abs().max()


# ---- the engine on the llama.cpp backend ---------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return save_tiny_gguf_pair(tmp_path_factory.mktemp("pair"), n_words=N_WORDS)


@pytest.fixture(scope="module")
def llama_engine(gguf_pair) -> SpeculativeEngine:
    draft = LlamaCppRunner(gguf_pair["draft"], n_ctx=4096, threads=1)
    target = LlamaCppRunner(gguf_pair["target"], n_ctx=4096, threads=1)
    return SpeculativeEngine(draft, target)


@pytest.mark.parametrize("method", list(SPECS))
def test_engine_greedy_equals_the_backends_own_greedy_decode(llama_engine, method: str) -> None:
    greedy = SamplingParams(temperature=0.0)
    reference = llama_engine.generate(PROMPT, SPECS["none"], greedy, max_new_tokens=24).token_ids
    result = llama_engine.generate(PROMPT, SPECS[method], greedy, max_new_tokens=24)
    assert result.token_ids == reference
    if method != "none":
        assert result.stats.accepted_tokens > 0 and result.stats.target_calls < 24
    assert llama_engine.drafter.sessions() == [] and llama_engine.verifier.sessions() == []


def test_engine_seeded_sampling_is_reproducible(llama_engine) -> None:
    params = SamplingParams(temperature=1.0, seed=7)
    runs = [llama_engine.generate(PROMPT, SPECS["rsd_s"], params, max_new_tokens=16) for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids


def test_load_model_picks_llama_cpp_for_a_gguf(gguf_pair) -> None:
    assert resolve_backend("auto", gguf_pair["target"]) == (
        Backend.TORCH if torch.cuda.is_available() else Backend.LLAMA_CPP
    )
    assert resolve_backend("torch", gguf_pair["target"]) == Backend.TORCH
    with pytest.raises(ValueError, match="runs GGUF files"):
        resolve_backend("llama.cpp", "some/folder")
    lm = load_model(gguf_pair["target"], backend="llama.cpp")
    assert lm.backend == Backend.LLAMA_CPP and lm.model is None and lm.source == str(gguf_pair["target"])
    assert lm.vocab_size == len(vocabulary(N_WORDS))
    runner = lm.open_runner(max_cache_tokens=1024)
    try:
        assert runner.vocab_size == lm.vocab_size
    finally:
        runner.close()


@pytest.mark.parametrize("method", ["chain", "mtad", "rsd_s"])
def test_torch_and_llama_cpp_decode_the_same_weights_alike(gguf_pair, method: str) -> None:
    """The GGUF pair holds tiny_pair's weights: both backends give the same tokens and acceptance."""
    draft, target = tiny_pair("llama", len(vocabulary(N_WORDS)), noise=0.005, bos_token_id=1, eos_token_id=2)
    runners = [LlamaCppRunner(gguf_pair[m], threads=1, kv_type="f32") for m in ("draft", "target")]
    greedy = SamplingParams(temperature=0.0)
    a = SpeculativeEngine(draft, target).generate(PROMPT, SPECS[method], greedy, max_new_tokens=24)
    b = SpeculativeEngine(*runners).generate(PROMPT, SPECS[method], greedy, max_new_tokens=24)
    assert a.token_ids == b.token_ids
    assert a.stats.accepted_tokens == b.stats.accepted_tokens > 0


def test_a_call_longer_than_one_decode_is_fed_in_parts(gguf_path) -> None:
    """A prompt of more tokens than n_batch (and a tree after it) still gives the same logits."""
    runner = LlamaCppRunner(gguf_path, n_ctx=1024, n_batch=16, n_seq_max=8, threads=1, kv_type="f32")
    try:
        prompt = [3 + (7 * i) % 300 for i in range(40)]
        out = runner.forward([Step("long", prompt, [10, 11, 12], [-1, 0, 0])])[0]
        ref = sequential(runner, [*prompt, 10, 11])
        assert torch.allclose(out[0], ref[-3], atol=TOL) and torch.allclose(out[2], ref[-1], atol=TOL)
        assert runner.stats["decodes"] > 3
    finally:
        runner.close()


def test_a_converted_gguf_is_a_bf16_folder_that_loads(gguf_path, tmp_path) -> None:
    """model_store.convert_gguf, what the torch backend runs the default pair from: bf16 weights
    (half of fp32), the tokenizer beside them, the GGUF's values rounded to bf16."""
    from safetensors import safe_open

    from specmesh.runtime import model_store

    out = tmp_path / "converted"
    model_store.convert_gguf(gguf_path, out)
    with safe_open(str(next(out.glob("*.safetensors"))), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}  # noqa: SIM118 (no __iter__)
    loaded = load_model(out, dtype="fp32", device="cpu")
    torch.manual_seed(0)
    original = tiny_lm("llama", len(vocabulary(N_WORDS)), bos_token_id=1, eos_token_id=2)
    for name, p in original.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], p.to(torch.bfloat16).float()), name


def test_a_gguf_replica_saves_its_tokenizer_for_gateways_without_torch(tmp_path) -> None:
    """transformers reads a GGUF's tokenizer only with torch: loading a GGUF saves it beside the
    file as a tokenizer folder, which the gateway's load_tokenizer then reads (same fingerprint and
    context length as the GGUF's own); a folder of another tokenizer is replaced."""
    from transformers import AutoTokenizer

    from specmesh.runtime.tokenizers import (
        _context_length,
        load_tokenizer,
        save_tokenizer_folder,
        tokenizer_fingerprint,
        tokenizer_folder,
    )

    gguf = save_tiny_gguf(tmp_path / "tiny.gguf", n_words=N_WORDS)
    folder = tokenizer_folder(gguf)
    own = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=gguf.name)
    stale = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=gguf.name)
    stale.add_tokens(["<another>"])
    assert save_tokenizer_folder(gguf, stale) == folder
    lm = load_model(gguf, backend="llama.cpp")
    assert folder.is_dir() and not [p for p in tmp_path.iterdir() if p.name.endswith((".tmp", ".stale"))]
    tokenizer, context = load_tokenizer(gguf)
    assert tokenizer_fingerprint(tokenizer) == lm.tokenizer_fingerprint == tokenizer_fingerprint(own)
    assert context == _context_length(str(tmp_path), {"gguf_file": gguf.name}) is not None
    assert tokenizer("w1 w2 w3")["input_ids"] == own("w1 w2 w3")["input_ids"]
