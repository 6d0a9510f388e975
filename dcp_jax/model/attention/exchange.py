"""Cross-rank pieces of sparse DCP decode that are not kernels: candidate merge, owner filter, LSE merge.

`merge_candidates` and `owner_filter` are pure functions of gathered buffers; `exchange_top_k` and
`merge_partial_attention` (weights from `pallas_kernels.lse_merge_weights`) run the collectives over the "dcp" mesh axis
(call them inside shard_map).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dcp_jax.host.layout import DcpLayout
from dcp_jax.model.mesh import DCP
from pallas_kernels import lse_merge_weights

HIGHEST = jax.lax.Precision.HIGHEST
NEG_INF = float("-inf")


def global_index(local_ids, rank, *, layout: DcpLayout):
    """jnp twin of `DcpLayout.global_index` for ids found on `rank`; -1 stays -1."""
    dcp, interleave = layout.dcp_size, layout.interleave
    gpos = ((local_ids // interleave) * dcp + rank) * interleave + local_ids % interleave
    return jnp.where(local_ids >= 0, gpos, -1).astype(jnp.int32)


def merge_candidates(values, ids, *, k):
    """Global top-k from per-rank candidates: score descending, then global id ascending; -1 ids last.

    values [W, R, Kc] f32, ids [W, R, Kc] int32 global positions (-1 = none). Returns [R, k] each,
    padded with (-inf, -1). Every rank runs this on the identical gathered buffer, so all agree.
    """
    num_ranks, rows, kc = values.shape
    flat_values = jnp.moveaxis(values, 0, 1).reshape(rows, num_ranks * kc)
    flat_ids = jnp.moveaxis(ids, 0, 1).reshape(rows, num_ranks * kc)
    is_valid = flat_ids >= 0
    neg_score = jnp.where(is_valid, -flat_values, jnp.inf)
    id_key = jnp.where(is_valid, flat_ids, jnp.iinfo(jnp.int32).max)
    neg_score, id_key = jax.lax.sort((neg_score, id_key), dimension=1, num_keys=2)
    neg_score, id_key = neg_score[:, :k], id_key[:, :k]
    is_kept = id_key != jnp.iinfo(jnp.int32).max
    return jnp.where(is_kept, -neg_score, NEG_INF), jnp.where(is_kept, id_key, -1).astype(jnp.int32)


def owner_filter(ids, block_tables, rank, *, layout: DcpLayout):
    """Selected global ids this rank owns, as compacted physical slots.

    ids [R, K] int32 global positions (-1 = none), block_tables [R, P] int32 virtual-block page ids,
    rank: this rank (may be traced). Returns slots int32 [R, K] (`page*B + offset`, owned entries first in
    their original order, then -1) and counts int32 [R].
    """
    rows, k = ids.shape
    dcp, interleave, page_size = layout.dcp_size, layout.interleave, layout.page_size
    is_owned = (ids >= 0) & ((ids // interleave) % dcp == rank)
    local = jnp.where(is_owned, (ids // (interleave * dcp)) * interleave + ids % interleave, 0)
    block = jnp.clip(local // page_size, 0, block_tables.shape[1] - 1)
    page = jnp.take_along_axis(block_tables, block, axis=1)
    slot = page * page_size + local % page_size
    # Destination of each owned entry = number of owned entries before it; the rest go past the end.
    dest = jnp.where(is_owned, jnp.cumsum(is_owned, axis=1) - 1, k)
    slots = jnp.full((rows, k + 1), -1, jnp.int32)
    slots = slots.at[jnp.arange(rows)[:, None], dest].set(jnp.where(is_owned, slot, -1).astype(jnp.int32))
    return slots[:, :k], is_owned.sum(axis=1).astype(jnp.int32)


def exchange_top_k(values, local_ids, rank, *, k, layout: DcpLayout):
    """Per rank: local top-k (values [R, K], local ids [R, K]) -> the identical global top-k ids [R, k] on
    every rank of the DCP group. All-gathers 8 * W * K bytes per row."""
    ids = global_index(local_ids, rank, layout=layout)
    all_values = jax.lax.all_gather(values, DCP)  # [W, R, K]
    all_ids = jax.lax.all_gather(ids, DCP)
    return merge_candidates(all_values, all_ids, k=k)[1]


def merge_partial_attention(out, lse):
    """Per rank: out [R, W*h, C], lse [R, W*h] over this rank's owned tokens -> merged out [R, h, C] of
    this rank's own h heads. All-gathers lse, then reduce-scatters the rescaled outputs over heads."""
    weights, _ = lse_merge_weights(jax.lax.all_gather(lse, DCP), axis=0)  # [W, R, W*h]
    factor = weights[jax.lax.axis_index(DCP)]
    return jax.lax.psum_scatter(factor[..., None] * out, DCP, scatter_dimension=1, tiled=True)
