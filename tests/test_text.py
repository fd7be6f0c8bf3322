"""TextStream: incremental decoding hands out exactly the text of a whole decode, cut at the stop.

The reference is the definition (gateway/text.py's docstring): decode all the tokens behind the
prompt's last few, take off the prompt's text, cut before the first stop sequence. Pushed in
random pieces, the streamed text must add up to it, and never take back what it handed out."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from gateway.text import CONTEXT_TOKENS, TextStream
from specmesh.bench.tiny import make_byte_tokenizer, make_tokenizer


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """SentencePiece-like: pieces with ▁ for a space, a decoder that drops the first one."""
    pieces = ["<unk>", "<s>", "</s>", "▁the", "▁cat", "▁sat", "s", "at", "▁", "▁on", "▁mat", ",", "."]
    backend = Tokenizer(models.WordLevel(vocab={p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def cleanup_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level with transformers' clean-up of spaces (" ." -> "."): it revises earlier text."""
    tokenizer = make_tokenizer(20)
    tokenizer.add_tokens([".", ","])
    tokenizer.clean_up_tokenization_spaces = True
    return tokenizer


def reference(tokenizer, context: list[int], tokens: list[int], stop: tuple[str, ...]) -> str:
    context = context[-CONTEXT_TOKENS:]
    prefix = tokenizer.decode(context, skip_special_tokens=True)
    text = tokenizer.decode([*context, *tokens], skip_special_tokens=True)
    text = (
        text[len(prefix) :] if text.startswith(prefix) else tokenizer.decode(tokens, skip_special_tokens=True)
    )
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return text[: min(cuts)] if cuts else text


def byte_ids(tokenizer, rng: random.Random, n: int) -> list[int]:
    """Mostly multi-byte UTF-8 (é, €, 🙂) split into byte tokens, with ASCII between."""
    text = "".join(rng.choice(["a", " b", "é", "€", "🙂", "\n", "xy"]) for _ in range(n))
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("name", ["word", "byte", "metaspace", "cleanup"])
def test_streamed_pieces_add_up_to_the_whole_decode(name: str) -> None:
    tokenizer = {
        "word": make_tokenizer,
        "byte": make_byte_tokenizer,
        "metaspace": metaspace_tokenizer,
        "cleanup": cleanup_tokenizer,
    }[name]()
    rng = random.Random(7)
    normal = [i for i in range(len(tokenizer)) if i not in tokenizer.all_special_ids]
    for trial in range(60):
        if name == "byte":
            context, tokens = byte_ids(tokenizer, rng, 3), byte_ids(tokenizer, rng, rng.randint(1, 60))
        else:
            context = [rng.choice(normal) for _ in range(rng.randint(0, 6))]
            tokens = [rng.choice(normal) for _ in range(rng.randint(1, 80))]
            tokens += rng.sample(tokenizer.all_special_ids, 1)  # skipped
        whole = reference(tokenizer, context, tokens, ())
        # a stop sequence from the text itself (sometimes), so that it is found at varied places
        stop = (whole[len(whole) // 2 :][:3],) if trial % 3 == 0 and len(whole) > 6 else ()
        expected = reference(tokenizer, context, tokens, stop)
        stream, pieces, at = TextStream(tokenizer, stop, context=context), [], 0
        while at < len(tokens):
            step = rng.randint(1, 6)
            new, at = tokens[at : at + step], at + step
            if stop and stream.stop_cut(new) is not None:
                new = new[: stream.stop_cut(new)]
                at = len(tokens)
            pieces.append(stream.push(new, final=at >= len(tokens)))
            assert expected.startswith("".join(pieces)), (name, trial)
        assert "".join(pieces) == expected, (name, trial, tokens)
