"""KV relayout between two DCP layouts (prefill / decode disaggregation): where each of a request's tokens goes, as a
host-built index (numpy), for any source and destination layout.

A layout (W ranks, interleave S, page size B: `layout.DcpLayout`) keeps global token p on rank owner(p), at local
index l = local_index(p): in the request's virtual block l // B (its block table's entry, one page id on every
rank) at slot l % B. The source side exports the request's first n_src virtual blocks of every pool and entry,
in block-table order (`kv_cache.gather_pages`: [Ws, entries, n_src, Bs, ...]); read as one token array of
Ws * n_src * Bs places, token p sits at flat place (owner * n_src + l // Bs) * Bs + l % Bs. The plan gives each
destination place [Wd, n_dst, Bd] the flat source place of its token, -1 past the request's length
(`RelayoutPlan.source_place`); the destination takes them (`relayout_pages`) and writes its pages
(`kv_cache.scatter_pages`). Page ids never enter the plan: the two block tables pick the pages on each side.
Any layout to any other: DCP N to M, DCP to plain TP (W = 1), interleave and page-size changes.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dcp_jax.host.layout import DcpLayout


@dataclasses.dataclass(frozen=True)
class RelayoutPlan:
    """The relayout of a request of `length` tokens from `source` to `destination` (module docstring)."""

    source: DcpLayout
    destination: DcpLayout
    length: int
    # n_src: the virtual blocks the source exports (the first ones of its block table).
    source_blocks: int
    # int32 [Wd, n_dst, Bd]: each destination place's flat place in the exported [Ws, n_src, Bs] tokens, -1 for none.
    source_place: np.ndarray

    @property
    def destination_blocks(self) -> int:
        """n_dst: the virtual blocks the destination writes (the first ones of its block table)."""
        return self.source_place.shape[1]


def relayout_plan(source: DcpLayout, destination: DcpLayout, length: int,
                  source_blocks: int | None = None) -> RelayoutPlan:
    """The plan of a request's first `length` tokens from `source` to `destination`, the source exporting
    `source_blocks` virtual blocks (default: the ones its tokens fill; more: a compiled program's bucket)."""
    if not isinstance(length, (int, np.integer)) or isinstance(length, bool) or length < 0:
        raise ValueError(f"length must be an int >= 0; got {length!r}")
    needed = int(source.virtual_blocks(length))
    source_blocks = needed if source_blocks is None else source_blocks
    if source_blocks < needed:
        raise ValueError(f"source_blocks={source_blocks} < the {needed} virtual blocks {length} tokens fill")
    tokens = np.arange(length, dtype=np.int64)
    source_local = source.local_index(tokens).astype(np.int64)
    flat = (source.owner(tokens) * source_blocks + source_local // source.page_size) * source.page_size \
        + source_local % source.page_size
    place = np.full((destination.dcp_size, int(destination.virtual_blocks(length)), destination.page_size), -1,
                    np.int32)
    local = destination.local_index(tokens).astype(np.int64)
    place[destination.owner(tokens), local // destination.page_size, local % destination.page_size] = flat
    return RelayoutPlan(source, destination, int(length), source_blocks, place)


def padded_places(plan: RelayoutPlan, destination_blocks: int) -> np.ndarray:
    """plan.source_place widened to `destination_blocks` virtual blocks (a compiled program's bucket), -1 past the
    plan's."""
    if destination_blocks < plan.destination_blocks:
        raise ValueError(f"destination_blocks={destination_blocks} < the plan's {plan.destination_blocks}")
    widen = destination_blocks - plan.destination_blocks
    return np.pad(plan.source_place, ((0, 0), (0, widen), (0, 0)), constant_values=-1)


def relayout_pages(exported, source_place, xp=np):
    """Exported pages [Ws, entries, n_src, Bs, ...] (one leaf of `gather_pages`) -> the destination's pages [Wd,
    entries, n_dst, Bd, ...] by `source_place` [Wd, n_dst, Bd] (`RelayoutPlan.source_place`, or `padded_places`'):
    each place takes its source token, zeros where -1. `xp` is numpy or jax.numpy (under jit: a gather)."""
    ranks, entries, blocks, page = exported.shape[:4]
    rest = exported.shape[4:]
    tokens = xp.moveaxis(exported, 1, 0).reshape(entries, ranks * blocks * page, *rest)
    places = xp.asarray(source_place)
    taken = xp.take(tokens, xp.maximum(places, 0).reshape(-1), axis=1)  # [entries, Wd * n_dst * Bd, ...]
    present = (places >= 0).reshape(1, -1, *(1,) * len(rest))
    taken = xp.where(present, taken, xp.zeros((), exported.dtype))
    return xp.moveaxis(taken.reshape(entries, *places.shape, *rest), 0, 1)
