"""Grammar masks on their own (specmesh.runtime.grammar with real llguidance, and the model-free side
in specmesh.core.grammar): the allowed set after the committed tokens and after each path of a draft
tree, a matcher kept in step with committed tokens that were rolled back, tokens outside the grammar,
one matcher per session, and the errors for a grammar or tokenizer that cannot be used.

The tokenizer is the local one-token-per-byte BPE (token id = byte, then the specials), so every
allowed set below is spelt as the characters it holds; nothing touches a model hub.
"""

from __future__ import annotations

import math

import pytest
import torch
from llguidance import LLMatcher

from specmesh.bench.tiny import BYTE_VOCAB, make_byte_tokenizer, make_tokenizer
from specmesh.core.grammar import Grammar, constrain_draft, constrain_rows, mask_logits, tree_paths
from specmesh.rpc.wire import MAX_GRAMMAR_BYTES, WireError, grammar_from_proto, grammar_to_proto
from specmesh.runtime.grammar import GrammarMasks, SessionGrammars

TOKENIZER = make_byte_tokenizer()
EOS = TOKENIZER.eos_token_id
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},  # else whitespace is allowed almost everywhere
}
JSON = Grammar(LLMatcher.grammar_from_json_schema(SCHEMA), start=3)
DIGITS = Grammar(LLMatcher.grammar_from_regex(r"[0-9]+"), start=0)  # may go on or stop after a digit


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def spelt(row: torch.Tensor) -> str:
    """An allowed row as its characters ("<eos>" for the end-of-sequence token), or "ALL"."""
    if bool(row.all()):
        return "ALL"
    return "".join("<eos>" if i == EOS else TOKENIZER.decode([i]) for i in row.nonzero().flatten().tolist())


def path(text: str) -> tuple[int, ...]:
    return tuple(ids(text))


def root(masks: GrammarMasks, committed: list[int]) -> str:
    return spelt(masks.allowed(committed, [()])[0])


def test_the_byte_tokenizer_spells_each_byte_as_its_own_token() -> None:
    # the helpers above rely on it: token id = byte
    assert ids('{"ok":t') == [123, 34, 111, 107, 34, 58, 116] and EOS == 258


def test_allowed_after_committed_tokens_follows_a_json_schema() -> None:
    masks = GrammarMasks(JSON, TOKENIZER, BYTE_VOCAB)
    assert root(masks, []) == "{"
    assert root(masks, ids('{"ok":')) == "ft"
    assert root(masks, ids('{"ok":tru')) == "e"
    assert root(masks, ids('{"ok":false}')) == "<eos>"  # a finished object allows only the end


def test_allowed_after_committed_tokens_follows_a_regex() -> None:
    masks = GrammarMasks(DIGITS, TOKENIZER, BYTE_VOCAB)
    assert root(masks, []) == "0123456789"  # at least one digit: no end yet
    assert root(masks, ids("42")) == "0123456789<eos>"
    assert root(masks, [*ids("42"), EOS]) == "<eos>"  # stopped: nothing but the end


def test_each_tree_row_is_masked_after_its_own_path_only() -> None:
    # committed '{"ok":', siblings t and f, each with one child: row k is after paths[k] alone
    masks = GrammarMasks(JSON, TOKENIZER, BYTE_VOCAB)
    committed = ids('{"ok":')
    paths = tree_paths([-1, -1, 0, 1], ids("tfra"))
    assert paths == [(), (116,), (102,), (116, 114), (102, 97)]
    rows = masks.allowed(committed, paths)
    assert [spelt(r) for r in rows] == ["ft", "r", "a", "u", "l"]
    # the same rows in any order: a sibling's tokens never leak into the next path
    assert [spelt(r) for r in masks.allowed(committed, paths[::-1])] == ["l", "u", "a", "r", "ft"]
    assert masks.consumed == committed  # paths are rolled back, the committed state stays


def test_a_path_outside_the_grammar_gets_an_all_true_row() -> None:
    # its node is never accepted, so its row is never read; its in-grammar prefix keeps its mask
    masks = GrammarMasks(JSON, TOKENIZER, BYTE_VOCAB)
    committed = ids('{"ok":')
    rows = masks.allowed(committed, [(), path("x"), path("t"), path("tx"), path("trx")])
    assert [spelt(r) for r in rows] == ["ft", "ALL", "r", "ALL", "ALL"]
    assert masks.consumed == committed and root(masks, committed) == "ft"


def test_a_path_past_the_end_gets_an_all_true_row() -> None:
    masks = GrammarMasks(DIGITS, TOKENIZER, BYTE_VOCAB)
    rows = masks.allowed(ids("4"), [(EOS,), (EOS, *path("2")), (*path("2"), EOS)])
    assert [spelt(r) for r in rows] == ["<eos>", "ALL", "<eos>"]


def test_a_committed_token_outside_the_grammar_is_not_followed() -> None:
    # consumed (what the matcher followed) stops before it; the mask is the state before it
    masks = GrammarMasks(JSON, TOKENIZER, BYTE_VOCAB)
    assert root(masks, ids('{"ok":x')) == "ft"
    assert masks.consumed == ids('{"ok":')
    assert root(masks, ids('{"ok":xtrue')) == "ft"  # nor anything after it
    assert masks.consumed == ids('{"ok":')


