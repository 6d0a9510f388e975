"""Incremental detokenization (pure Python): each new token costs a small, constant piece of work, not the decode
of the whole output, whatever the tokenizer.

A token's text can depend on its neighbours (byte-level BPE merges a multi-byte character over several tokens;
SentencePiece spaces depend on the previous token), so in general the new text is the decode of a short window that
starts at the tokens read last time, minus the decode of that window without the new tokens (vLLM's
`detokenize_incrementally`): `IncrementalDetokenizer`, for any `decode`. Two tokenizers have a cheaper stream:
UTF-8 bytes (`Utf8ByteDetokenizer`, the standard library's incremental UTF-8 decoder) and HF `tokenizers` (its
Rust `DecodeStream`, `StreamDetokenizer`); `serving/tokenizer.py` picks one per tokenizer (`new_detokenizer`).
Every kind holds text that ends in an unfinished UTF-8 sequence until the sequence completes, and `flush` gives
what the whole decode would end with (U+FFFD for a sequence left unfinished): `text` always equals the decode of
every token added once flushed.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"  # what a byte-level decode of an unfinished UTF-8 sequence ends with


class Detokenizer(Protocol):
    """The text of a growing token sequence: `add_one(token)` returns the characters it completes (possibly
    none), `flush()` the rest at the end; `text` is everything returned so far."""

    text: str

    def add_one(self, token: int) -> str: ...

    def flush(self) -> str: ...


class IncrementalDetokenizer:
    """Any tokenizer, through its `decode` of a few tokens a step."""

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


class Utf8ByteDetokenizer:
    """A byte tokenizer's: id `offset + b` is byte b; other ids (specials) have no text. One incremental UTF-8
    decode a token (errors replaced, as a whole decode with errors="replace" gives)."""

    def __init__(self, offset: int):
        self._offset = offset
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.text = ""

    def add_one(self, token: int) -> str:
        b = token - self._offset
        if not 0 <= b < 256:
            return ""
        new = self._utf8.decode(bytes((b,)))
        self.text += new
        return new

    def flush(self) -> str:
        new = self._utf8.decode(b"", final=True)
        self.text += new
        return new


class StreamDetokenizer:
    """A HF `tokenizers.Tokenizer`'s own incremental decode (`tokenizers.decoders.DecodeStream`, special tokens
    skipped as `decode` skips them): one call into Rust a token. It returns nothing while a character is
    unfinished; `flush` decodes what is left the windowed way."""

    def __init__(self, tokenizer, decode: Callable[[Sequence[int]], str]):
        from tokenizers.decoders import DecodeStream

        self._tokenizer, self._decode = tokenizer, decode
        self._stream = DecodeStream(skip_special_tokens=True)
        self._ids: list[int] = []
        self._read_offset = 0  # ids before this are in `text`
        self.text = ""

    def add_one(self, token: int) -> str:
        self._ids.append(token)
        new = self._stream.step(self._tokenizer, token)
        if new is None:
            return ""
        self._read_offset = len(self._ids)
        self.text += new
        return new

    # Tokens of context before the held ones when flushing (a token's text may depend on the one before it).
    _FLUSH_CONTEXT = 4

    def flush(self) -> str:
        if self._read_offset == len(self._ids):
            return ""
        start = max(self._read_offset - self._FLUSH_CONTEXT, 0)
        window = self._decode(self._ids[start:])
        new = window[len(self._decode(self._ids[start:self._read_offset])):]
        self._read_offset = len(self._ids)
        self.text += new
        return new
