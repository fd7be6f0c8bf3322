"""The broad copy set (specmesh/bench/copy_set.py): 32 prompts, 8 kinds of 4, deterministic, split
into a tuning half and a held-out half, each prompt holding what its answer must copy."""

from __future__ import annotations

import ast
import collections
import csv
import io
import json
import os
import re
import subprocess
import sys
import tokenize

import pytest

from specmesh.bench.copy_set import KINDS, CopyPrompt, copy_prompts, copy_set, function_source, passage

ALL = copy_set("all")
TUNING = copy_set("tuning")
HELD_OUT = copy_set("held-out")


def _by_kind(prompts: list[CopyPrompt]) -> dict[str, list[CopyPrompt]]:
    out: dict[str, list[CopyPrompt]] = collections.defaultdict(list)
    for p in prompts:
        out[p.kind].append(p)
    return out


def test_the_set_is_8_kinds_of_4_prompts() -> None:
    assert len(ALL) == 32 and len(KINDS) == 8
    assert collections.Counter(p.kind for p in ALL) == {kind: 4 for kind in KINDS}
    assert len({p.message for p in ALL}) == 32  # no prompt twice


def test_the_set_is_the_same_in_every_call_and_every_process() -> None:
    assert copy_set("all") == ALL and copy_prompts(32) == [p.message for p in ALL]
    assert not [p.source for p in ALL if re.search(r" at 0x[0-9a-f]+", p.message)]  # no object address
    code = (
        "import json; from specmesh.bench.copy_set import copy_prompts; print(json.dumps(copy_prompts(32)))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # another order for sets and dicts of strings
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == [p.message for p in ALL]


def test_the_halves_are_disjoint_and_make_the_whole_set() -> None:
    tuning, held = {p.message for p in TUNING}, {p.message for p in HELD_OUT}
    assert len(TUNING) == len(HELD_OUT) == 16
    assert not tuning & held
    assert tuning | held == {p.message for p in ALL}


def test_the_held_out_half_is_each_kind_s_odd_prompts() -> None:
    every = _by_kind(ALL)
    for part, first in ((HELD_OUT, 1), (TUNING, 0)):
        kinds = _by_kind(part)
        assert set(kinds) == set(KINDS)
        for kind in KINDS:
            assert kinds[kind] == every[kind][first::2], (kind, first)


def test_the_first_prompts_of_a_part_cover_every_kind() -> None:
    for part in (ALL, TUNING, HELD_OUT):
        assert [p.kind for p in part[:8]] == list(KINDS)
        assert [p.kind for p in part[8:16]] == list(KINDS)
    assert copy_prompts(5, "held-out") == [p.message for p in HELD_OUT[:5]]
    assert copy_prompts(100, "tuning") == [p.message for p in TUNING]  # fewer when the part has fewer
    with pytest.raises(ValueError, match="unknown part"):
        copy_set("held")


@pytest.mark.parametrize("prompt", ALL, ids=[f"{p.kind}-{p.source}" for p in ALL])
def test_each_prompt_holds_a_context_long_enough_to_copy(prompt: CopyPrompt) -> None:
    assert 300 < len(prompt.context) <= 2400  # about 100 to 600 tokens
    assert prompt.context in prompt.message
    assert len(prompt.message) - len(prompt.context) < 300  # the instruction is short: the answer copies


def _names(source: str) -> list[str]:
    return [
        t.string for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.NAME
    ]


def _lines(source: str) -> int:
    return len(source.rstrip("\n").splitlines())


def _check_rename(p: CopyPrompt) -> None:
    old, new = p.subject
    tree = ast.parse(p.context)
    assert isinstance(tree.body[0], ast.FunctionDef) and 15 <= _lines(p.context) <= 50
    assert _names(p.context).count(old) >= 3
    assert new not in _names(p.context) and f"`{old}` to `{new}`" in p.message


def _check_replace(p: CopyPrompt) -> None:
    word, new = p.subject
    assert len(re.findall(rf"\b{word}\b", p.context)) >= 2
    assert not re.search(rf"\b{new}\b", p.context)
    assert f'"{word}" with "{new}"' in p.message


def _check_hints(p: CopyPrompt) -> None:
    (cls,) = ast.parse(p.context).body
    assert isinstance(cls, ast.ClassDef) and cls.name == p.subject[0] and 15 <= _lines(p.context) <= 30
    methods = [f for f in cls.body if isinstance(f, ast.FunctionDef)]
    assert len(methods) >= 4
    args = [a for f in methods for a in f.args.args + f.args.kwonlyargs]
    assert all(a.annotation is None for a in args) and all(f.returns is None for f in methods)


def _check_typo(p: CopyPrompt) -> None:
    module, word, wrong, at = p.subject
    start = int(at)
    original = passage(module)
    assert wrong != word and sorted(wrong) == sorted(word)  # two letters swapped
    assert p.context[start : start + len(wrong)] == wrong and p.context.count(wrong) == 1
    assert original[start : start + len(word)] == word and p.context != original
    assert p.context[:start] + word + p.context[start + len(wrong) :] == original


def _keys(value: object) -> int:
    if isinstance(value, dict):
        return len(value) + sum(_keys(v) for v in value.values())
    if isinstance(value, list):
        return sum(_keys(v) for v in value)
    return 0


def _check_yaml(p: CopyPrompt) -> None:
    doc = json.loads(p.context)
    assert isinstance(doc, dict) and 10 <= _keys(doc) <= 25
    assert any(isinstance(v, dict) for v in doc.values())  # nested


def _check_markdown(p: CopyPrompt) -> None:
    rows = list(csv.reader(io.StringIO(p.context)))
    assert len(rows) >= 9 and len(rows[0]) >= 3
    assert {len(row) for row in rows} == {len(rows[0])}


def _check_sort(p: CopyPrompt) -> None:
    lines = p.context.splitlines()
    assert 20 <= len(lines) <= 30 and len(set(lines)) == len(lines)
    assert lines != sorted(lines)


def _check_docstring(p: CopyPrompt) -> None:
    (function,) = ast.parse(p.context).body
    assert isinstance(function, ast.FunctionDef) and function.name == p.subject[0]
    assert ast.get_docstring(function) is None and 10 <= _lines(p.context) <= 30


CHECKS = {
    "rename": _check_rename, "replace": _check_replace, "hints": _check_hints, "typo": _check_typo,
    "yaml": _check_yaml, "markdown": _check_markdown, "sort": _check_sort, "docstring": _check_docstring,
}  # fmt: skip


@pytest.mark.parametrize("prompt", ALL, ids=[f"{p.kind}-{p.source}" for p in ALL])
def test_each_prompt_holds_what_its_answer_must_copy(prompt: CopyPrompt) -> None:
    CHECKS[prompt.kind](prompt)


def test_a_function_s_docstring_is_stripped_and_nothing_else() -> None:
    whole = function_source("textwrap.indent")  # a function with a docstring
    stripped = function_source("textwrap.indent", strip_docstring=True)
    assert ast.get_docstring(ast.parse(whole).body[0]) and stripped != whole  # type: ignore[arg-type]
    assert ast.get_docstring(ast.parse(stripped).body[0]) is None  # type: ignore[arg-type]
    assert ast.dump(ast.parse(stripped)) == ast.dump(ast.parse(whole.replace(_docstring(whole), "", 1)))


def _docstring(source: str) -> str:
    first = ast.parse(source).body[0].body[0]  # type: ignore[attr-defined]
    return "".join(source.splitlines(keepends=True)[first.lineno - 1 : first.end_lineno])


def test_the_sources_are_distinct() -> None:
    """Kind 8's functions are not kind 1's; the passages are neither quote's nor rewrite's."""
    from specmesh.bench.measure import QUOTE_MODULES, REWRITE_MODULES

    kinds = _by_kind(ALL)
    renamed = {p.source.rsplit(".", 1)[0] for p in kinds["rename"]}
    assert not renamed & {p.source.rsplit(".", 1)[0] for p in kinds["docstring"]}
    passages = [p.source.removeprefix("passage:") for p in kinds["replace"] + kinds["typo"]]
    assert len(set(passages)) == 8 and not set(passages) & {*QUOTE_MODULES, *REWRITE_MODULES}


class _ChatTemplate:
    """A stand-in tokenizer: only its chat template."""

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert not tokenize and add_generation_prompt
        return f"<user>{messages[0]['content']}</user><assistant>"


def test_the_bench_takes_the_halves_by_name() -> None:
    from specmesh.bench.measure import COPYING_SETS, PROMPT_SETS, prompt_set

    assert {"copy", "copy-held"} <= set(PROMPT_SETS) & set(COPYING_SETS)
    held = prompt_set("copy-held", 16, _ChatTemplate())
    assert held == [f"<user>{p.message}</user><assistant>" for p in HELD_OUT]
    assert prompt_set("copy", 4, _ChatTemplate()) == [
        f"<user>{p.message}</user><assistant>" for p in TUNING[:4]
    ]