def test_syncing_to_rolled_back_committed_tokens_rederives_the_state() -> None:
    # one matcher walked back and forth must answer as a fresh matcher on each committed list
    masks = GrammarMasks(JSON, TOKENIZER, BYTE_VOCAB)
    history = ['{"ok":t', '{"ok":f', '{"ok":fal', '{"ok":', '{"ok":true}', '{"ok":fa', "", '{"ok":tr']
    for text in history:
        got = root(masks, ids(text))
        assert got == root(GrammarMasks(JSON, TOKENIZER, BYTE_VOCAB), ids(text)), text
        assert masks.consumed == ids(text)
    assert got == "u"


def test_a_stop_that_was_rolled_back_is_undone() -> None:
    masks = GrammarMasks(DIGITS, TOKENIZER, BYTE_VOCAB)
    assert root(masks, [*ids("4"), EOS]) == "<eos>"
    assert masks.consumed == [*ids("4"), EOS]
    assert root(masks, ids("45")) == "0123456789<eos>"  # the end replaced by a digit: going on again
    assert masks.consumed == ids("45")


def test_sessions_keep_independent_matchers() -> None:
    grammars = SessionGrammars(TOKENIZER, BYTE_VOCAB)
    a, b = grammars.get("a", JSON), grammars.get("b", JSON)
    assert a is not b
    assert root(a, ids('{"ok":t')) == "r"
    assert root(b, []) == "{" and b.consumed == []  # a's tokens did not move b
    assert grammars.get("a", JSON) is a and a.consumed == ids('{"ok":t')  # kept between calls
    assert root(grammars.get("c", DIGITS), ids("7")) == "0123456789<eos>"  # its own grammar


def test_a_changed_grammar_or_a_dropped_session_gets_a_fresh_matcher() -> None:
    grammars = SessionGrammars(TOKENIZER, BYTE_VOCAB)
    a = grammars.get("a", JSON)
    root(a, ids("{"))
    moved = grammars.get("a", Grammar(JSON.text, start=JSON.start + 1))  # same text, new start
    assert moved is not a and moved.consumed == []
    assert grammars.get("a", DIGITS).grammar == DIGITS
    grammars.drop("a")
    grammars.drop("never-opened")  # dropping an unknown session is no error
    assert grammars.get("a", DIGITS).consumed == []


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (LLMatcher.grammar_from_regex("[a-"), "unclosed character class"),  # compiled, never validated
        ('{"grammars": []}', "empty grammars array"),
        ("not a grammar", "Expected token"),
    ],
)
def test_a_grammar_that_does_not_compile_is_a_grammar_error(text: str, problem: str) -> None:
    # "grammar: " is what the replicas turn into the field grammar.text (model_service.grammar_masks)
    with pytest.raises(ValueError, match=r"^grammar: ") as error:
        GrammarMasks(Grammar(text, 0), TOKENIZER, BYTE_VOCAB)
    assert problem in str(error.value)


def test_a_tokenizer_without_byte_decoding_is_a_grammar_error() -> None:
    words = make_tokenizer()  # word-level: llguidance cannot spell its tokens as bytes
    with pytest.raises(ValueError, match=r"^grammar: llguidance cannot use this model's tokenizer"):
        GrammarMasks(JSON, words, len(words))


def test_the_wire_names_grammar_text_for_an_oversized_grammar() -> None:
    assert grammar_from_proto(grammar_to_proto(JSON)) == JSON
    assert grammar_from_proto(grammar_to_proto(Grammar("", 5))) is None  # no text: unconstrained
    with pytest.raises(WireError) as error:
        grammar_from_proto(grammar_to_proto(Grammar("x" * (MAX_GRAMMAR_BYTES + 1), 0)))
    assert error.value.field == "grammar.text"


# --- the model-free side (specmesh.core.grammar) -------------------------------------------------


def test_tree_paths_gives_the_root_then_each_node_path_in_row_order() -> None:
    # parents -1, 0, 0, 2: two siblings under node 0, a grandchild under node 2
    assert tree_paths([-1, 0, 0, 2], [5, 6, 7, 8]) == [(), (5,), (5, 6), (5, 7), (5, 7, 8)]
    assert tree_paths([], []) == [()]


def test_mask_logits_sets_disallowed_to_minus_inf_and_leaves_an_empty_row() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    allowed = torch.tensor([[True, False, True], [False, False, False]])
    out = mask_logits(logits, allowed)
    assert out[0].tolist() == [1.0, -math.inf, 3.0]
    assert out[1].tolist() == [4.0, 5.0, 6.0]  # nothing allowed: unconstrained rather than empty
    assert logits[0, 1] == 2.0  # the input is not changed in place


def test_constrain_rows_and_draft_mask_each_row_with_the_real_matcher() -> None:
    masks = GrammarMasks(JSON, TOKENIZER, BYTE_VOCAB)
    committed = ids('{"ok":')
    paths = tree_paths([-1, -1], ids("tf"))
    logits = torch.zeros(len(paths), BYTE_VOCAB)
    finite = [spelt(row.isfinite()) for row in constrain_rows(logits, masks, committed, paths)]
    assert finite == ["ft", "r", "a"]
    asked: list[list] = []
    draft = constrain_draft(lambda p: asked.append(p) or torch.zeros(len(p), BYTE_VOCAB), masks, committed)
    assert [spelt(row.isfinite()) for row in draft(paths[1:])] == ["r", "a"]
    assert asked == [paths[1:]]  # the draft's own logits were asked for the same paths
