"""One sparse DCP decode attention layer, per rank (call inside shard_map over the mesh of `mesh.py`).

Per rank (h = H/tp local heads, W = dcp size, pages/B = this rank's KV pool):
  x [R, D] replicated; kv_cache [pages, B, C+E]; index_cache [pages, B, J];
  positions, local_lens, slots [R]; block_tables [R, P].
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dcp_jax.attention import exchange, projections
from dcp_jax.attention.kernels import Kernels
from dcp_jax.attention.params import AttentionParams
from dcp_jax.config import ModelConfig
from dcp_jax.mesh import DCP, HEADS


@dataclasses.dataclass(frozen=True)
class DcpLayout:
    """Static placement parameters of the KV shards."""

    dcp: int
    interleave: int
    page_size: int


def write_slots(cache, slots, values):
    """cache [pages, B, X] with values [R, X] written at physical slots [R]; slot -1 writes nothing."""
    pages, page_size, width = cache.shape
    flat = cache.reshape(pages * page_size, width)
    target = jnp.where(slots >= 0, slots, pages * page_size)  # out of range -> dropped
    flat = flat.at[target].set(values.astype(cache.dtype), mode="drop")
    return flat.reshape(cache.shape)


def sparse_dcp_attention(
    p: AttentionParams,
    x,
    kv_cache,
    index_cache,
    cos_sin,
    local_lens,
    slots,
    block_tables,
    *,
    cfg: ModelConfig,
    layout: DcpLayout,
    kernels: Kernels,
):
    """Returns (attention output [R, D] summed over all TP ranks, kv_cache, index_cache, the global top-k
    positions [R, K] selected for each row (-1 padded, identical on every rank))."""
    cos, sin = cos_sin
    rank = jax.lax.axis_index(DCP)
    # 1. Projections for every row on every rank; the new token's entries are written by its owner only.
    with jax.named_scope("projections"):
        q_resid, q_nope, q_pe = projections.mla_query(p, x, cos, sin, cfg)
        index_q = projections.index_query(p, q_resid, cos, sin, cfg)
        weights = projections.index_weights(p, x, cfg)
        kv_cache = write_slots(kv_cache, slots, projections.mla_latent(p, x, cos, sin, cfg))
        index_cache = write_slots(index_cache, slots, projections.index_key(p, x, cos, sin, cfg))
    # 2. Local logits over this rank's index-K shard, bounded by the host-provided local lengths.
    with jax.named_scope("indexer"):
        logits = kernels.indexer_logits(index_q, weights, index_cache, block_tables, local_lens)
    # 3. Local top-k.
    with jax.named_scope("topk"):
        values, local_ids = kernels.topk(logits, local_lens, k=cfg.index_topk)
    # 4. Candidate exchange -> the same global top-k on every rank.
    with jax.named_scope("exchange"):
        selected = exchange.exchange_top_k(
            values, local_ids, rank, k=cfg.index_topk, dcp=layout.dcp, interleave=layout.interleave
        )
    # 5. Owner filter: the selected tokens this rank holds, as compacted slots.
    with jax.named_scope("owner_filter"):
        owned_slots, counts = exchange.owner_filter(
            selected, block_tables, rank, dcp=layout.dcp, interleave=layout.interleave, page_size=layout.page_size
        )
    # 6. Sparse MLA over owned slots for the heads of the whole DCP group.
    with jax.named_scope("sparse_mla"):
        q = jax.lax.all_gather(projections.absorb_query(p, q_nope, q_pe), DCP, axis=1, tiled=True)
        out, lse = kernels.sparse_mla_decode(
            q.astype(kv_cache.dtype), kv_cache, owned_slots, counts, cfg.softmax_scale, value_dim=cfg.kv_lora_rank
        )
    # 7. LSE merge back to this rank's heads, then W_UV, o_proj and the TP all-reduce.
    with jax.named_scope("merge"):
        latent_out = exchange.merge_partial_attention(out, lse).astype(x.dtype)
        attn = jax.lax.psum(projections.output_projection(p, latent_out), HEADS)
    return attn, kv_cache, index_cache, selected
