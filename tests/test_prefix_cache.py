"""Prefixes kept across requests: the chained block hashes and their index (specmesh.core.prefix),
and both model backends starting sessions from a kept or shared prefix (specmesh.runtime.backend).

The reference for a session started from a prefix is the same session fed from nothing, on a
runner without the cache: its logits must agree (torch: to float rounding; llama.cpp: f32 KV), and
so must the greedy tokens decoded from them."""

from __future__ import annotations

import pytest
import torch

from specmesh.core.prefix import BLOCK_TOKENS, ROUTE_EVERY, PrefixIndex, chain_hashes, route_hashes
from specmesh.runtime.backend import KEPT_PREFIX, MAX_KEPT, Step
from specmesh.runtime.llama_cpp import LlamaCppRunner
from specmesh.runtime.runner import ModelRunner
from tests.test_llama_cpp import N_WORDS
from tests.tiny import tiny_lm
from tests.tiny_gguf import save_tiny_gguf

TOL = 1e-4
VOCAB = 97


# ---- hashes and the index ------------------------------------------------------------------------


def test_chained_hashes_name_the_whole_prefix_and_follow_the_salt() -> None:
    a = list(range(3, 3 + 3 * BLOCK_TOKENS + 5))
    h = chain_hashes(a)
    assert len(h) == 3  # full blocks only
    assert chain_hashes(a) == h  # stable
    b = [99, *a[1:]]  # the first token differs: every block's hash does
    assert all(x != y for x, y in zip(chain_hashes(b), h, strict=True))
    assert chain_hashes(a[: 2 * BLOCK_TOKENS]) == h[:2]
    assert chain_hashes(a, start=1, previous=h[0]) == h[1:]  # extended from the last hash
    assert not set(chain_hashes(a, salt=b"tenant")) & set(h)


def test_the_index_finds_the_longest_prefix_by_blocks_then_tokens() -> None:
    index = PrefixIndex()
    held = list(range(5, 5 + 2 * BLOCK_TOKENS + 6))
    index.update("a", held)
    query = [*held[: 2 * BLOCK_TOKENS + 3], 1, 1, 1]
    m = index.match(query)
    assert m is not None and (m.owner, m.length) == ("a", 2 * BLOCK_TOKENS + 3)
    assert index.match(query, limit=BLOCK_TOKENS + 2).length == BLOCK_TOKENS + 2
    assert index.match(query, exclude="a") is None
    assert index.match(query, salt=b"other") is None  # another tenant's blocks are not found
    assert index.match([1, *query[1:]]) is None  # the first block differs
    assert index.match(query[: BLOCK_TOKENS - 1]) is None  # not one full block


def test_the_index_follows_an_owner_cut_back_renamed_and_removed() -> None:
    index = PrefixIndex()
    tokens = list(range(10, 10 + 3 * BLOCK_TOKENS))
    index.update("a", tokens)
    tokens = tokens[: BLOCK_TOKENS + 4] + [7] * 40  # rolled back, then other tokens
    index.update("a", tokens)
    old = list(range(10, 10 + 3 * BLOCK_TOKENS))
    assert index.match(old).length == BLOCK_TOKENS + 4
    assert index.match(tokens).length == len(tokens)
    index.rename("a", "b")
    assert index.match(tokens).owner == "b"
    index.remove("b")
    assert index.match(tokens) is None


def test_the_summary_names_every_fourth_block_and_its_version_moves_with_it() -> None:
    index = PrefixIndex()
    tokens = list(range(3, 3 + 2 * ROUTE_EVERY * BLOCK_TOKENS))
    index.update("a", tokens[: ROUTE_EVERY * BLOCK_TOKENS - 1])
    assert index.summary() == [] and index.version == 0
    index.update("a", tokens)
    assert sorted(index.summary()) == sorted(route_hashes(chain_hashes(tokens)))
    v = index.version
    index.update("b", tokens)  # a second owner of the same blocks: the summary is the same
    assert index.version == v
    index.remove("a")
    assert index.version == v and len(index.summary()) == 2
    index.remove("b")
    assert index.summary() == [] and index.version > v


# ---- the backends --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory: pytest.TempPathFactory):
    return save_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", n_words=N_WORDS)


def torch_runner(**kw) -> ModelRunner:
    model = tiny_lm("llama", VOCAB, initializer_range=0.2, max_position_embeddings=512)
    return ModelRunner(model, **kw)


