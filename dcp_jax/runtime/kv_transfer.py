"""A request's KV moved from one engine's pools to another's (prefill / decode disaggregation): the compiled programs
of a host-built relayout (`host/relayout.py`), one per bucket of page counts.

export (source mesh): `kv_cache.gather_pages` of the request's first virtual blocks (its block table's entries,
padded with -1 to a bucket of `kv_cache.page_buckets`): [Ws, entries, n, Bs, ...] a pool leaf, split as the pool.
transfer: `jax.device_put` onto the destination mesh, whole on each of its devices (two meshes of one process:
JAX's own transfer between device sets).
import (destination mesh): `relayout_pages` by the plan's places (host-built for the padded export, widened to a
bucket), then `kv_cache.scatter_pages` at the destination's block table (padded with -1), the pool donated.
Nothing in the programs derives a place: the host gives every index, and the buckets bound the compiles.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dcp_jax.host.layout import DcpLayout
from dcp_jax.host.relayout import padded_places, relayout_pages, relayout_plan
from dcp_jax.model.kv_cache import KVCache, gather_pages, page_buckets, scatter_pages


def _bucket(blocks: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket holding `blocks` virtual blocks (at least 1)."""
    fitting = [b for b in buckets if b >= max(blocks, 1)]
    if not fitting:
        raise ValueError(f"{blocks} virtual blocks exceed the largest bucket {buckets[-1]}")
    return fitting[0]


def _padded_ids(table, count: int) -> jnp.ndarray:
    """The first entries of a block table as int32 [count], -1 past its length."""
    table = np.asarray(table, np.int32)[:count]
    return jnp.asarray(np.pad(table, (0, count - len(table)), constant_values=-1))


def _import(cache: KVCache, exported: KVCache, places, page_ids) -> KVCache:
    pages = dataclasses.replace(exported, pools=jax.tree.map(lambda leaf: relayout_pages(leaf, places, jnp),
                                                            exported.pools))
    return scatter_pages(cache, pages, page_ids)


@dataclasses.dataclass(frozen=True)
class KvTransfer:
    """Moves requests' KV from pools of `source` layout on `source_mesh` to pools of `destination` layout on
    `destination_mesh`; `max_blocks` (source, destination) the longest request's virtual blocks on each side."""

    source: DcpLayout
    destination: DcpLayout
    source_mesh: Mesh
    destination_mesh: Mesh
    max_blocks: tuple[int, int]

    def __post_init__(self):
        object.__setattr__(self, "_export", jax.jit(gather_pages))
        object.__setattr__(self, "_import", jax.jit(_import, donate_argnums=0))

    def move(self, source_cache: KVCache, source_table, destination_cache: KVCache, destination_table,
             length: int) -> KVCache:
        """`destination_cache` (donated) with the request's first `length` tokens of `source_cache`, read at
        `source_table`'s virtual blocks, written where the destination layout keeps them in `destination_table`'s;
        the source pools are left as they are. Returns the destination's new pools."""
        needed = int(self.source.virtual_blocks(length))
        source_blocks = _bucket(needed, page_buckets(self.max_blocks[0]))
        plan = relayout_plan(self.source, self.destination, length, source_blocks)
        destination_blocks = _bucket(plan.destination_blocks, page_buckets(self.max_blocks[1]))
        if len(source_table) < needed or len(destination_table) < plan.destination_blocks:
            raise ValueError(f"{length} tokens fill {needed} source and {plan.destination_blocks} destination "
                             f"virtual blocks; the tables have {len(source_table)} and {len(destination_table)}")
        exported = self._export(source_cache, _padded_ids(source_table, source_blocks))
        whole = NamedSharding(self.destination_mesh, P())
        arrived, places = jax.device_put((exported, jnp.asarray(padded_places(plan, destination_blocks))), whole)
        return self._import(destination_cache, arrived, places, _padded_ids(destination_table, destination_blocks))

    def compiled_programs(self) -> int:
        """Export and import programs compiled so far (one of each a bucket)."""
        return self._export._cache_size() + self._import._cache_size()
