"""Device KV pools: the MLA latent cache and the indexer key cache, split along tokens over "dcp"."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from dcp_jax.config import EngineConfig, ModelConfig
from dcp_jax.mesh import DCP, sharding


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    # One buffer per layer, so each decode step scatters into (and donates) it in place, never restacking the
    # pool. latent[l] [W, pages, B, C+E]: rank w's latent pool (normed latent c, then roped k_pe).
    latent: tuple[jax.Array, ...]
    # index_k[l] [W, pages, B, J]: rank w's indexer key pool.
    index_k: tuple[jax.Array, ...]

    @property
    def num_pages(self) -> int:
        return self.latent[0].shape[1]

    @property
    def page_size(self) -> int:
        return self.latent[0].shape[2]

    def layer(self, i: int):
        """Per rank (inside shard_map, W = 1 local shard): layer i's (latent [pages, B, C+E], index_k [pages, B, J])."""
        return self.latent[i][0], self.index_k[i][0]


def from_layers(layers) -> KVCache:
    """Per rank: KVCache from per-layer (latent [pages, B, C+E], index_k [pages, B, J]) pairs."""
    return KVCache(latent=tuple(lat[None] for lat, _ in layers), index_k=tuple(idx[None] for _, idx in layers))


# Split along W over "dcp", replicated over the DCP groups (a prefix spec for every layer's buffer).
KV_CACHE_SPECS = KVCache(latent=P(DCP), index_k=P(DCP))


def allocate_kv_cache(cfg: ModelConfig, engine: EngineConfig, dcp: int, mesh: Mesh, dtype=jnp.float32) -> KVCache:
    """Zero-filled pools, created directly in their sharded placement."""

    def zeros(width):
        shape = (dcp, engine.num_pages, engine.page_size, width)
        return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding(mesh, P(DCP)))()

    layers = range(cfg.num_hidden_layers)
    return KVCache(latent=tuple(zeros(cfg.latent_dim) for _ in layers),
                   index_k=tuple(zeros(cfg.index_head_dim) for _ in layers))


def kv_bytes_per_rank(cache: KVCache) -> dict[str, int]:
    """Bytes of each pool (all layers) held by one DCP rank."""
    return {f.name: sum(a.nbytes // a.shape[0] for a in getattr(cache, f.name)) for f in dataclasses.fields(cache)}
