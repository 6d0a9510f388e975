"""DSA's sparse attention under DCP, the attention variant of DeepSeek-V3.2 and GLM-5.x (`SPARSE_MLA`; GLM-5.2's
layers without an indexer run `SHARED_SELECTION`): one layer over the query rows of a step, per rank (call inside
shard_map over the mesh of `mesh.py`). A row is a decode row or one token of a prefill chunk: both run the same
data flow, each row with its own host-given local causal length; a chunk's tokens are all written before any row
scores, so each row sees the tokens before it.

Per rank (h = H/tp local heads, W = dcp size, pages/B = this rank's KV pool):
  x [R, D] replicated; the pools "latent" [pages, B, C+E] (exact) or its `Fp8LatentCache` and "index_k"
  [pages, B, J] (exact) or its `Fp8IndexKeys` (`cache_formats.py`); md the rank's view of the step's `StepMetadata`
  (local_context_lens and slot_mapping [R], block_tables [M, P], query_seqs [R]); rope the (cos, sin) of
  md.positions.
`backend` names the kernels' implementation (`pallas_kernels.BACKENDS`: "pallas" or "reference").
Letters: see the legend in `dcp_jax/__init__.py`.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import jax
import jax.numpy as jnp

import pallas_kernels
from dcp_jax.config import ModelConfig, check_index_cache
from dcp_jax.host.layout import DcpLayout
from dcp_jax.host import arrays
from dcp_jax.host.step_metadata import StepMetadata
from dcp_jax.model.attention import cache_formats, exchange, mla_dcp, params, projections
from dcp_jax.model.attention.params import DsaParams, MlaParams
from dcp_jax.model.attention.variant import AttentionVariant, CacheFormats, CachePool
from dcp_jax.model.mesh import DCP


class Queries(NamedTuple):
    """Per-row query-side projections of step 1 (local heads h, index heads I)."""

    q_nope: jax.Array  # [R, h, N]
    q_pe: jax.Array  # [R, h, E], roped
    index_q: jax.Array  # [R, I, J]
    index_weights: jax.Array  # [R, I] f32, scales folded in


# The stages of one layer, in data-flow order; `sparse_dcp_attention` runs them all, benchmarks run prefixes.


def project_and_write(p, x, kv_cache, index_cache, rope, slots, *, cfg: ModelConfig, backend: str,
                      index_slots=None):
    """1. Projections for every row on every rank (`backend` the kernels': the fp8 GEMM's, `fp8_linear.einsum`);
    the new token's latent and index key (each in its cache's format) are written by its owner only (slot -1
    elsewhere), the key at `index_slots` (the index pool's slots of this layer; default `slots`, where the layer's
    entries of both pools are the same). Returns (Queries, kv_cache, index_cache)."""
    cos, sin = rope
    q_resid, q_nope, q_pe, kv_cache = mla_dcp.project_and_write(p, x, kv_cache, rope, slots, cfg=cfg,
                                                                backend=backend)
    queries = Queries(q_nope, q_pe, projections.index_query(p, q_resid, cos, sin, cfg, backend=backend),
                      projections.index_weights(p, x, cfg))
    index_keys = cache_formats.encode_index_keys(projections.index_key(p, x, cos, sin, cfg, backend=backend),
                                                 index_cache)
    index_cache = mla_dcp.write_slots(index_cache, slots if index_slots is None else index_slots, index_keys)
    return queries, kv_cache, index_cache


def local_top_k(queries: Queries, index_cache, md: StepMetadata, *, cfg: ModelConfig, backend: str):
    """2-3. This rank's top-k of its indexer logits (fused where the kernels allow): (scores [R, K], local token
    ids [R, K], -1 padded), in column order: the exchange sorts the merged candidates anyway."""
    q, weights = cache_formats.encode_index_queries(queries.index_q, queries.index_weights, index_cache)
    return pallas_kernels.indexer_top_k(q, weights, index_cache, mla_dcp.row_block_tables(md),
                                        md.local_context_lens, k=cfg.indexer.topk, sorted=False, backend=backend)


def select_owned(values, local_ids, md: StepMetadata, *, cfg: ModelConfig, layout: DcpLayout):
    """4-5. Candidate exchange -> the global top-k positions [R, K] (identical on every rank), then this rank's
    share of them as compacted slots [R, K] and counts [R]."""
    rank = jax.lax.axis_index(DCP)
    selected = exchange.exchange_top_k(values, local_ids, rank, k=cfg.indexer.topk, layout=layout)
    owned_slots, counts = exchange.owner_filter(selected, mla_dcp.row_block_tables(md), rank, layout=layout)
    return selected, owned_slots, counts


def attend(p, q_nope, q_pe, kv_cache, owned_slots, counts, *, cfg: ModelConfig, backend: str):
    """6. Sparse MLA over the owned slots for the heads of the whole DCP group: (out [R, W*h, C], lse [R, W*h])."""
    q = mla_dcp.group_queries(p, q_nope, q_pe)
    return pallas_kernels.sparse_mla_decode(cache_formats.cast_query(q, kv_cache), kv_cache, owned_slots, counts,
                                            cfg.softmax_scale, value_dim=cfg.kv_lora_rank, backend=backend)


def _attend_rows(p, queries: Queries, kv_cache, index_cache, md: StepMetadata, index_md: StepMetadata, *,
                 cfg: ModelConfig, layout: DcpLayout, backend: str, dtype):
    """Stages 2-7 for some rows (their queries, their metadata on the latent pool's and the index pool's pages):
    (attention output [r, D], selected [r, K])."""
    with jax.named_scope("indexer_topk"):
        values, local_ids = local_top_k(queries, index_cache, index_md, cfg=cfg, backend=backend)
    with jax.named_scope("exchange"):
        selected, owned_slots, counts = select_owned(values, local_ids, md, cfg=cfg, layout=layout)
    with jax.named_scope("sparse_mla"):
        out, lse = attend(p, queries.q_nope, queries.q_pe, kv_cache, owned_slots, counts, cfg=cfg, backend=backend)
    with jax.named_scope("merge"):
        return mla_dcp.merge_heads(p, out, lse, dtype, backend=backend), selected


def sparse_dcp_attention(p: DsaParams, x, kv_cache, index_cache, rope, md: StepMetadata, *, cfg: ModelConfig,
                         layout: DcpLayout, backend: str, micro_batches: int = 1, index_md: StepMetadata | None = None):
    """Returns (attention output [R, D] summed over all TP ranks, kv_cache, index_cache, the global top-k
    positions [R, K] selected for each row (-1 padded, identical on every rank)). md is on this layer's latent
    pages, index_md on its index-key pages (default md: the same entry of both pools). With `micro_batches` = 2
    (two-batch overlap, TBO) every row's keys are written first, then the rows run stages 2-7 as independent chains
    of consecutive rows (`micro_batch_rows`; `arrays.rows_view`: a micro-batch reads the rows the host built for
    it), so the scheduler can run one chain's collectives (the candidate exchange, the query all-gather, the TP
    all-reduce) beside the other's compute."""
    index_md = md if index_md is None else index_md
    with jax.named_scope("projections"):
        queries, kv_cache, index_cache = project_and_write(p, x, kv_cache, index_cache, rope, md.slot_mapping,
                                                           cfg=cfg, backend=backend, index_slots=index_md.slot_mapping)
    outputs, ranges = [], mla_dcp.micro_batch_rows(x.shape[0], micro_batches)
    for index, rows in enumerate(ranges):
        with jax.named_scope(f"micro_batch_{index}") if len(ranges) > 1 else contextlib.nullcontext():
            outputs.append(_attend_rows(p, Queries(*(q[rows] for q in queries)), kv_cache, index_cache,
                                        arrays.rows_view(md, rows), arrays.rows_view(index_md, rows), cfg=cfg,
                                        layout=layout, backend=backend, dtype=x.dtype))
    attn, selected = (jnp.concatenate(parts) if len(parts) > 1 else parts[0] for parts in zip(*outputs))
    return attn, kv_cache, index_cache, selected


