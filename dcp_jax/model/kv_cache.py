"""Device KV pools: the MLA latent cache and the indexer key cache (in `EngineConfig.latent_cache`'s and
`EngineConfig.index_cache`'s formats), split along tokens over "dcp"."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from dcp_jax.config import EngineConfig, ModelConfig
from dcp_jax.host.metadata import StepMetadata
from dcp_jax.model.attention import cache_formats
from dcp_jax.model.mesh import DCP, sharding
from pallas_kernels import Fp8IndexKeys, Fp8LatentCache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    # latent [W, L, pages, B, C+E]: rank w's latent pool of every layer (normed latent c, then roped k_pe); in the
    # fp8 format `Fp8LatentCache` of [W, L, pages, B, C] e4m3, [W, L, pages, B, C/128] f32 scales and
    # [W, L, pages, B, E] bf16.
    latent: jax.Array | Fp8LatentCache
    # index_k [W, L, pages, B, J]: rank w's indexer key pool of every layer; in the fp8 format `Fp8IndexKeys` of
    # [W, L, pages, B, J] e4m3 keys and [W, L, pages, B] f32 scales.
    index_k: jax.Array | Fp8IndexKeys

    @property
    def num_layers(self) -> int:
        return cache_formats.leading_shape(self.latent)[1]

    @property
    def num_pages(self) -> int:
        return cache_formats.leading_shape(self.latent)[2]

    @property
    def page_size(self) -> int:
        return cache_formats.leading_shape(self.latent)[3]

    def local_pools(self):
        """Per rank (inside shard_map, W = 1 local shard): (latent, index_k) with the layers folded into the pages
        axis, [L * pages, B, ...] (free: a reshape): layer l owns pages l * pages .. (l + 1) * pages - 1, which
        `on_layer` moves a step's page ids and slots to. The layers of a scan write into one buffer in place."""
        def fold(a):
            return a.reshape(-1, *a.shape[3:])

        return jax.tree.map(fold, self.latent), jax.tree.map(fold, self.index_k)

    def with_local_pools(self, latent, index_k) -> KVCache:
        """Per rank: this cache's layout holding the folded pools of `local_pools`."""
        def unfold(new, old):
            return new.reshape(old.shape)

        return KVCache(jax.tree.map(unfold, latent, self.latent), jax.tree.map(unfold, index_k, self.index_k))


def on_layer(md: StepMetadata, layer, *, num_pages: int, page_size: int) -> StepMetadata:
    """md with its page ids (block_tables) and write slots (slot_mapping) moved to layer `layer`'s pages of the
    folded pools (`KVCache.local_pools`); -1 entries stay -1. `layer` may be a scan's traced counter: the shift is
    a constant per layer, the host's per-step indices are otherwise untouched."""
    def shift(ids, by):
        return jnp.where(ids >= 0, ids + by, ids)

    first_page = layer * num_pages
    return dataclasses.replace(md, block_tables=shift(md.block_tables, first_page),
                               slot_mapping=shift(md.slot_mapping, first_page * page_size))


# Split along W over "dcp", replicated over the DCP groups (a prefix spec for every leaf).
KV_CACHE_SPECS = KVCache(latent=P(DCP), index_k=P(DCP))


def allocate_kv_cache(cfg: ModelConfig, engine: EngineConfig, dcp: int, mesh: Mesh, dtype=jnp.float32) -> KVCache:
    """Zero-filled pools (latents in `engine.latent_cache`'s format, index keys in `engine.index_cache`'s; 'exact'
    ones of `dtype`), created directly in their sharded placement; `engine.kv_layers` layers (the MTP layer's
    last)."""
    pool = (dcp, engine.kv_layers(cfg), engine.num_pages, engine.page_size)
    placed = sharding(mesh, P(DCP))
    new_latent = jax.jit(lambda: cache_formats.zero_latents(pool, cfg, engine.latent_cache, dtype),
                         out_shardings=placed)
    new_index_k = jax.jit(lambda: cache_formats.zero_index_keys(pool + (cfg.index_head_dim,), engine.index_cache,
                                                                dtype), out_shardings=placed)
    return KVCache(latent=new_latent(), index_k=new_index_k())


def kv_bytes_per_rank(cache: KVCache) -> dict[str, int]:
    """Bytes of each pool (all layers) held by one DCP rank."""
    return {f.name: sum(a.nbytes // a.shape[0] for a in jax.tree.leaves(getattr(cache, f.name)))
            for f in dataclasses.fields(cache)}
