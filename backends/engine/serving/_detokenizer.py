"""Turning generated token ids into text one token at a time, with stop strings.

Rules
-----
1. A byte-level BPE token may carry part of a UTF-8 character, so a token's text is only known
   once the character is complete.  As vLLM's incremental detokenizer does, we decode a short
   window of recent tokens twice -- up to the last emitted token, and with the new ones -- and
   emit the difference, unless the new text ends in U+FFFD (an incomplete character), in which
   case we wait for the next token.  At the end whatever is pending is emitted as it decodes.
   So the concatenated pieces equal ``decode(all tokens)``.
2. Stop strings are searched in the whole text as it grows (only where a new match can start).
   The text is cut before the earliest match.  While streaming, the last
   ``max(len(stop)) - 1`` characters are held back, because they may turn out to begin a stop
   string; they are released when the answer ends.
3. Special tokens (``<|im_end|>`` and the like) have no text, as with vLLM's default
   ``skip_special_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..model._tokenizer import ChatTokenizer

__all__ = ["IncrementalDetokenizer", "TextPiece"]

_INCOMPLETE = "\ufffd"


@dataclass(frozen=True, slots=True)
class TextPiece:
    """New text released after one token; ``stop`` is the stop string that ended the answer."""

    text: str
    stop: str | None = None


class IncrementalDetokenizer:
    """The text of one answer, grown token by token."""

    __slots__ = ("_ids", "_max_stop", "_prefix", "_read", "_released", "_stops", "_tokenizer",
                 "text")  # fmt: skip

    def __init__(self, tokenizer: ChatTokenizer, stop: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._stops = tuple(s for s in stop if s)
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._ids: list[int] = []
        self._prefix = 0  # window start: tokens before it are settled text
        self._read = 0  # tokens up to here are in `text`
        self._released = 0  # characters of `text` handed out
        self.text = ""

    def push(self, token_id: int, *, last: bool = False) -> TextPiece:
        """Add one token; ``last`` when the engine ends the answer with it."""
        self._ids.append(token_id)
        window = self._ids[self._prefix :]
        settled = self._decode(self._ids[self._prefix : self._read])
        grown = self._decode(window)
        if len(grown) > len(settled) and (last or not grown.endswith(_INCOMPLETE)):
            before = len(self.text)
            self.text += grown[len(settled) :]
            self._prefix, self._read = self._read, len(self._ids)
            stop = self._find_stop(before)
            if stop is not None:
                return TextPiece(self._release(final=True), stop)
        return TextPiece(self._release(final=last))

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

    def _find_stop(self, before: int) -> str | None:
        if not self._stops:
            return None
        start = max(0, before - self._max_stop + 1)
        found: tuple[int, str] | None = None
        for stop in self._stops:
            index = self.text.find(stop, start)
            if index >= 0 and (found is None or index < found[0]):
                found = (index, stop)
        if found is None:
            return None
        self.text = self.text[: found[0]]
        return found[1]

    def _release(self, *, final: bool) -> str:
        hold = 0 if final else max(0, self._max_stop - 1)
        end = max(self._released, len(self.text) - hold)
        piece = self.text[self._released : end]
        self._released = end
        return piece
