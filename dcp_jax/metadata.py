"""Per-step decode metadata: one declared pytree, one host builder, one host validator.

Every index the decode step needs (positions, lengths, per-rank local lengths, slots, block tables) is computed
here with numpy, padded to the bucket width R, and handed to the jitted step as a required input. jax is
imported only to register the pytree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from dcp_jax import layout


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeMetadata:
    # [R] int32, replicated: global position of the token each row decodes (context_len - 1). Pad rows 0.
    positions: np.ndarray | jax.Array
    # [R] int32, replicated: global context length of each row, the decoded token included. Pad rows 0.
    context_lens: np.ndarray | jax.Array
    # [W, R] int32, sharded over "dcp": tokens of row r held by rank w (sums to context_lens). Pad rows 0.
    local_context_lens: np.ndarray | jax.Array
    # [W, R] int32, sharded over "dcp": physical slot where rank w writes row r's new token; -1 = not the
    # owner (no write). Pad rows -1 on every rank.
    slot_mapping: np.ndarray | jax.Array
    # [R, P] int32, replicated: virtual-block page ids of each row (one id names the same page on every
    # rank); -1 = unallocated. Pad rows all -1.
    block_tables: np.ndarray | jax.Array

    @property
    def rows(self) -> int:
        """Bucket width R; selects the compiled program."""
        return self.context_lens.shape[0]


FIELDS = tuple(f.name for f in dataclasses.fields(DecodeMetadata))


def build_decode_metadata(
    context_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    *,
    bucket: int,
    dcp: int,
    interleave: int,
    page_size: int,
    max_blocks: int,
) -> DecodeMetadata:
    """Fill `DecodeMetadata` (numpy) for the scheduled rows, padded to `bucket` inert rows.

    context_lens[i]: global length of request i after this step's token is appended (>= 1).
    block_tables[i]: its virtual-block page ids (at least ceil(context_len / (page_size*dcp)) of them); arrays
    (and the engine's `page_allocator.BlockTable`) are copied as they are, lists converted (slow when long).
    """
    layout.check_layout(dcp, interleave, page_size)
    lens = np.asarray(context_lens, dtype=np.int64).reshape(-1)
    num_rows = lens.shape[0]
    if num_rows > bucket:
        raise ValueError(f"{num_rows} scheduled rows do not fit bucket {bucket}")
    if len(block_tables) != num_rows:
        raise ValueError(f"{len(block_tables)} block tables for {num_rows} rows")
    if np.any(lens < 1):
        raise ValueError(f"context_lens of scheduled rows must be >= 1, got {lens.tolist()}")
    padded_lens = np.zeros(bucket, np.int32)
    padded_lens[:num_rows] = lens
    tables = np.full((bucket, max_blocks), -1, np.int32)
    needed = layout.virtual_blocks(lens, dcp, page_size)
    for row, table in enumerate(block_tables):
        if needed[row] > max_blocks:
            raise ValueError(f"row {row}: context_len {lens[row]} needs {needed[row]} blocks > {max_blocks=}")
        if len(table) < needed[row]:
            raise ValueError(f"row {row}: context_len {lens[row]} needs {needed[row]} blocks, block table has "
                             f"{len(table)}")
        table = np.asarray(table, np.int32)[:max_blocks]
        tables[row, : len(table)] = table
    positions = np.where(padded_lens > 0, padded_lens - 1, 0).astype(np.int32)
    slot_positions = np.where(padded_lens > 0, padded_lens - 1, -1)
    return DecodeMetadata(
        positions=positions,
        context_lens=padded_lens,
        local_context_lens=layout.local_context_lens(padded_lens, dcp, interleave),
        slot_mapping=layout.slot_mapping(slot_positions, tables, dcp, interleave, page_size),
        block_tables=tables,
    )


def check_decode_metadata(md, *, buckets: Sequence[int], dcp: int, interleave: int, max_blocks: int,
                          page_size: int, num_pages: int) -> None:
    """Raise TypeError/ValueError unless `md` is a complete, well-shaped DecodeMetadata of a known bucket.

    Runs on the host before anything is traced. When the arrays are host (numpy) arrays it also checks their
    values: every virtual block a row's context needs names a page in [0, num_pages), no page is used by two
    rows (either would make a row read or overwrite another request's KV), and positions, local lengths and
    slots are exactly what `layout` gives for these context lengths and block tables.
    """
    if not isinstance(md, DecodeMetadata):
        raise TypeError(f"expected DecodeMetadata, got {type(md).__name__}")
    rows = np.shape(md.context_lens)[0] if np.ndim(md.context_lens) == 1 else None
    if rows not in buckets:
        raise ValueError(f"context_lens shape {np.shape(md.context_lens)} is not [R] for a bucket R in {list(buckets)}")
    expected = {
        "positions": (rows,),
        "context_lens": (rows,),
        "local_context_lens": (dcp, rows),
        "slot_mapping": (dcp, rows),
        "block_tables": (rows, max_blocks),
    }
    for name, shape in expected.items():
        value = getattr(md, name)
        if value is None or not hasattr(value, "shape") or not hasattr(value, "dtype"):
            raise TypeError(f"DecodeMetadata.{name} must be an array, got {type(value).__name__}")
        if tuple(value.shape) != shape:
            raise ValueError(f"DecodeMetadata.{name} has shape {tuple(value.shape)}, expected {shape}")
        if np.dtype(value.dtype) != np.int32:
            raise TypeError(f"DecodeMetadata.{name} has dtype {value.dtype}, expected int32")
    if not all(isinstance(getattr(md, name), np.ndarray) for name in FIELDS):
        return
    needed = layout.virtual_blocks(md.context_lens, dcp, page_size)  # virtual blocks in use per row
    in_use = np.arange(max_blocks)[None, :] < needed[:, None]
    bad = in_use & ((md.block_tables < 0) | (md.block_tables >= num_pages))
    if np.any(bad):
        row = int(np.argwhere(bad)[0, 0])
        raise ValueError(
            f"row {row}: block table {md.block_tables[row, : needed[row]].tolist()} needs page ids in "
            f"[0, num_pages={num_pages}) for its {int(needed[row])} blocks"
        )
    pages = md.block_tables[in_use]
    is_used = np.zeros(num_pages, np.bool_)  # O(pages), no sort: this runs before every step
    is_used[pages] = True
    if np.count_nonzero(is_used) != len(pages):
        uses = np.bincount(pages, minlength=num_pages)
        raise ValueError(f"page ids used by two blocks (one row or two): {np.flatnonzero(uses > 1)[:16].tolist()}")
    if np.any(md.context_lens < 0):
        raise ValueError(f"context_lens must be >= 0, got {md.context_lens.tolist()}")
    positions = np.where(md.context_lens > 0, md.context_lens - 1, 0)
    if not np.array_equal(md.positions, positions):
        raise ValueError(f"positions {md.positions.tolist()} must be context_lens - 1 (0 for pad rows)")
    local = layout.local_context_lens(md.context_lens, dcp, interleave)
    if not np.array_equal(md.local_context_lens, local):
        raise ValueError(f"local_context_lens {md.local_context_lens.tolist()} are not the layout's {local.tolist()} "
                         f"for context_lens {md.context_lens.tolist()} (dcp={dcp}, interleave={interleave})")
    slots = layout.slot_mapping(np.where(md.context_lens > 0, positions, -1), md.block_tables, dcp, interleave,
                                page_size)
    if not np.array_equal(md.slot_mapping, slots):
        raise ValueError(f"slot_mapping {md.slot_mapping.tolist()} is not the layout's {slots.tolist()}")
