"""Incremental detokenization (pure Python): each new token costs the decode of a few tokens, not of the whole
output, whatever the tokenizer.

A token's text can depend on its neighbours (byte-level BPE merges a multi-byte character over several tokens;
SentencePiece spaces depend on the previous token), so the new text is the decode of a short window that starts
at the tokens read last time, minus the decode of that window without the new tokens (vLLM's
`detokenize_incrementally`).
Text that ends in an unfinished UTF-8 sequence (U+FFFD) is held until the sequence completes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT_CHAR = "\ufffd"  # what a byte-level decode of an unfinished UTF-8 sequence ends with


class IncrementalDetokenizer:
    """The text of a growing token sequence, one `add` at a time: `add(ids)` returns the characters the new ids
    complete (possibly none), and `text` is everything completed so far."""

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self._decode = decode
        self._ids: list[int] = []
        self._prefix_offset = 0  # the window starts here
        self._read_offset = 0  # ids before this are in `text`
        self.text = ""

    def add(self, ids: Sequence[int]) -> str:
        self._ids.extend(int(i) for i in ids)
        return self._read_new()

    def add_one(self, token: int) -> str:
        """`add([token])` for one int id."""
        self._ids.append(token)
        return self._read_new()

    def _read_new(self) -> str:
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        window = self._decode(self._ids[self._prefix_offset:])
        if len(window) <= len(prefix) or window.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new yet, or a character still unfinished
        new = window[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += new
        return new

    def flush(self) -> str:
        """At the end: whatever is still held back (an unfinished character decodes as U+FFFD)."""
        if self._read_offset == len(self._ids):
            return ""
        new = self._decode(self._ids[self._prefix_offset:])[len(self._decode(self._ids[self._prefix_offset:
                                                                                      self._read_offset])):]
        self._read_offset = len(self._ids)
        self.text += new
        return new
