"""MLA under DCP, the pieces every MLA variant shares (the sparse `sparse_dcp.py`, the dense `dense_dcp.py`), per
rank inside shard_map: the projections and the new latent's write, writing a token's cache entry at its owner's
slot, each row's page table, the absorbed queries of the whole DCP group's heads, the LSE merge back to this rank's
heads with the output projection, the rows of two-batch overlap's micro-batches; the latent pool, and the weights
and pool of a variant whose layers hold MLA's weights alone (`MlaOnlyVariant`: the dense variant, IndexShare's
shared layers).
Letters: see the legend in `dcp_jax/__init__.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dcp_jax.config import ModelConfig
from dcp_jax.host.step_metadata import StepMetadata
from dcp_jax.model.attention import cache_formats, exchange, params, projections
from dcp_jax.model.attention.params import MlaParams
from dcp_jax.model.attention.variant import AttentionVariant, CacheFormats, CachePool
from dcp_jax.model.mesh import DCP, HEADS


def project_and_write(p, x, kv_cache, rope, slots, *, cfg: ModelConfig, backend: str):
    """MLA's projections for every row on every rank (`backend` the kernels': the fp8 GEMM's); the new token's latent
    (in the cache's format) is written by its owner only (slot -1 elsewhere). Returns (q_resid [R, Q] (what the
    indexer's query reads), q_nope [R, h, N], roped q_pe [R, h, E], kv_cache)."""
    cos, sin = rope
    q_a, ckv = projections.low_rank_projections(p, x, cfg, backend=backend)
    q_resid, q_nope, q_pe = projections.mla_query(p, q_a, cos, sin, cfg, backend=backend)
    latents = cache_formats.encode_latents(projections.mla_latent(p, ckv, cos, sin, cfg), kv_cache)
    return q_resid, q_nope, q_pe, write_slots(kv_cache, slots, latents)


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


def latent_pool(cfg: ModelConfig, latent_format: str) -> CachePool:
    """The pool of each token's MLA latent ("latent") in `latent_format` (ValueError for one the config cannot
    take)."""
    cache_formats.check_latent_format(latent_format, cfg)
    return CachePool("latent", latent_format,
                     lambda shape, dtype: cache_formats.zero_latents(shape, cfg, latent_format, dtype),
                     lambda itemsize: cache_formats.latent_bytes(latent_format, cfg, itemsize))


class MlaOnlyVariant(AttentionVariant):
    """A variant whose layers hold MLA's weights alone (`MlaParams`, HF's MLA tensors) and cache the latent alone;
    subclasses give its name and its `attend`."""

    params_class = MlaParams
    pool_names = ("latent",)

    def init_params(self, cfg, key, dtype):
        return params.init_mla_params(cfg, key, dtype)

    def partition_specs(self):
        return MlaParams(**params.mla_partition_specs())

    def cache_pools(self, cfg, formats: CacheFormats) -> tuple[CachePool, ...]:
        return (latent_pool(cfg, formats.latent),)

    def hf_tensor_shapes(self, cfg):
        return params.mla_tensor_shapes(cfg)

    def to_ours(self, cfg, tensors):
        return params.mla_to_ours(cfg, tensors)

    def to_hf(self, cfg, weights):
        return params.mla_to_hf(cfg, weights)

    def fp8_scales_to_ours(self, cfg, scales, block):
        return params.mla_fp8_scales_to_ours(cfg, scales, block)

    def fp8_problems(self, cfg, block):
        return params.mla_fp8_problems(cfg, block)

    @property
    def fp8_tensors(self) -> tuple[str, ...]:
        """The attention tensors DeepSeek's block-fp8 release stores in e4m3."""
        return params.MLA_FP8_TENSORS
