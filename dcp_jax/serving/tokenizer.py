"""Tokenizers (no jax): a model directory's HF `tokenizer.json` (through `tokenizers`), else UTF-8 bytes (the tiny
random model), each with the chat template the directory ships (`chat_template.py`); the server's view of one
(`TokenizerView`: special tokens by name, token strings, text offsets).
"""

from __future__ import annotations

import itertools
import os

import numpy as np

from dcp_jax.host.detokenizer import REPLACEMENT_CHAR, StreamDetokenizer, Utf8ByteDetokenizer
from dcp_jax.serving.chat_template import checkpoint_chat_template

# Bytes a ByteTokenizer encodes per call (the GIL is held for one call).
ENCODE_SLICE = 1 << 14


class ByteTokenizer:
    """UTF-8 bytes shifted past the special ids: byte b is id `offset + b` (offset = 1 + max(bos, eos))."""

    def __init__(self, vocab_size: int, bos_token_id: int = 0, eos_token_id: int = 1):
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id
        self.offset = max(bos_token_id, eos_token_id) + 1
        if vocab_size < self.offset + 256:
            raise ValueError(f"a byte tokenizer needs vocab_size >= {self.offset + 256}, got {vocab_size}")
        self.vocab_size = vocab_size
        self.chat_template: str | None = None  # the checkpoint's (`load_tokenizer`)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        data = text.encode("utf-8")
        head = 1 if add_special_tokens else 0
        ids = [self.bos_token_id] * (head + len(data))
        for start in range(0, len(data), ENCODE_SLICE):  # a slice per call: a long text lets other threads run
            piece = np.frombuffer(data, np.uint8, count=min(ENCODE_SLICE, len(data) - start), offset=start)
            ids[head + start: head + start + len(piece)] = (piece.astype(np.int64) + self.offset).tolist()
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Ids outside the byte range (specials, the rest of a larger vocab) are dropped."""
        data = bytes(i - self.offset for i in ids if self.offset <= i < self.offset + 256)
        return data.decode("utf-8", errors="replace")

    def new_detokenizer(self) -> Utf8ByteDetokenizer:
        """An incremental decoder of one growing sequence."""
        return Utf8ByteDetokenizer(self.offset)


class HFTokenizer:
    """A HF `tokenizer.json`; BOS is prepended here (never by the tokenizer's own post-processor)."""

    def __init__(self, path: str, bos_token_id: int | None, eos_token_id: int | None):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(path)
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id
        self.chat_template: str | None = None  # the checkpoint's (`load_tokenizer`)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def new_detokenizer(self) -> StreamDetokenizer:
        """An incremental decoder of one growing sequence."""
        return StreamDetokenizer(self._tok, self.decode)


def load_tokenizer(model_dir: str | None, vocab_size: int, bos_token_id: int, eos_token_id: int):
    """`model_dir/tokenizer.json` when the directory has one, else a ByteTokenizer; with the directory's chat
    template."""
    path = os.path.join(model_dir, "tokenizer.json") if model_dir else None
    if path and os.path.exists(path):
        tokenizer = HFTokenizer(path, bos_token_id, eos_token_id)
    else:
        tokenizer = ByteTokenizer(vocab_size, bos_token_id, eos_token_id)
    tokenizer.chat_template = checkpoint_chat_template(model_dir)
    return tokenizer


class TokenizerView:
    """The server's view of a tokenizer: special tokens by name in text, token strings for logprobs."""

    def __init__(self, tokenizer, *, bos_token_id: int | None, eos_token_id: int | None):
        self.tokenizer = tokenizer
        self.is_bytes = hasattr(tokenizer, "offset")  # the ByteTokenizer: specials have no text of their own
        self.specials = {}
        if self.is_bytes:
            self.specials = {name: i for name, i in (("<s>", bos_token_id), ("</s>", eos_token_id)) if i is not None}
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id

    def special_name(self, token_id: int | None) -> str | None:
        return next((name for name, i in self.specials.items() if i == token_id), None)

    def special_text(self, token_id: int | None) -> str:
        """The text that spells special token `token_id` in a prompt (a chat template's bos_token); '' for none."""
        if token_id is None:
            return ""
        if self.is_bytes:
            return self.special_name(token_id) or ""
        return self.tokenizer.id_to_token(token_id) or ""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of `text`, special tokens spelled in it included. A text without any is not copied (a long prompt's
        copy would hold the GIL, which the engine's thread needs, for tens of ms)."""
        pieces = [text]
        for name in self.specials:
            pieces = [part for piece in pieces for part in _split_keep(piece, name)]
        parts = [[self.specials[piece]] if piece in self.specials else
                 self.tokenizer.encode(piece, add_special_tokens=False) for piece in pieces if piece]
        ids = parts[0] if len(parts) == 1 else list(itertools.chain.from_iterable(parts))
        if add_special_tokens and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids) -> str:
        """Text of `ids`; special tokens have none."""
        return self.tokenizer.decode(list(ids))

    def text_offsets(self, ids) -> list[int]:
        """offsets[i] = len(decode(ids[:i])): where token i's text starts in decode(ids) (a special token's text is
        empty). Incremental: the text is committed at every clean boundary (no unfinished UTF-8 at its end), and
        each decode spans the uncommitted tokens plus one token of context (a tokenizer may spell a token
        differently at the start of a text)."""
        offsets, done, start, head = [], 0, 0, 0  # done = len(decode(ids[:start])); head = that of the context
        for i in range(len(ids)):
            context = max(start - 1, 0)
            piece = self.decode(ids[context:i])
            offsets.append(done + len(piece) - head)
            if not piece.endswith(REPLACEMENT_CHAR):
                done += len(piece) - head
                start = i
                head = len(self.decode(ids[max(i - 1, 0):i]))
        return offsets

    def token_text(self, token_id: int) -> str:
        """One token as text for logprobs; a byte that is not UTF-8 on its own is spelled `bytes:\\xNN`."""
        name = self.special_name(token_id)
        if name is not None:
            return name
        if self.is_bytes:
            b = token_id - self.tokenizer.offset
            if not 0 <= b < 256:
                return f"<id:{token_id}>"
            return chr(b) if b < 0x80 else f"bytes:\\x{b:02x}"
        return self.tokenizer.decode([token_id])


def _split_keep(text: str, sep: str) -> list[str]:
    parts = text.split(sep)
    out = [parts[0]]
    for part in parts[1:]:
        out += [sep, part]
    return out
