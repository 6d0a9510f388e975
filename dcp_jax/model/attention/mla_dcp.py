"""MLA under DCP, the pieces every MLA variant shares (the sparse `sparse_dcp.py`, the dense `dense_dcp.py`), per
rank inside shard_map: writing a token's cache entry at its owner's slot, each row's page table, the absorbed
queries of the whole DCP group's heads, the LSE merge back to this rank's heads with the output projection, and
the rows of two-batch overlap's micro-batches.
Letters: see the legend in `dcp_jax/__init__.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dcp_jax.host.step_metadata import StepMetadata
from dcp_jax.model.attention import exchange, projections
from dcp_jax.model.mesh import DCP, HEADS


def write_slots(cache, slots, values):
    """cache [pages, B, ...] with values [R, ...] written at physical slots [R]; slot -1 writes nothing. A pytree
    cache (`Fp8IndexKeys`, `Fp8LatentCache`) takes values of the same structure, written leaf by leaf."""

    # In place on either platform: XLA GPU copied the whole pool for a (page, offset) scatter (bench decode's 27 GiB
    # pool ran an H100 out of memory), XLA CPU copies it around the flattening reshape (0.2 s a token).
    by_page = jax.default_backend() == "cpu"

    def write(pool, new):
        pages, page_size = pool.shape[:2]
        new = new.astype(pool.dtype)
        if by_page:
            page = jnp.where(slots >= 0, slots // page_size, pages)  # out of range -> dropped
            # Reads see this result, never the pool before it: XLA CPU rewrote a lone row's read-back to the old pool,
            # which then had to be copied whole.
            return jax.lax.optimization_barrier(pool.at[page, slots % page_size].set(new, mode="drop"))
        flat = pool.reshape(pages * page_size, *pool.shape[2:])
        target = jnp.where(slots >= 0, slots, pages * page_size)  # out of range -> dropped
        return flat.at[target].set(new, mode="drop").reshape(pool.shape)

    return jax.tree.map(write, cache, values)


def row_block_tables(md: StepMetadata):
    """[R, P]: the page ids of each row's sequence (the step's [M, P] tables gathered by query_seqs)."""
    return md.block_tables[md.query_seqs]


def group_queries(p, q_nope, q_pe):
    """The absorbed queries (`projections.absorb_query`) of the heads of the whole DCP group: [R, W*h, C+E], this
    rank's h heads at block `rank` (every rank attends its own tokens for all of them)."""
    return jax.lax.all_gather(projections.absorb_query(p, q_nope, q_pe), DCP, axis=1, tiled=True)


def merge_heads(p, out, lse, dtype, *, backend: str):
    """LSE merge back to this rank's h heads, W_UV, o_proj and the TP all-reduce: [R, D]."""
    latent_out = exchange.merge_partial_attention(out, lse).astype(dtype)
    return jax.lax.psum(projections.output_projection(p, latent_out, backend=backend), HEADS)


def micro_batch_rows(rows: int, micro_batches: int) -> list[slice]:
    """The static row ranges of `micro_batches` micro-batches of a step of `rows` rows (the first ones one row
    longer when it does not divide; fewer when there are fewer rows)."""
    count = max(1, min(micro_batches, rows))
    bounds = [rows * i // count for i in range(count + 1)]
    return [slice(bounds[i], bounds[i + 1]) for i in range(count)]
