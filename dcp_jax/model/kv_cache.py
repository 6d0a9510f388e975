"""Device KV pools: the MLA latent cache and the indexer key cache (in `EngineConfig.latent_cache`'s and
`EngineConfig.index_cache`'s formats), split along tokens over "dcp"."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from dcp_jax.config import EngineConfig, ModelConfig
from dcp_jax.model.attention import cache_formats
from dcp_jax.model.mesh import DCP, sharding
from pallas_kernels import Fp8IndexKeys, Fp8LatentCache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    # One buffer per layer, so each decode step scatters into (and donates) it in place, never restacking the
    # pool. latent[l] [W, pages, B, C+E]: rank w's latent pool (normed latent c, then roped k_pe); in the fp8
    # format `Fp8LatentCache` of [W, pages, B, C] e4m3, [W, pages, B, C/128] f32 scales and [W, pages, B, E] bf16.
    latent: tuple[jax.Array | Fp8LatentCache, ...]
    # index_k[l] [W, pages, B, J]: rank w's indexer key pool; in the fp8 format `Fp8IndexKeys` of [W, pages, B, J]
    # e4m3 keys and [W, pages, B] f32 scales.
    index_k: tuple[jax.Array | Fp8IndexKeys, ...]

    @property
    def num_pages(self) -> int:
        return cache_formats.leading_shape(self.latent[0])[1]

    @property
    def page_size(self) -> int:
        return cache_formats.leading_shape(self.latent[0])[2]

    def layer(self, i: int):
        """Per rank (inside shard_map, W = 1 local shard): layer i's (latent [pages, B, C+E], index_k [pages, B, J],
        each or its fp8 form)."""
        return jax.tree.map(lambda a: a[0], self.latent[i]), jax.tree.map(lambda a: a[0], self.index_k[i])


def from_layers(layers) -> KVCache:
    """Per rank: KVCache from per-layer (latent [pages, B, C+E], index_k [pages, B, J], each or its fp8 form)
    pairs."""
    return KVCache(latent=tuple(jax.tree.map(lambda a: a[None], lat) for lat, _ in layers),
                   index_k=tuple(jax.tree.map(lambda a: a[None], idx) for _, idx in layers))


# Split along W over "dcp", replicated over the DCP groups (a prefix spec for every layer's buffer).
KV_CACHE_SPECS = KVCache(latent=P(DCP), index_k=P(DCP))


def allocate_kv_cache(cfg: ModelConfig, engine: EngineConfig, dcp: int, mesh: Mesh, dtype=jnp.float32) -> KVCache:
    """Zero-filled pools (latents in `engine.latent_cache`'s format, index keys in `engine.index_cache`'s; 'exact'
    ones of `dtype`), created directly in their sharded placement."""
    pool = (dcp, engine.num_pages, engine.page_size)
    placed = sharding(mesh, P(DCP))
    new_latent = jax.jit(lambda: cache_formats.zero_latents(pool, cfg, engine.latent_cache, dtype),
                         out_shardings=placed)
    new_index_k = jax.jit(lambda: cache_formats.zero_index_keys(pool + (cfg.index_head_dim,), engine.index_cache,
                                                                dtype), out_shardings=placed)
    layers = range(cfg.num_hidden_layers)
    return KVCache(latent=tuple(new_latent() for _ in layers), index_k=tuple(new_index_k() for _ in layers))


def kv_bytes_per_rank(cache: KVCache) -> dict[str, int]:
    """Bytes of each pool (all layers) held by one DCP rank."""
    return {f.name: sum(a.nbytes // a.shape[0] for a in jax.tree.leaves(getattr(cache, f.name)))
            for f in dataclasses.fields(cache)}
