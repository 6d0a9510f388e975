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
    # [layers, W, pages, B, C+E]: rank w's latent pool (normed latent c, then roped k_pe).
    latent: jax.Array
    # [layers, W, pages, B, J]: rank w's indexer key pool.
    index_k: jax.Array


# Split along W over "dcp", replicated over the DCP groups.
KV_CACHE_SPECS = KVCache(latent=P(None, DCP), index_k=P(None, DCP))


def allocate_kv_cache(cfg: ModelConfig, engine: EngineConfig, dcp: int, mesh: Mesh, dtype=jnp.float32) -> KVCache:
    """Zero-filled pools, created directly in their sharded placement."""
    shapes = KVCache(
        latent=(cfg.num_hidden_layers, dcp, engine.num_pages, engine.page_size, cfg.latent_dim),
        index_k=(cfg.num_hidden_layers, dcp, engine.num_pages, engine.page_size, cfg.index_head_dim),
    )

    def zeros(shape, spec):
        return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding(mesh, spec))()

    return jax.tree.map(zeros, shapes, KV_CACHE_SPECS, is_leaf=lambda x: isinstance(x, tuple))


def kv_bytes_per_rank(cache: KVCache) -> dict[str, int]:
    """Bytes of each pool held by one DCP rank."""
    return {
        f.name: getattr(cache, f.name).nbytes // getattr(cache, f.name).shape[1] for f in dataclasses.fields(cache)
    }
