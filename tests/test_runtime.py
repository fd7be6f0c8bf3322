"""ModelRunner: batched tree attention over per-session KV caches, checked against plain model calls."""

from __future__ import annotations

import pytest
import torch

from specmesh.runtime.runner import ModelRunner, Step, UnknownSessionError
from tests.tiny import tiny_lm

TOL = 1e-4
VOCAB = 97

# depth 4, uneven fan-out (3, 2, 1, 0 children...), a repeated sibling token (iid sampling)
TREE_TOKENS = [5, 17, 5, 40, 41, 7, 60, 61, 62, 90]
TREE_PARENTS = [-1, -1, -1, 0, 0, 1, 3, 3, 4, 6]

MODELS = [("llama", "sdpa"), ("qwen2", "sdpa"), ("llama", "eager"), ("qwen2", "eager")]


def make_model(kind: str, attn: str) -> torch.nn.Module:
    # a wide init spreads the logits, so that a wrong mask or position shows clearly
    return tiny_lm(kind, VOCAB, initializer_range=0.2, attn_implementation=attn)


@pytest.fixture(params=MODELS, ids=lambda m: "-".join(m))
def model(request: pytest.FixtureRequest) -> torch.nn.Module:
    return make_model(*request.param)


@pytest.fixture(params=MODELS[:2], ids=lambda m: "-".join(m))
def sdpa_model(request: pytest.FixtureRequest) -> torch.nn.Module:
    return make_model(*request.param)


@torch.inference_mode()
def ref(model: torch.nn.Module, seq: list[int]) -> torch.Tensor:
    """Logits after `seq`, from one plain causal call without any cache."""
    return model(torch.tensor([seq])).logits[0, -1].float()


