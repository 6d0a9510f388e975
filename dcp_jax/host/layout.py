"""DCP placement of KV tokens across the ranks of a DCP group (host only: numpy, no jax).

Notation of the spec: W = dcp_size, S = interleave, B = page_size. Token p lives on rank
`owner(p) = (p // S) % W` at `local_index(p) = (p // (S*W)) * S + p % S`. S = 1 is round-robin.
One virtual block of B*W global tokens is one page id shared by all ranks, B local tokens on each.

Example, S=2, W=2, L=7: owners 0 0 1 1 0 0 1 -> local_context_lens [4, 3].
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class DcpLayout:
    """How one request's KV tokens are split over the W ranks of a DCP group: W = dcp_size ranks, S = interleave
    consecutive tokens per turn, B = page_size tokens per page on each rank (1 <= S <= B, B % S == 0). Checked
    once here; hashable, so device code takes it as a static argument."""

    dcp_size: int
    interleave: int
    page_size: int

    def __post_init__(self):
        for name in ("dcp_size", "interleave", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {name}={value!r}")
        if self.interleave > self.page_size or self.page_size % self.interleave:
            raise ValueError(f"interleave must divide page_size and be <= it, got interleave={self.interleave}, "
                             f"page_size={self.page_size}")

    @property
    def tokens_per_block(self) -> int:
        """Global tokens of one virtual block (one page id): B * W."""
        return self.page_size * self.dcp_size

    def owner(self, pos) -> np.ndarray:
        """int32: the DCP rank holding global token position(s) `pos`."""
        pos = np.asarray(pos, dtype=np.int64)
        return ((pos // self.interleave) % self.dcp_size).astype(np.int32)

    def local_index(self, pos) -> np.ndarray:
        """int32: the index of global position(s) `pos` inside its owner's local token sequence."""
        pos = np.asarray(pos, dtype=np.int64)
        s = self.interleave
        return ((pos // (s * self.dcp_size)) * s + pos % s).astype(np.int32)

    def global_index(self, local_idx, rank) -> np.ndarray:
        """int32, the inverse of (owner, local_index): the global position of local index `local_idx` on `rank`."""
        local_idx = np.asarray(local_idx, dtype=np.int64)
        rank = np.asarray(rank, dtype=np.int64)
        if np.any((rank < 0) | (rank >= self.dcp_size)):
            raise ValueError(f"rank must be in [0, dcp_size={self.dcp_size}), got {rank}")
        s = self.interleave
        return (((local_idx // s) * self.dcp_size + rank) * s + local_idx % s).astype(np.int32)

    def local_context_lens(self, context_lens) -> np.ndarray:
        """int32 [W, rows]: how many of the first `context_lens[r]` tokens each rank holds.

        base = (L // (S*W)) * S full rounds per rank, plus the partial round: clamp(L - base*W - w*S, 0, S).
        S=1, W=4, L=[0, 3, 9]: [[0, 1, 3], [0, 1, 2], [0, 1, 2], [0, 0, 2]].
        """
        lens = np.asarray(context_lens, dtype=np.int64)
        if lens.ndim != 1:
            raise ValueError(f"context_lens must be 1-D, got shape {lens.shape}")
        if (lens < 0).any():
            raise ValueError(f"context_lens must be >= 0, got {lens}")
        s, w = self.interleave, self.dcp_size
        base = (lens // (s * w)) * s
        rem = (lens - base * w)[None, :] - np.arange(0, w * s, s, dtype=np.int64)[:, None]
        # np.minimum / np.maximum: np.clip costs ~3x their time on small arrays (this runs every step).
        return (base[None, :] + np.minimum(np.maximum(rem, 0), s)).astype(np.int32)

    def virtual_blocks(self, tokens):
        """Virtual blocks (one page id each, B * W global tokens) that hold `tokens` tokens (vectorized)."""
        return -(-np.asarray(tokens, dtype=np.int64) // self.tokens_per_block)

    def slot_mapping(self, positions, block_tables, table_rows=None) -> np.ndarray:
        """int32 [W, *positions.shape]: physical slot `page * B + offset` of each position's token on every rank.

        `positions [R, ...]` global positions (-1 for pads), `block_tables [M, P]` virtual-block page ids
        of each sequence, `table_rows [R]` the sequence of each row of positions (default: row r reads table r).
        The owner gets `block_tables[seq, li // B] * B + li % B` with li = local_index(p); every other rank, and
        pads, get -1 (no write).
        """
        positions = np.asarray(positions, dtype=np.int64)
        block_tables = np.asarray(block_tables)
        table_rows = np.arange(positions.shape[0]) if table_rows is None else np.asarray(table_rows)
        if positions.ndim < 1 or block_tables.ndim != 2 or table_rows.shape != positions.shape[:1]:
            raise ValueError(f"need positions [R, ...], block_tables [S, P] and table_rows [R]; got "
                             f"{positions.shape=}, {block_tables.shape=}, {table_rows.shape=}")
        valid = positions >= 0
        # One divmod per step of owner(p) = (p // S) % W and local_index(p) = (p // (S*W)) * S + p % S.
        turn, within = np.divmod(np.maximum(positions, 0), self.interleave)
        rounds, owner = np.divmod(turn, self.dcp_size)
        block, offset = np.divmod(rounds * self.interleave + within, self.page_size)
        max_blocks = block_tables.shape[1]
        if (valid & (block >= max_blocks)).any():
            raise ValueError(f"a position needs virtual block past block_tables width {max_blocks}")
        rows = table_rows.reshape((-1,) + (1,) * (positions.ndim - 1))
        pages = block_tables[rows, np.minimum(block, max_blocks - 1)].astype(np.int64)
        if (valid & (pages < 0)).any():
            raise ValueError("a position maps to an unallocated virtual block (page id -1)")
        ranks = np.arange(self.dcp_size).reshape((-1,) + (1,) * positions.ndim)
        owned = valid[None] & (owner[None] == ranks)
        return np.where(owned, (pages * self.page_size + offset)[None], -1).astype(np.int32)