def shared_selection_attention(p: MlaParams, x, kv_cache, rope, md: StepMetadata, selection, *, cfg: ModelConfig,
                               layout: DcpLayout, backend: str, micro_batches: int = 1):
    """A layer without an indexer (IndexShare, `SharedSparseMla`): MLA's projections and the latent's write (stage
    1 without the indexer), then each row attends to `selection` [R, K], the global positions the most recent full
    layer selected (already exchanged: identical on every rank), of which this rank takes its share (stage 5 alone,
    no second exchange), then stages 6-7. Returns (attention output [R, D] summed over all TP ranks, kv_cache)."""
    with jax.named_scope("projections"):
        _, q_nope, q_pe, kv_cache = mla_dcp.project_and_write(p, x, kv_cache, rope, md.slot_mapping, cfg=cfg,
                                                              backend=backend)
    rank = jax.lax.axis_index(DCP)
    outputs, ranges = [], mla_dcp.micro_batch_rows(x.shape[0], micro_batches)
    for index, rows in enumerate(ranges):
        with jax.named_scope(f"micro_batch_{index}") if len(ranges) > 1 else contextlib.nullcontext():
            rows_md = arrays.rows_view(md, rows)
            with jax.named_scope("owner_filter"):
                owned_slots, counts = exchange.owner_filter(selection[rows], mla_dcp.row_block_tables(rows_md), rank,
                                                            layout=layout)
            with jax.named_scope("sparse_mla"):
                out, lse = attend(p, q_nope[rows], q_pe[rows], kv_cache, owned_slots, counts, cfg=cfg,
                                  backend=backend)
            with jax.named_scope("merge"):
                outputs.append(mla_dcp.merge_heads(p, out, lse, x.dtype, backend=backend))
    return jnp.concatenate(outputs) if len(outputs) > 1 else outputs[0], kv_cache