def path(tokens: list[int], parents: list[int], node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(tokens[node])
        node = parents[node]
    return out[::-1]


def tree_ref(
    model: torch.nn.Module, prefix: list[int], tokens: list[int], parents: list[int]
) -> torch.Tensor:
    """[1 + N, V]: the root row, then every node's row from its root-to-node path."""
    rows = [ref(model, prefix)] + [ref(model, prefix + path(tokens, parents, i)) for i in range(len(tokens))]
    return torch.stack(rows)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def levels(parents: list[int]) -> list[list[int]]:
    depth: list[int] = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return [[i for i, d in enumerate(depth) if d == lv] for lv in range(1, max(depth) + 1)]


def assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    diff = (a - b).abs().max().item()
    assert diff <= TOL, f"max |diff| {diff}"


def test_tree_matches_sequential_paths(model: torch.nn.Module) -> None:
    prefix = prompt(11, 1)
    expected = tree_ref(model, prefix, TREE_TOKENS, TREE_PARENTS)
    # the check is sensitive: different paths give clearly different logits
    assert (expected[4] - expected[5]).abs().max() > 1e-2
    runner = ModelRunner(model)
    (out,) = runner.forward([Step("s", prefix, TREE_TOKENS, TREE_PARENTS)])
    assert out.dtype == torch.float32
    assert_close(out, expected)
    # the same tree on an already cached prefix (no new tokens: no root row)
    runner.forward([Step("t", prefix)])
    (out,) = runner.forward([Step("t", [], TREE_TOKENS, TREE_PARENTS)])
    assert_close(out, expected[1:])


def test_tree_level_by_level(model: torch.nn.Module) -> None:
    prefix = prompt(9, 2)
    expected = tree_ref(model, prefix, TREE_TOKENS, TREE_PARENTS)
    runner = ModelRunner(model)
    (root,) = runner.forward([Step("s", prefix)])
    assert_close(root, expected[:1])
    for level in levels(TREE_PARENTS):
        step = Step("s", [], [TREE_TOKENS[i] for i in level], [TREE_PARENTS[i] for i in level])
        (out,) = runner.forward([step])
        assert_close(out, expected[[i + 1 for i in level]])
    assert runner.pending_tokens("s") == TREE_TOKENS
    assert runner.cache_length("s") == len(prefix)


@pytest.mark.parametrize("keep", [[0, 3, 6, 9], [1, 5], [2], [], [0, 4, 8]])
def test_commit_then_continue(sdpa_model: torch.nn.Module, keep: list[int]) -> None:
    prefix = prompt(8, 3)
    runner = ModelRunner(sdpa_model)
    runner.forward([Step("s", prefix, TREE_TOKENS, TREE_PARENTS)])
    runner.commit("s", keep)
    committed = prefix + [TREE_TOKENS[i] for i in keep]
    assert runner.committed_tokens("s") == committed
    assert runner.cache_length("s") == len(committed)
    assert runner.pending_tokens("s") == []
    bonus = [33]
    tokens, parents = [3, 4, 70, 71, 72], [-1, -1, 0, 0, 2]
    (out,) = runner.forward([Step("s", bonus, tokens, parents)])
    assert_close(out, tree_ref(sdpa_model, committed + bonus, tokens, parents))
    # a second commit and plain decoding on top
    runner.commit("s", [0, 2, 4])
    committed += [*bonus, 3, 70, 72]
    (out,) = runner.forward([Step("s", [11])])
    assert_close(out, ref(sdpa_model, [*committed, 11])[None])


def test_truncate_then_continue(sdpa_model: torch.nn.Module) -> None:
    """DSI's rollback: speculation committed and then thrown away leaves no trace."""
    prefix = prompt(8, 5)
    runner = ModelRunner(sdpa_model)
    runner.forward([Step("s", prefix, [40, 41, 42], [-1, 0, 1])])
    runner.commit("s", [0, 1])
    runner.forward([Step("s", [43], [44], [-1])])  # a pending tree, thrown away too
    runner.truncate("s", 6)
    assert runner.committed_tokens("s") == prefix[:6] and runner.pending_tokens("s") == []
    (out,) = runner.forward([Step("s", [50, 51], [52], [-1])])
    assert_close(out, tree_ref(sdpa_model, [*prefix[:6], 50, 51], [52], [-1]))
    for bad in (0, 9):
        with pytest.raises(ValueError, match="length"):
            runner.truncate("s", bad)


def test_commit_chain_prefix(sdpa_model: torch.nn.Module) -> None:
    """A chain accepted from its first node keeps the KV where it is (no compaction copy)."""
    prefix = prompt(6, 4)
    chain = [8, 9, 10, 11]
    runner = ModelRunner(sdpa_model)
    runner.forward([Step("s", prefix, chain, [-1, 0, 1, 2])])
    runner.commit("s", [0, 1])
    (out,) = runner.forward([Step("s", [50], [51], [-1])])
    assert_close(out, tree_ref(sdpa_model, [*prefix, 8, 9, 50], [51], [-1]))


def _history(runner: ModelRunner) -> None:
    """Bring sessions a..d into different states: long/short caches, a pending tree level."""
    runner.forward([Step("a", prompt(23, 10))])
    runner.forward([Step("a", [], [1, 2], [-1, -1])])
    runner.commit("a", [1])
    runner.forward([Step("c", prompt(4, 11))])
    runner.forward([Step("d", prompt(15, 12), [7, 8, 9], [-1, -1, 0])])


def test_batched_sessions_equal_alone(model: torch.nn.Module) -> None:
    steps = [
        Step("a", [44], TREE_TOKENS, TREE_PARENTS),  # long cache, full tree
        Step("b", prompt(6, 13), [3, 3, 4], [-1, -1, 0]),  # new session: prefill + small tree
        Step("c", [5, 6, 7]),  # only new tokens
        Step("d", [], [20, 21, 22], [1, 2, 2]),  # next level of a pending tree
    ]
    batched, alone = ModelRunner(model), ModelRunner(model)
    _history(batched)
    _history(alone)
    outs = batched.forward(steps)
    assert batched.stats["batch_sizes"][4] == 1
    for step, out in zip(steps, outs, strict=True):
        (single,) = alone.forward([step])
        assert out.shape[0] == (1 if step.new_tokens else 0) + len(step.node_tokens)
        assert_close(out, single)
    # and against scratch for the tree sessions
    a_prefix = [*prompt(23, 10), 2, 44]
    assert_close(outs[0], tree_ref(model, a_prefix, TREE_TOKENS, TREE_PARENTS))
    d_tokens, d_parents = [7, 8, 9, 20, 21, 22], [-1, -1, 0, 1, 2, 2]
    assert_close(outs[3], tree_ref(model, prompt(15, 12), d_tokens, d_parents)[4:])
    # the KV split back per session stays right: continue every session batched again
    for sid, keep in (("a", [0, 3]), ("b", [0, 2]), ("d", [0, 2, 5])):
        batched.commit(sid, keep)
    outs = batched.forward([Step(sid, [9], [1, 2], [-1, 0]) for sid in "abcd"])
    for sid, out in zip("abcd", outs, strict=True):
        assert_close(out, tree_ref(model, batched.committed_tokens(sid), [1, 2], [-1, 0]))


def test_eviction_and_rebuild(sdpa_model: torch.nn.Module) -> None:
    free, tight = ModelRunner(sdpa_model), ModelRunner(sdpa_model, max_cache_tokens=40)
    for runner in (free, tight):
        runner.forward([Step("a", prompt(20, 20))])
        runner.forward([Step("b", prompt(12, 21), [1, 2], [-1, -1])])  # pending tree
        runner.forward([Step("c", prompt(15, 22))])  # 20 + 14 + 15 > 40: evicts a
    assert tight.stats["evictions"] == 1
    assert tight.cache_length("a") == 0 and tight.committed_tokens("a") == prompt(20, 20)
    assert tight.cached_positions() <= 40
    # a is rebuilt (and b evicted to make room); b's pending tree is rebuilt on its next level
    for sid, step in (("a", Step("a", [3], [4, 5], [-1, 0])), ("b", Step("b", [], [6, 7], [0, 1]))):
        assert_close(tight.forward([step])[0], free.forward([step])[0])
        assert tight.cache_length(sid) > 0
    assert tight.stats["rebuilds"] == 2 and tight.stats["evictions"] >= 2
    assert free.stats["evictions"] == 0 and free.stats["rebuilds"] == 0
    assert tight.cached_positions() <= 40
    expected = tree_ref(sdpa_model, prompt(12, 21), [1, 2, 6, 7, 8], [-1, -1, 0, 1, 2])
    assert_close(tight.forward([Step("b", [], [8], [2])])[0], expected[5:])
    tight.commit("b", [1, 3])
    (out,) = tight.forward([Step("b", [9])])
    assert_close(out, ref(sdpa_model, [*prompt(12, 21), 2, 7, 9])[None])


def test_errors_leave_state_untouched(sdpa_model: torch.nn.Module) -> None:
    runner = ModelRunner(sdpa_model)
    runner.forward([Step("s", [1, 2, 3], [4], [-1])])
    with pytest.raises(ValueError, match="pending"):
        runner.forward([Step("s", [5])])
    with pytest.raises(ValueError, match="parent"):
        runner.forward([Step("s", [], [6], [1])])  # only node 0 is pending
    with pytest.raises(ValueError, match="parent"):
        runner.forward([Step("s", [], [6, 7], [-1, 2])])  # a node cannot be its own parent
    with pytest.raises(ValueError, match="parent"):
        runner.forward([Step("s", [], [6], [-2])])
    with pytest.raises(ValueError, match="token"):
        runner.forward([Step("s", [], [VOCAB], [-1])])
    with pytest.raises(ValueError, match="once"):
        runner.forward([Step("s", [], [6], [0]), Step("s", [], [7], [0])])
    with pytest.raises(UnknownSessionError):
        runner.forward([Step("nobody", [], [1], [-1])])
    with pytest.raises(ValueError, match="path"):
        runner.commit("s", [0, 0])
    # a bad step in a batch rejects the whole batch before anything changes
    with pytest.raises(ValueError):
        runner.forward([Step("new", [1, 2]), Step("s", [9])])
    assert runner.sessions() == ["s"]
    assert runner.committed_tokens("s") == [1, 2, 3] and runner.pending_tokens("s") == [4]
    assert runner.stats["forwards"] == 1
    (out,) = runner.forward([Step("s", [], [6], [0])])
    assert_close(out, ref(sdpa_model, [1, 2, 3, 4, 6])[None])
    runner.release("s")
    assert runner.committed_tokens("s") is None and runner.cache_length("s") == 0
    assert runner.sessions() == []


def test_empty_step_returns_no_rows(sdpa_model: torch.nn.Module) -> None:
    runner = ModelRunner(sdpa_model)
    runner.forward([Step("s", [1, 2])])
    outs = runner.forward([Step("s"), Step("t", [3])])
    assert outs[0].shape == (0, VOCAB) and outs[1].shape == (1, VOCAB)
    assert runner.stats["batch_sizes"][1] == 2  # the empty step did not join the model call


def test_failed_call_keeps_sessions_consistent(sdpa_model: torch.nn.Module) -> None:
    runner = ModelRunner(sdpa_model, max_cache_tokens=10)
    runner.forward([Step("a", [1, 2, 3, 4, 5, 6])])
    runner.forward([Step("b", [7, 8, 9, 10, 11, 12])])  # evicts a
    assert runner.cache_length("a") == 0

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("device lost")

    runner._decoder = broken  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="device lost"):
        runner.forward([Step("a", [13])])
    assert runner.cache_length("a") == 0 and runner.committed_tokens("a") == [1, 2, 3, 4, 5, 6]
    runner._decoder = sdpa_model.get_decoder()
    (out,) = runner.forward([Step("a", [13])])
    assert_close(out, ref(sdpa_model, [1, 2, 3, 4, 5, 6, 13])[None])
    assert runner.stats["rebuilds"] == 1
