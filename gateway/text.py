"""Generated tokens -> text, incrementally, and stop sequences.

The text of a generation is the decode of all its tokens (special tokens skipped), cut right
before the first stop sequence. Streaming hands out only text that can no longer change:
nothing that ends in U+FFFD (an incomplete UTF-8 sequence, completed by a later token) and
nothing that could still be the start of a stop sequence. The final piece flushes the rest, so
the streamed pieces always add up to the unary text.

Decoding is incremental (vLLM's detokenizer does the same): the text of the tokens up to the
last point where it was complete is kept, and each push decodes only a few tokens before that
point plus the new ones. A push costs the same at the 10th token and at the 10,000th; decoding
everything again each round made a long generation's text quadratic in its length.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

_INCOMPLETE = "\ufffd"
CONTEXT_TOKENS = 4


class TextStream:
    """context: the last few prompt tokens. Decoded in front of the generated ones and then cut
    off, they give the first generated token its leading space (SentencePiece and word-level
    decoders drop the space of a sequence's first token). The same trick starts each
    incremental decode a few tokens back."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), context: Sequence[int] = ()) -> None:
        self._raw_ids = _decoder(tokenizer)
        # a decoder that cleans up spaces may revise earlier text: decode everything each time
        self._incremental = not _cleans_up(tokenizer)
        self._stop = tuple(stop)
        self._context = list(context)[-CONTEXT_TOKENS:]
        self._prefix = self._raw(self._context)
        self._tokens: list[int] = []
        self._sent = ""  # the text handed out so far
        # Complete text: the text of self._tokens[:self._done] never changes with later tokens.
        # The window (the CONTEXT_TOKENS tokens before that point) and its text start each decode.
        self._done, self._done_text = 0, ""
        self._window, self._window_text = self._context, self._prefix

    def stop_cut(self, new_tokens: Sequence[int]) -> int | None:
        """How many of `new_tokens` to keep when appending them completes a stop sequence (the
        token that completes it is kept), None when none does."""
        if not self._stop:
            return None
        for n in range(1, len(new_tokens) + 1):
            if self._find_stop(self._decode([*self._tokens[self._done :], *new_tokens[:n]])) is not None:
                return n
        return None

    def push(self, new_tokens: Sequence[int], final: bool) -> str:
        """Add committed tokens; -> the text that is new and stable (everything left if final)."""
        self._tokens += new_tokens
        text = self._decode(self._tokens[self._done :])
        if self._incremental and not text.endswith(_INCOMPLETE):
            self._done, self._done_text = len(self._tokens), text
            self._window = [*self._context, *self._tokens][-CONTEXT_TOKENS:]
            self._window_text = self._raw(self._window)
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

    def _decode(self, more: Sequence[int]) -> str:
        """The text of all tokens: the complete text, then that of `more` (the tokens after it)."""
        text = self._raw([*self._window, *more])
        if text.startswith(self._window_text):
            return self._done_text + text[len(self._window_text) :]
        # the window merged with the new tokens: decode everything, as a whole
        tokens = [*self._tokens[: self._done], *more]
        text = self._raw([*self._context, *tokens])
        return text[len(self._prefix) :] if text.startswith(self._prefix) else self._raw(tokens)

    def _raw(self, tokens: Sequence[int]) -> str:
        return self._raw_ids(list(tokens))

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


def _decoder(tokenizer: Any) -> Any:
    """ids -> text, special tokens skipped. A fast tokenizer's Rust decoder directly when
    transformers would add nothing to it (no clean-up of spaces): transformers' own decode
    converts every id in Python first, most of a decode's cost for a few tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not _cleans_up(tokenizer):
        return functools.partial(backend.decode, skip_special_tokens=True)
    return functools.partial(tokenizer.decode, skip_special_tokens=True)


def _cleans_up(tokenizer: Any) -> bool:
    """Whether transformers' decode cleans up spaces after the tokenizer's own (a tokenizer that
    does not say is taken to)."""
    return bool(getattr(tokenizer, "clean_up_tokenization_spaces", True))
