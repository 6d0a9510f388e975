"""DCP placement of KV tokens across the ranks of a DCP group (host only: numpy, no jax).

Notation of the spec: W = dcp size, S = interleave, B = page size. Token p lives on rank
`owner(p) = (p // S) % W` at `local_index(p) = (p // (S*W)) * S + p % S`. S = 1 is round-robin.
One virtual block of B*W global tokens is one page id shared by all ranks, B local tokens on each.

Example, S=2, W=2, L=7: owners 0 0 1 1 0 0 1 -> local_context_lens [4, 3].
"""

from __future__ import annotations

import numpy as np


def check_layout(dcp: int, interleave: int, page_size: int | None = None) -> None:
    """Raise ValueError unless dcp >= 1, 1 <= interleave (<= page_size, page_size % interleave == 0)."""
    if int(dcp) < 1:
        raise ValueError(f"dcp_size must be >= 1, got dcp={dcp}")
    if int(interleave) < 1:
        raise ValueError(f"interleave must be >= 1, got interleave={interleave}")
    if page_size is not None:
        if int(page_size) < 1:
            raise ValueError(f"page_size must be >= 1, got page_size={page_size}")
        if interleave > page_size or page_size % interleave:
            raise ValueError(
                f"interleave must divide page_size and be <= it, got interleave={interleave}, "
                f"page_size={page_size}"
            )


def owner(pos, dcp: int, interleave: int = 1) -> np.ndarray:
    """DCP rank holding global token position(s) `pos`."""
    check_layout(dcp, interleave)
    pos = np.asarray(pos, dtype=np.int64)
    return ((pos // interleave) % dcp).astype(np.int32)


def local_index(pos, dcp: int, interleave: int = 1) -> np.ndarray:
    """Index of global position(s) `pos` inside its owner's local token sequence."""
    check_layout(dcp, interleave)
    pos = np.asarray(pos, dtype=np.int64)
    return ((pos // (interleave * dcp)) * interleave + pos % interleave).astype(np.int32)


def global_index(local_idx, rank, dcp: int, interleave: int = 1) -> np.ndarray:
    """Inverse of (owner, local_index): global position of local index `local_idx` on `rank`."""
    check_layout(dcp, interleave)
    local_idx = np.asarray(local_idx, dtype=np.int64)
    rank = np.asarray(rank, dtype=np.int64)
    if np.any((rank < 0) | (rank >= dcp)):
        raise ValueError(f"rank must be in [0, dcp={dcp}), got {rank}")
    return (((local_idx // interleave) * dcp + rank) * interleave + local_idx % interleave).astype(np.int32)


def local_context_lens(context_lens, dcp: int, interleave: int = 1) -> np.ndarray:
    """int32 [dcp, rows]: how many of the first `context_lens[r]` tokens each rank holds.

    base = (L // (S*W)) * S full rounds per rank, plus the partial round: clamp(L - base*W - w*S, 0, S).
    S=1, W=4, L=[0, 3, 9]: [[0, 1, 3], [0, 1, 2], [0, 1, 2], [0, 0, 2]].
    """
    check_layout(dcp, interleave)
    lens = np.asarray(context_lens, dtype=np.int64)
    if lens.ndim != 1:
        raise ValueError(f"context_lens must be 1-D, got shape {lens.shape}")
    if np.any(lens < 0):
        raise ValueError(f"context_lens must be >= 0, got {lens}")
    base = (lens // (interleave * dcp)) * interleave
    ranks = np.arange(dcp, dtype=np.int64)[:, None]
    rem = np.clip(lens[None, :] - base[None, :] * dcp - ranks * interleave, 0, interleave)
    return (base[None, :] + rem).astype(np.int32)


def virtual_blocks(tokens, dcp: int, page_size: int):
    """Virtual blocks (one page id each, page_size * dcp global tokens) that hold `tokens` tokens (vectorized)."""
    return -(-np.asarray(tokens, dtype=np.int64) // (page_size * dcp))


def slot_mapping(positions, block_tables, dcp: int, interleave: int, page_size: int) -> np.ndarray:
    """int32 [dcp, rows]: physical slot `page * page_size + offset` of each row's token on every rank.

    `positions [rows]` global positions (-1 for pad rows), `block_tables [rows, max_blocks]` virtual-block page
    ids. The owner gets `block_tables[r, li // B] * B + li % B` with li = local_index(p); every other rank, and
    pad rows, get -1 (no write).
    """
    check_layout(dcp, interleave, page_size)
    positions = np.asarray(positions, dtype=np.int64)
    block_tables = np.asarray(block_tables)
    if positions.ndim != 1 or block_tables.ndim != 2 or block_tables.shape[0] != positions.shape[0]:
        raise ValueError(f"need positions [R] and block_tables [R, P]; got {positions.shape=}, {block_tables.shape=}")
    valid = positions >= 0
    pos = np.where(valid, positions, 0)
    li = local_index(pos, dcp, interleave).astype(np.int64)
    block = li // page_size
    if np.any(valid & (block >= block_tables.shape[1])):
        raise ValueError(f"a position needs virtual block past block_tables width {block_tables.shape[1]}")
    rows = np.arange(positions.shape[0])
    pages = block_tables[rows, np.minimum(block, block_tables.shape[1] - 1)].astype(np.int64)
    if np.any(valid & (pages < 0)):
        raise ValueError("a position maps to an unallocated virtual block (page id -1)")
    slot = pages * page_size + li % page_size
    ranks = np.arange(dcp)[:, None]
    owned = valid[None, :] & (owner(pos, dcp, interleave)[None, :] == ranks)
    return np.where(owned, slot[None, :], -1).astype(np.int32)
