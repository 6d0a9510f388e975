"""Test helper: what a KV cache's pools take on one DCP rank."""

import jax


def bytes_per_rank(cache) -> dict[str, int]:
    """Bytes of each pool of a `kv_cache.KVCache` (all layers) held by one DCP rank."""
    return {name: sum(a.nbytes // a.shape[0] for a in jax.tree.leaves(pool)) for name, pool in cache.pools.items()}
