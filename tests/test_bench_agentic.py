"""`specmesh bench agentic` (specmesh/bench/agentic.py): its prompts, the order and privacy of its
requests, its summaries on hand-made numbers, and one small run on a tiny stack with suffix
drafters (tests/test_suffix_services.py's `mesh`)."""

from __future__ import annotations

import json
import re
import time

import pytest

from specmesh.bench import agentic
from specmesh.bench.agentic import (
    ENGINES,
    TEACHER,
    TEMPLATES,
    agentic_messages,
    agentic_prompts,
    engine_ratios,
    halves,
    learning_order,
)
from specmesh.bench.default_path import FIRST_SEED
from specmesh.bench.tiny import CHAT_TEMPLATE, make_tokenizer
from specmesh.cli import main
from specmesh.core.methods import Method
from tests import test_suffix_services
from tests.servers import wait_until

pytestmark = pytest.mark.xdist_group("bench_agentic")

mesh = test_suffix_services.mesh  # Redis, two suffix drafters, a verifier and a gateway (tiny models)


def _pattern(template: str) -> re.Pattern:
    """A template's text with each {field} as any text (and {{ }} as the braces they format to)."""
    literal = template.replace("{{", "\0").replace("}}", "\1")
    parts = re.split(r"\{\w+\}", literal)
    escaped = [re.escape(p.replace("\0", "{").replace("\1", "}")) for p in parts]
    return re.compile(".+".join(escaped))


def test_the_prompts_cycle_through_the_templates_with_values_of_their_own() -> None:
    messages = agentic_messages(24)
    assert messages == agentic_messages(24)  # deterministic
    assert len(messages) == 24 and len(TEMPLATES) >= 4
    names = list(TEMPLATES)
    for i, message in enumerate(messages):
        assert _pattern(TEMPLATES[names[i % len(names)]]).fullmatch(message), (i, message)
    assert len(set(messages)) == 24  # every instance of a template has values of its own
    later = agentic_messages(24, offset=24)  # the next row's: fresh values, the same templates in turn
    assert not set(later) & set(messages)
    assert all(_pattern(TEMPLATES[names[i % len(names)]]).fullmatch(m) for i, m in enumerate(later))
    assert agentic_messages(5, offset=24) == later[:5]
    assert '{"name": "get_weather", "arguments": {...}}' in messages[3]


def test_the_prompts_are_user_messages_in_the_chat_template() -> None:
    tokenizer = make_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE  # "user <content> " then "w0", the assistant's turn
    assert agentic_prompts(6, tokenizer, offset=3) == [f"user {m} w0" for m in agentic_messages(6, 3)]


def test_only_the_suffix_engine_teaches_and_it_keeps_the_gateway_s_defaults() -> None:
    assert {name for name, (_, private) in ENGINES.items() if not private} == {TEACHER}
    assert set(ENGINES) == {"none", "ngram", "suffix", "default"}
    assert ENGINES["default"][0] is None  # no speculation field
    suffix, ngram = ENGINES["suffix"][0], ENGINES["ngram"][0]
    assert (suffix.method, suffix.depth, suffix.beam_width) == (Method.SUFFIX, 8, 2)
    assert (ngram.method, ngram.depth) == (Method.NGRAM, 4)


def test_one_session_rows_run_the_teacher_after_the_private_engines_of_each_prompt() -> None:
    calls: list[tuple[str, str, int]] = []

    def engine(name: str):
        def run(texts: list[str], seed: int) -> dict:
            calls.append((name, texts[0], seed - FIRST_SEED))
            return dict(tokens=1)

        return run

    names = ("a", "b", "suffix", "c")
    parts = learning_order({n: engine(n) for n in names}, ["p0", "p1", "p2"])
    assert calls == [
        ("a", "p0", 0), ("b", "p0", 0), ("c", "p0", 0), ("suffix", "p0", 0),
        ("b", "p1", 1), ("c", "p1", 1), ("a", "p1", 1), ("suffix", "p1", 1),
        ("c", "p2", 2), ("a", "p2", 2), ("b", "p2", 2), ("suffix", "p2", 2),
    ]  # fmt: skip
    assert {n: len(p) for n, p in parts.items()} == dict.fromkeys(names, 3)


def test_the_halves_and_the_ratios_on_hand_made_numbers() -> None:
    parts = [
        dict(tokens=10, drafted_tokens=10, accepted_tokens=2),
        dict(tokens=10, drafted_tokens=10, accepted_tokens=4),
        dict(tokens=10, drafted_tokens=20, accepted_tokens=15),
        dict(tokens=10, drafted_tokens=0, accepted_tokens=0),
        dict(tokens=20, drafted_tokens=20, accepted_tokens=15),
    ]
    first, second = halves(parts)  # 2 prompts, then 3
    assert first == dict(
        prompts=2, drafted_tokens=20, accepted_tokens=6, acceptance=0.3, accepted_per_token=0.3
    )
    assert second["prompts"] == 3 and second["acceptance"] == 0.75 and second["accepted_per_token"] == 0.75
    assert halves([dict(tokens=0, drafted_tokens=0, accepted_tokens=0)] * 2)[0]["acceptance"] is None

    row = {
        "none": dict(tokens_per_second=10.0, decode_tokens_per_second=12.0),
        "ngram": dict(tokens_per_second=12.5, decode_tokens_per_second=16.0),
        "suffix": dict(tokens_per_second=20.0, decode_tokens_per_second=24.0),
        "default": dict(tokens_per_second=15.0),  # no decode phase measured
    }
    want = dict(suffix_over_none=2.0, decode_suffix_over_none=2.0, suffix_over_ngram=1.6,
                decode_suffix_over_ngram=1.5, default_over_none=1.5, default_over_ngram=1.2)  # fmt: skip
    assert engine_ratios(row) == pytest.approx(want)


