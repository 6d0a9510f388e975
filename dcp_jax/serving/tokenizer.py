"""Tokenizers (no jax): a model directory's HF `tokenizer.json` (through `tokenizers`), else UTF-8 bytes (the tiny
random model)."""

from __future__ import annotations

import os

from dcp_jax.host.detokenizer import StreamDetokenizer, Utf8ByteDetokenizer


class ByteTokenizer:
    """UTF-8 bytes shifted past the special ids: byte b is id `offset + b` (offset = 1 + max(bos, eos))."""

    def __init__(self, vocab_size: int, bos_token_id: int = 0, eos_token_id: int = 1):
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id
        self.offset = max(bos_token_id, eos_token_id) + 1
        if vocab_size < self.offset + 256:
            raise ValueError(f"a byte tokenizer needs vocab_size >= {self.offset + 256}, got {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self.offset + b for b in text.encode("utf-8")]
        return [self.bos_token_id, *ids] if add_special_tokens else ids

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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def new_detokenizer(self) -> StreamDetokenizer:
        """An incremental decoder of one growing sequence."""
        return StreamDetokenizer(self._tok, self.decode)


def load_tokenizer(model_dir: str | None, vocab_size: int, bos_token_id: int, eos_token_id: int):
    """`model_dir/tokenizer.json` when the directory has one, else a ByteTokenizer."""
    path = os.path.join(model_dir, "tokenizer.json") if model_dir else None
    if path and os.path.exists(path):
        return HFTokenizer(path, bos_token_id, eos_token_id)
    return ByteTokenizer(vocab_size, bos_token_id, eos_token_id)
