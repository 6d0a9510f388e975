"""Device KV pools by name: the pools an architecture's attention variant caches (`AttentionVariant.cache_pools`:
DSA's "latent" and "index_k"), each in its format, split along tokens over "dcp", and whole pages exported from
and imported into them.

A pool holds an entry for each layer that caches in it (`pool_layers`: every layer, except where an architecture's
layers differ, as IndexShare's shared layers keep no index key): [W, entries, pages, B, ...] (W over "dcp": rank w's
own tokens; the MTP layer's entry after the decoder layers' when drafting). One page id names the same page of
every entry and every rank (a virtual block of B * W tokens, `host/layout.py`).
Page export / import (`gather_pages`, `scatter_pages`; compiled per page-count bucket by the runner): the pages of
host-built page ids, every pool, every entry, every rank, as [W, entries, n, B, ...] arrays sharded like the pools;
-1 ids are pads (export zeros, import nothing).
Letters: see the legend in `dcp_jax/__init__.py`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from dcp_jax.config import EngineConfig, ModelConfig
from dcp_jax.host.step_metadata import StepMetadata
from dcp_jax.model import architecture
from dcp_jax.model.attention import cache_formats
from dcp_jax.model.attention.variant import CacheFormats, CachePool
from dcp_jax.model.mesh import DCP, sharding


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    # Pool name -> [W, entries, pages, B, ...] (a plain array or a pytree in the pool's format, every leaf with
    # these leading axes; `cache_formats.py`).
    pools: dict

    @property
    def _leading(self) -> tuple[int, ...]:
        return cache_formats.leading_shape(next(iter(self.pools.values())))

    def entries(self, name: str) -> int:
        """The layer entries pool `name` holds (`pool_layers`)."""
        return cache_formats.leading_shape(self.pools[name])[1]

    @property
    def num_pages(self) -> int:
        return self._leading[2]

    @property
    def page_size(self) -> int:
        return self._leading[3]

    def local_pools(self) -> dict:
        """Per rank (inside shard_map, W = 1 local shard): each pool with its entries folded into the pages axis,
        [entries * pages, B, ...] (free: a reshape): entry e owns pages e * pages .. (e + 1) * pages - 1, which
        `on_layer` moves a step's page ids and slots to. The layers of a scan write into one buffer in place."""
        return jax.tree.map(lambda a: a.reshape(-1, *a.shape[3:]), self.pools)

    def with_local_pools(self, folded: dict) -> KVCache:
        """Per rank: this cache's layout holding the folded pools of `local_pools`."""
        return KVCache(jax.tree.map(lambda new, old: new.reshape(old.shape), folded, self.pools))


def on_layer(md: StepMetadata, entry, *, num_pages: int, page_size: int) -> StepMetadata:
    """md with its page ids (block_tables) and write slots (slot_mapping) moved to entry `entry`'s pages of a folded
    pool (`KVCache.local_pools`); -1 entries stay -1. `entry` may come from a scan's traced counter (`entry_table`):
    the shift is a constant per layer, the host's per-step indices are otherwise untouched."""
    def shift(ids, by):
        return jnp.where(ids >= 0, ids + by, ids)

    first_page = entry * num_pages
    return md._replace(block_tables=shift(md.block_tables, first_page),
                       slot_mapping=shift(md.slot_mapping, first_page * page_size))


def cache_pools(cfg: ModelConfig, engine: EngineConfig) -> tuple[CachePool, ...]:
    """The pools of `cfg`'s attention variant in `engine`'s cache formats."""
    return architecture.of(cfg).attention.cache_pools(cfg, CacheFormats(engine.latent_cache, engine.index_cache))


def pool_layers(cfg: ModelConfig, name: str, layers: int) -> list[int]:
    """The layers, of the first `layers` (the decoder layers, then the MTP layer's), with an entry in pool `name`:
    those whose attention variant caches in it (`AttentionVariant.pool_names`), in order (entry i is the i-th)."""
    attention = architecture.of(cfg).attention
    return [layer for layer in range(layers) if name in attention.layer_variant(cfg, layer).pool_names]


def entry_table(cfg: ModelConfig, name: str, layers: int) -> np.ndarray:
    """[layers] int32: each layer's entry in pool `name` (`pool_layers`), -1 where it has none."""
    table = np.full(layers, -1, np.int32)
    held = pool_layers(cfg, name, layers)
    table[held] = np.arange(len(held), dtype=np.int32)
    return table


def kv_cache_specs(pools) -> KVCache:
    """The PartitionSpecs of a KVCache of these pools (`CachePool`s or names): split along W over "dcp", replicated
    over the DCP groups (a prefix spec for every leaf)."""
    return KVCache({getattr(pool, "name", pool): P(DCP) for pool in pools})


def allocate_kv_cache(cfg: ModelConfig, engine: EngineConfig, dcp: int, mesh: Mesh, dtype=jnp.float32) -> KVCache:
    """Zero-filled pools (`cache_pools`: exact ones of `dtype`), created directly in their sharded placement; an
    entry for each of `engine.kv_layers` layers that caches in the pool (`pool_layers`; the MTP layer's last)."""
    placed = sharding(mesh, P(DCP))

    def zeros(pool):
        entries = len(pool_layers(cfg, pool.name, engine.kv_layers(cfg)))
        return jax.jit(lambda: pool.zeros((dcp, entries, engine.num_pages, engine.page_size), dtype),
                       out_shardings=placed)()

    return KVCache({pool.name: zeros(pool) for pool in cache_pools(cfg, engine)})


# ---- page export / import ---------------------------------------------------------------------------------------


def page_buckets(max_pages: int) -> tuple[int, ...]:
    """The page counts an export or import program is compiled for: powers of two below `max_pages`, and it."""
    counts = []
    count = 1
    while count < max_pages:
        counts.append(count)
        count *= 2
    return (*counts, max_pages)


def gather_pages(cache: KVCache, page_ids) -> KVCache:
    """The pages `page_ids` [n] int32 of every pool, entry and rank: [W, entries, n, B, ...] each; -1 (a pad)
    gives zeros."""
    num_pages = cache.num_pages
    ids = jnp.where(page_ids >= 0, page_ids, num_pages)  # out of range: filled with zeros
    return KVCache(jax.tree.map(lambda a: jnp.take(a, ids, axis=2, mode="fill", fill_value=0), cache.pools))


def scatter_pages(cache: KVCache, pages: KVCache, page_ids) -> KVCache:
    """`cache` with `pages` ([W, entries, n, B, ...] each, `gather_pages`' of another cache of these pools and page
    size) written at `page_ids` [n] int32; -1 writes nothing."""
    num_pages = cache.num_pages
    ids = jnp.where(page_ids >= 0, page_ids, num_pages)  # out of range: dropped

    def write(pool, new):
        return pool.at[:, :, ids].set(new.astype(pool.dtype), mode="drop")

    return KVCache(jax.tree.map(write, cache.pools, pages.pools))