def _fake_run(sent: list[tuple]):
    """agentic._gateway_run's stand-in: records (spec, private, sessions, texts, first seed); each
    text gives 10 tokens in 1 s, and a drafting method drafts 4 of which 2 are accepted."""

    def run(address, spec, private, temperature, max_new, sessions, texts, first_seed) -> dict:
        sent.append((spec, private, sessions, tuple(texts), first_seed))
        n = len(texts)
        drafted = 0 if spec is None or not spec.method.drafts else 4 * n
        return dict(
            tokens=10 * n, seconds=1.0 * n, decode_tokens=9 * n, decode_seconds=0.5 * n,
            accepted_tokens=drafted // 2, drafted_tokens=drafted, target_calls=5 * n,
            block_efficiency=2.0 if drafted else 1.0,
        )  # fmt: skip

    return run


def test_a_row_sends_every_engine_the_same_texts_and_seeds_all_private_but_suffix(monkeypatch) -> None:
    sent: list[tuple] = []
    monkeypatch.setattr(agentic, "_gateway_run", _fake_run(sent))
    texts = ["p0", "p1", "p2", "p3"]
    row = agentic.compare("addr", texts, 0.0, 8, 1)
    assert len(sent) == 16 and all(private == (spec is not ENGINES[TEACHER][0]) for spec, private, *_ in sent)
    for name, (spec, _) in ENGINES.items():
        mine = [(t, seed) for s, _, sessions, t, seed in sent if s is spec and sessions == 1]
        assert mine == [((t,), FIRST_SEED + i) for i, t in enumerate(texts)], name
        assert row[name]["tokens"] == 40 and row[name]["tokens_per_second"] == 10.0
    assert row["suffix_over_none"] == 1.0 and row["suffix"]["draft_acceptance"] == 0.5
    assert [h["acceptance"] for h in row["suffix_halves"]] == [0.5, 0.5]

    sent.clear()
    row = agentic.compare("addr", texts, 1.0, 8, 4)  # concurrent: one call per engine, the teacher last
    assert [(private, sessions, t, seed) for _, private, sessions, t, seed in sent] == [
        (True, 4, tuple(texts), FIRST_SEED)
    ] * 3 + [(False, 4, tuple(texts), FIRST_SEED)]
    assert "suffix_halves" not in row and row["default_over_ngram"] == 1.0


def test_each_row_gets_fresh_prompts_and_the_cli_writes_the_rows(monkeypatch, tmp_path, capsys) -> None:
    import specmesh.runtime.tokenizers as tokenizers

    tokenizer = make_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    monkeypatch.setattr(tokenizers, "load_tokenizer", lambda source: (tokenizer, None))
    monkeypatch.setattr(tokenizers, "gguf_file", lambda source: None)
    sent: list[tuple] = []
    monkeypatch.setattr(agentic, "_gateway_run", _fake_run(sent))
    out = tmp_path / "agentic.json"
    assert main(["bench", "agentic", "--prompts", "8", "--sessions", "1", "2", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert [(r["temperature"], r["sessions"], r["offset"]) for r in results["rows"]] == [
        (0.0, 1, 0),
        (0.0, 2, 8),
    ]
    first = {t for _, _, sessions, texts, _ in sent if sessions == 1 for t in texts}
    second = {t for _, _, sessions, texts, _ in sent if sessions == 2 for t in texts}
    assert len(first) == len(second) == 8 and not first & second
    assert results["max_new_tokens"] == 96 and results["templates"] == TEMPLATES
    printed = capsys.readouterr().out
    assert "agentic T=0.0 sessions=1" in printed and "suffix/ngram" in printed and "first half" in printed


def test_a_small_run_on_a_stack_with_suffix_drafters(mesh, models) -> None:
    """Through the gateway: every engine gives the same tokens (T = 0, lossless), and only the
    suffix engine's outputs reach the drafters (the others' requests are private)."""
    before = test_suffix_services.learnt(mesh.drafters[0])
    results = agentic.bench_agentic(
        mesh.gateway.address, prompts=4, max_new=8, sessions=(1, 2), target=str(models["target"])
    )
    taught = 0
    for row in results["rows"]:
        assert len({row[name]["tokens"] for name in ENGINES}) == 1 and row["none"]["tokens"] > 0
        assert row["none"]["drafted_tokens"] == 0 and row["suffix"]["drafted_tokens"] >= 0
        taught += row["suffix"]["tokens"]
    assert len(results["rows"][0]["suffix_halves"]) == 2
    for d in mesh.drafters:
        wait_until(lambda d=d: test_suffix_services.learnt(d) >= before + taught, what="the outputs learnt")
    time.sleep(0.5)  # a private output published late would show here
    assert [test_suffix_services.learnt(d) for d in mesh.drafters] == [before + taught] * 2