def llama_runner(path, **kw) -> LlamaCppRunner:
    return LlamaCppRunner(path, n_ctx=2048, n_seq_max=32, threads=1, kv_type="f32", **kw)


@pytest.fixture(params=["torch", "llama.cpp"])
def make(request, gguf_path):
    made = []

    def make_runner(cache: bool = True, max_kept: int = MAX_KEPT, **kw):
        r = torch_runner(**kw) if request.param == "torch" else llama_runner(gguf_path, **kw)
        if cache:
            r.enable_prefix_cache(max_kept)
        made.append(r)
        return r

    yield make_runner
    for r in made:
        if hasattr(r, "close"):
            r.close()


def tokens_for(runner, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, runner.vocab_size, (n,), generator=g).tolist()


def greedy(runner, sid: str, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """n greedy tokens after `prompt` and the first row's logits."""
    first = runner.forward([Step(sid, new_tokens=prompt)])[0][-1]
    out, row = [], first
    for _ in range(n):
        out.append(int(row.argmax()))
        row = runner.forward([Step(sid, new_tokens=[out[-1]])])[0][-1]
    return out, first


def assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    diff = (a - b).abs().max().item()
    assert diff <= TOL, f"max |diff| {diff}"


def test_a_released_session_is_kept_and_a_later_one_starts_from_it(make) -> None:
    runner, plain = make(), make(cache=False)
    system = tokens_for(runner, 3 * BLOCK_TOKENS + 5, 1)
    turn1, _ = greedy(runner, "t1", system, 6)
    runner.release("t1")
    assert runner.kept_prefixes() == 1
    # turn 2 of the conversation: everything turn 1 held, then new tokens
    turn2 = system + turn1[:-1] + tokens_for(runner, 9, 2)  # the last token emitted was never fed
    got, first = greedy(runner, "t2", turn2, 8)
    assert runner.reused_tokens("t2") == len(system) + len(turn1) - 1
    want, ref = greedy(plain, "ref", turn2, 8)
    assert_close(first, ref)
    assert got == want
    assert runner.stats["prefix_hits"] == len(system) + len(turn1) - 1


def test_a_live_sessions_committed_prefix_is_shared(make) -> None:
    runner, plain = make(max_kept=0), make(cache=False)
    system = tokens_for(runner, 2 * BLOCK_TOKENS + 3, 3)
    runner.forward([Step("a", new_tokens=system)])
    other = system + tokens_for(runner, 5, 4)
    first = runner.forward([Step("b", new_tokens=other)])[0][-1]
    assert runner.reused_tokens("b") == len(system)
    assert_close(first, plain.forward([Step("ref", new_tokens=other)])[0][-1])
    # a goes on and is cut back; b's shared prefix is b's own KV all the same
    runner.forward([Step("a", new_tokens=[7, 8, 9])])
    runner.truncate("a", 5)
    runner.release("a")
    assert runner.kept_prefixes() == 0  # max_kept 0: nothing is kept
    nxt = runner.forward([Step("b", new_tokens=[11])])[0][-1]
    assert_close(nxt, plain.forward([Step("ref", new_tokens=[11])])[0][-1])


def test_a_tenant_never_starts_from_another_tenants_prefix(make) -> None:
    runner = make()
    prompt = tokens_for(runner, 3 * BLOCK_TOKENS, 5)
    runner.forward([Step("a", new_tokens=prompt, salt=b"tenant-a")])
    runner.release("a")
    runner.forward([Step("b", new_tokens=[*prompt, 4], salt=b"tenant-b")])
    assert runner.reused_tokens("b") == 0
    runner.forward([Step("c", new_tokens=[*prompt, 4], salt=b"tenant-a")])
    assert runner.reused_tokens("c") == len(prompt)


def test_a_limited_step_feeds_a_chunk_at_a_time_then_runs_whole(make) -> None:
    """Chunked prefill: past its limit a step is partial (a chunk of its new tokens, no nodes, no
    rows); within it, whole. The row after the prompt fed in chunks is the row fed at once."""
    runner, plain = make(), make(cache=False)
    prompt = tokens_for(runner, 70, 6)
    fed = 0
    while True:
        out = runner.forward(
            [Step("s", new_tokens=prompt[fed:], node_tokens=[5], node_parents=[-1], feed_limit=16)]
        )
        if out[0].shape[0]:  # whole: the root row and its node's
            break
        assert runner.committed_length("s") == fed + 16 and runner.pending_tokens("s") == []
        fed += 16
    assert fed == 64 and out[0].shape[0] == 2 and runner.committed_length("s") == 70
    ref = plain.forward([Step("ref", new_tokens=prompt, node_tokens=[5], node_parents=[-1])])[0]
    assert_close(out[0], ref)


def test_a_prefill_restarted_from_nothing_takes_what_it_fed_back(make) -> None:
    """A retry at position 0 after a failed chunk: the released session's KV is kept, so the
    restart feeds only what no chunk had fed."""
    runner = make()
    prompt = tokens_for(runner, 80, 7)
    runner.forward([Step("s", new_tokens=prompt, feed_limit=48)])
    runner.release("s")  # a restart (Resume.RESTART) releases the session first
    runner.forward([Step("s", new_tokens=prompt, feed_limit=16)])
    assert runner.reused_tokens("s") == 48
    assert runner.committed_length("s") == 64


def test_kept_prefixes_go_before_idle_sessions_least_recently_used_first(make) -> None:
    runner = make(max_cache_tokens=200)
    a, b = tokens_for(runner, 64, 8), tokens_for(runner, 64, 9)
    runner.forward([Step("live", new_tokens=tokens_for(runner, 40, 10))])
    for sid, toks in (("a", a), ("b", b)):
        runner.forward([Step(sid, new_tokens=toks)])
        runner.release(sid)
    assert runner.kept_prefixes() == 2 and runner.cached_positions() == 168
    runner.forward([Step("new", new_tokens=tokens_for(runner, 60, 11))])  # 228 > 200: a goes
    assert runner.kept_prefixes() == 1 and runner.stats["evictions"] == 0
    runner.forward([Step("c", new_tokens=[*a, 5])])
    assert runner.reused_tokens("c") == 0  # a's prefix was the one that went
    # 229 > 200: b's prefix goes too, though the live session was used less recently
    assert runner.kept_prefixes() == 0 and runner.stats["kept_evictions"] == 2
    assert runner.cached_positions() == 165 and runner.stats["evictions"] == 0
    runner.forward([Step("d", new_tokens=b[:40])])  # 205: now an idle session's KV goes
    assert runner.reused_tokens("d") == 0 and runner.stats["evictions"] == 1


def test_a_conversations_turns_keep_one_prefix_and_count_shared_cells_once(make) -> None:
    runner = make()
    turn = tokens_for(runner, 2 * BLOCK_TOKENS, 12)
    runner.forward([Step("t1", new_tokens=turn)])
    runner.release("t1")
    before = runner.cached_positions()
    longer = turn + tokens_for(runner, 20, 13)
    runner.forward([Step("t2", new_tokens=longer)])
    assert runner.reused_tokens("t2") == len(turn)
    if isinstance(runner, LlamaCppRunner):  # the cells are shared: the new turn adds its own only
        assert runner.cached_positions() == before + 20
    runner.release("t2")
    assert runner.kept_prefixes() == 1  # turn 1's prefix is turn 2's beginning: only turn 2's stays
    runner.forward([Step("t3", new_tokens=[*longer, 3])])
    assert runner.reused_tokens("t3") == len(longer)


def test_a_release_without_keep_and_a_short_session_leave_nothing(make) -> None:
    runner = make()
    runner.forward([Step("a", new_tokens=tokens_for(runner, 40, 14))])
    runner.release("a", keep=False)
    runner.forward([Step("b", new_tokens=tokens_for(runner, BLOCK_TOKENS - 1, 15))])
    runner.release("b")
    assert runner.kept_prefixes() == 0 and runner.cached_positions() == 0


def test_the_summary_follows_what_is_held(make) -> None:
    runner = make()
    tokens = tokens_for(runner, ROUTE_EVERY * BLOCK_TOKENS + 3, 16)
    runner.forward([Step("a", new_tokens=tokens)])
    v, hashes = runner.prefix_summary()
    assert hashes == route_hashes(chain_hashes(tokens))
    runner.release("a")
    assert runner.prefix_summary() == (v, hashes)  # kept: still held
    runner.enable_prefix_cache(max_kept=0)
    v2, hashes = runner.prefix_summary()
    assert hashes == [] and v2 > v
    assert not any(k.startswith(KEPT_PREFIX) for k in runner.sessions())
