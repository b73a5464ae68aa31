"""One sample's text: incremental detokenization plus stop strings.

A stop string ends the completion and is cut from the text. While streaming, the last
``len(longest stop) - 1`` characters are held back, because they could be the start of
a stop string that the next token completes; the caller never sees text it would
later have to take back.
"""

from __future__ import annotations

from typing import Any


class TextStream:
    def __init__(self, detokenizer: Any | None, stop: tuple[str, ...] = (), skip_ids: frozenset[int] = frozenset()):
        self._detok = detokenizer
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._skip = skip_ids
        self._text = ""  # everything decoded so far
        self._emitted = 0  # characters already handed out
        self.stopped_by: str | None = None

    @property
    def text(self) -> str:
        """The text handed out so far (final once the stream is finished)."""
        return self._text[: self._emitted]

    def push(self, token: int, *, check_stop: bool = True) -> str:
        """Add a token; return the text that can be released now."""
        if self._detok is None or self.stopped_by is not None:
            return ""
        if token not in self._skip:
            self._text += self._detok.push(token)
        if check_stop and self._stop:
            pending = self._text[self._emitted :]
            hits = [(pending.find(s), s) for s in self._stop if s in pending]
            if hits:
                pos, stop = min(hits)
                self.stopped_by = stop
                return self._release(self._emitted + pos, cut=True)
        return self._release(max(self._emitted, len(self._text) - self._hold))

    def finish(self) -> str:
        """Release what was held back (nothing more can complete a stop string)."""
        if self._detok is None or self.stopped_by is not None:
            return ""
        self._text += self._detok.flush()
        return self._release(len(self._text))

    def _release(self, upto: int, cut: bool = False) -> str:
        out = self._text[self._emitted : upto]
        self._emitted = upto
        if cut:
            self._text = self._text[:upto]
        return out
