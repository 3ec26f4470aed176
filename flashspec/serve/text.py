"""A request's output as text: incremental detokenisation and stop strings (SPEC.md §12, "The
server's limits, fields, authentication and shutdown").

Each token costs the same however long the output is: it is decoded with a few tokens before it
as context (:class:`Detokenizer`), and a stop string is looked for only where it can end in the
new text (:class:`StopText`).
"""

from __future__ import annotations

import bisect
from typing import Any

__all__ = ["MAX_PENDING_TOKENS", "MAX_STOP_CHARS", "Detokenizer", "StopText"]

# The longest stop string a request may give, in characters: it bounds the text held back and the
# search each token pays for.
MAX_STOP_CHARS = 10_000
# Tokens decoded together at most while waiting for a character's last byte; past it the
# incomplete part is released as U+FFFD, as a decode of those tokens alone shows it.
MAX_PENDING_TOKENS = 8
_REPLACEMENT = "\ufffd"


class Detokenizer:
    """Text of a growing list of token ids, one token at a time.

    ``ids[prefix:read]`` were decoded last time, as context; a new token is decoded with them
    (``ids[prefix:]``) and the text past their own decode is its text. While that text ends in
    U+FFFD (a character whose bytes have not all come), only what precedes it is released and the
    window waits for the next token, at most :data:`MAX_PENDING_TOKENS` of them. So the text is
    the decode of all the ids wherever the tokenizer's decode of a window starting one token back
    agrees with the whole decode (byte-level BPE, SentencePiece, character tokenizers)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read]: the context, already released
        self.read = 0
        self.early = 0  # characters released past ids[:read] while a character was incomplete

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _new(self) -> str:
        """The text of ``ids[read:]``, decoded after its context."""
        context = self._decode(self.ids[self.prefix:self.read])
        return self._decode(self.ids[self.prefix:])[len(context):]

    def add(self, token: int) -> str:
        """The text ``token`` completes."""
        self.ids.append(token)
        new = self._new()
        if new.endswith(_REPLACEMENT) and len(self.ids) - self.read < MAX_PENDING_TOKENS:
            complete = len(new) - 1  # the characters before the incomplete one are final
            piece = new[self.early:complete]
            self.early = max(self.early, complete)
            return piece
        return self._advance(new)

    def flush(self) -> str:
        """Whatever is still waiting (an incomplete character shows as U+FFFD): the output ended."""
        return self._advance(self._new()) if self.read < len(self.ids) else ""

    def _advance(self, new: str) -> str:
        piece = new[self.early:]
        self.prefix, self.read, self.early = self.read, len(self.ids), 0
        return piece


class StopText:
    """A request's text as tokens arrive, released only once no stop string can begin in it.

    ``ends[k]`` is the length of the text after token ``k``; at a stop string the text is cut
    before it, and the tokens counted are the fewest leading ones whose text holds what is
    returned (OpenAI's ``completion_tokens``)."""

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.detokenizer = Detokenizer(tokenizer)
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ends: list[int] = []
        self.pending = ""  # decoded text not released yet (at most `hold` characters between calls)
        self.sent = 0  # characters released
        self.kept: int | None = None  # tokens kept at a stop string

    @property
    def tokens(self) -> int:
        """Tokens of the completion (at a stop string: those of the text returned)."""
        return len(self.ends) if self.kept is None else self.kept

    def add(self, ids: list[int]) -> tuple[str, bool]:
        """New releasable text, and whether a stop string ended the completion."""
        return self._take(ids, final=False)

    def finish(self) -> tuple[str, bool]:
        """The rest of the text once the output ended (the engine's own end): the text held back
        and any incomplete character; a stop string found in it still cuts it."""
        delta, stopped = self._take([], final=True)
        if stopped:
            return delta, True
        rest, self.pending = self.pending, ""
        self.sent += len(rest)
        return delta + rest, False

    def _take(self, ids: list[int], final: bool) -> tuple[str, bool]:
        searched = len(self.pending)
        for token in ids:
            self.pending += self.detokenizer.add(token)
            self.ends.append(self.sent + len(self.pending))
        if final:
            self.pending += self.detokenizer.flush()
            if self.ends:
                self.ends[-1] = self.sent + len(self.pending)
        # the stop string completed first in the text ends it (at a tie, the longer): how the
        # tokens were grouped into steps changes nothing
        found = [(at + len(s), at) for s in self.stop if (at := self.pending.find(s, max(0, searched - len(s) + 1))) >= 0]
        if found:
            at = min(found)[1]
            delta, self.pending = self.pending[:at], ""
            self.sent += at
            self.kept = self.covering(self.sent)
            return delta, True
        end = len(self.pending) - self.hold
        if end <= 0:
            return "", False
        delta, self.pending = self.pending[:end], self.pending[end:]
        self.sent += end
        return delta, False

    def covering(self, chars: int) -> int:
        """The fewest leading tokens whose text holds the first ``chars`` characters."""
        return 0 if chars <= 0 else min(bisect.bisect_left(self.ends, chars) + 1, len(self.ends))

    def released(self) -> int:
        """Tokens whose text has been released so far (all of them without stop strings: no token
        can still be cut)."""
        if self.kept is not None:
            return self.kept
        return self.covering(self.sent) if self.stop else len(self.ends)
