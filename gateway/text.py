"""Generated tokens -> text, incrementally, and stop sequences.

The text of a generation is the decode of all its tokens (special tokens skipped), cut right
before the first stop sequence. Streaming hands out only text that can no longer change:
nothing that ends in U+FFFD (an incomplete UTF-8 sequence, completed by a later token) and
nothing that could still be the start of a stop sequence. The final piece flushes the rest, so
the streamed pieces always add up to the unary text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_INCOMPLETE = "\ufffd"
CONTEXT_TOKENS = 4


class TextStream:
    """context: the last few prompt tokens. Decoded in front of the generated ones and then cut
    off, they give the first generated token its leading space (SentencePiece and word-level
    decoders drop the space of a sequence's first token)."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), context: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._context = list(context)[-CONTEXT_TOKENS:]
        self._prefix = self._raw(self._context)
        self._tokens: list[int] = []
        self._sent = ""  # the text handed out so far

    def stop_cut(self, new_tokens: Sequence[int]) -> int | None:
        """How many of `new_tokens` to keep when appending them completes a stop sequence (the
        token that completes it is kept), None when none does."""
        if not self._stop:
            return None
        for n in range(1, len(new_tokens) + 1):
            if self._find_stop(self._decode([*self._tokens, *new_tokens[:n]])) is not None:
                return n
        return None

    def push(self, new_tokens: Sequence[int], final: bool) -> str:
        """Add committed tokens; -> the text that is new and stable (everything left if final)."""
        self._tokens += new_tokens
        text = self._decode(self._tokens)
        cut = self._find_stop(text)
        if cut is not None:
            text = text[:cut]
        elif not final:
            text = self._stable(text)
        # By length, not by prefix: a decoder that revises earlier text (whitespace clean-up)
        # must not stall the stream; what was handed out is never taken back.
        piece = text[len(self._sent) :]
        self._sent = text if len(text) > len(self._sent) else self._sent
        return piece

    def _decode(self, tokens: Sequence[int]) -> str:
        text = self._raw([*self._context, *tokens])
        if not text.startswith(self._prefix):  # the context merged with the new tokens
            return self._raw(tokens)
        return text[len(self._prefix) :]

    def _raw(self, tokens: Sequence[int]) -> str:
        return self._tokenizer.decode(list(tokens), skip_special_tokens=True)

    def _find_stop(self, text: str) -> int | None:
        found = [i for i in (text.find(s) for s in self._stop) if i >= 0]
        return min(found) if found else None

    def _stable(self, text: str) -> str:
        text = text.rstrip(_INCOMPLETE)
        held = max((_overlap(text, s) for s in self._stop), default=0)
        return text[: len(text) - held]


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `stop`."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