class SparseMla(AttentionVariant):
    """DeepSeek-V3.2's attention: MLA over the indexer's top-k (`sparse_dcp_attention`), caching each token's latent
    ("latent") and its index key ("index_k")."""

    name = "dsa"
    params_class = DsaParams
    pool_names = ("latent", "index_k")

    def layer_variant(self, cfg, layer):
        """A shared layer of IndexShare (`ModelConfig.shares_index_selection`) runs `SHARED_SELECTION`."""
        return SHARED_SELECTION if cfg.shares_index_selection(layer) else self

    def init_params(self, cfg, key, dtype):
        return params.init_dsa_params(cfg, key, dtype)

    def partition_specs(self):
        return DsaParams(**params.mla_partition_specs(), **params.indexer_partition_specs())

    def cache_pools(self, cfg, formats: CacheFormats) -> tuple[CachePool, ...]:
        check_index_cache(formats.index)
        head_dim = cfg.indexer.head_dim
        return (
            mla_dcp.latent_pool(cfg, formats.latent),
            CachePool("index_k", formats.index,
                      lambda shape, dtype: cache_formats.zero_index_keys((*shape, head_dim), formats.index, dtype),
                      lambda itemsize: cache_formats.index_key_bytes(formats.index, head_dim, itemsize)),
        )

    def attend(self, p, x, pools, rope, mds, *, ctx, selection):
        out, latent, index_k, selected = sparse_dcp_attention(
            p, x, pools["latent"], pools["index_k"], rope, mds["latent"], cfg=ctx.cfg, layout=ctx.layout,
            backend=ctx.backend, micro_batches=ctx.micro_batches, index_md=mds["index_k"])
        return out, dict(pools, latent=latent, index_k=index_k), selected

    def hf_tensor_shapes(self, cfg):
        return params.mla_tensor_shapes(cfg) | params.indexer_tensor_shapes(cfg)

    def to_ours(self, cfg, tensors):
        return params.mla_to_ours(cfg, tensors) | params.indexer_to_ours(cfg, tensors)

    def to_hf(self, cfg, weights):
        return params.mla_to_hf(cfg, weights) | params.indexer_to_hf(cfg, weights)

    def fp8_scales_to_ours(self, cfg, scales, block):
        return params.mla_fp8_scales_to_ours(cfg, scales, block) | params.indexer_fp8_scales_to_ours(scales)

    def fp8_problems(self, cfg, block):
        return params.mla_fp8_problems(cfg, block)

    @property
    def fp8_tensors(self) -> tuple[str, ...]:
        """The attention tensors DeepSeek's block-fp8 release stores in e4m3."""
        return params.MLA_FP8_TENSORS + params.INDEXER_FP8_TENSORS


SPARSE_MLA = SparseMla()
# What the architecture registry reads (`architecture.Architecture.attention_file`).
VARIANT = SPARSE_MLA


class SharedSelectionMla(mla_dcp.MlaOnlyVariant):
    """A DSA layer without an indexer (GLM-5.2's IndexShare "shared" layers): MLA over the selection of the most
    recent full layer (`shared_selection_attention`), caching only its latent; MLA's weights alone."""

    name = "dsa_shared"

    def attend(self, p, x, pools, rope, mds, *, ctx, selection):
        """The layer's output, its pools and, as the positions attended, `selection` itself."""
        out, latent = shared_selection_attention(p, x, pools["latent"], rope, mds["latent"], selection, cfg=ctx.cfg,
                                                 layout=ctx.layout, backend=ctx.backend,
                                                 micro_batches=ctx.micro_batches)
        return out, dict(pools, latent=latent), selection


SHARED_SELECTION = SharedSelectionMla()
