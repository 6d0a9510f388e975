"""The indexer's logits and their top-k, with the top-k's first pass fused into the Mosaic indexer.

`indexer_top_k` = `topk(indexer_logits(...), lens, k)`. Where the Mosaic GPU indexer applies, it also emits the
maxima of each row's groups of 16 consecutive tokens, which the top-k takes in place of its own maxima pass (a
read of the whole logits row, 6 us at B=64 L=64K on an H200). That needs N / 16 groups (N = the row's token
width) to be a power of two from k's next power of two (a floor from fewer groups would not bound the k-th
score) up to MAX_GROUPS (the top-k loads them all into each candidates program).
"""

from __future__ import annotations

from pallas_kernels import indexer, indexer_mosaic, topk

MAX_GROUPS = 8192


def fuses_group_maxima(q, k_cache, k_scale, block_tables, k: int, *, interpret=None) -> bool:
    """Whether `indexer_top_k` takes the fused path for these inputs."""
    groups = block_tables.shape[1] * k_cache.shape[1] // indexer_mosaic.GROUP_TOKENS
    return (indexer.mosaic_applies(q, k_cache, k_scale, interpret=interpret)
            and topk.next_pow2(k) <= groups <= MAX_GROUPS and not groups & (groups - 1))


def indexer_top_k(q, weights, k_cache, block_tables, lens, *, k: int, k_scale=None, sorted=True, interpret=None):
    """Top-k (values f32 [R, k], indices int32 [R, k]) of the indexer logits; the contracts of
    `indexer.indexer_logits` and `topk.topk` (`sorted=False`: column order)."""
    if fuses_group_maxima(q, k_cache, k_scale, block_tables, k, interpret=interpret):
        logits, maxima = indexer.indexer_logits_and_group_maxima(q, weights, k_cache, block_tables, lens,
                                                                 k_scale=k_scale)
        return topk.topk(logits, lens, k, sorted=sorted, interpret=False, group_maxima=maxima)
    logits = indexer.indexer_logits(q, weights, k_cache, block_tables, lens, k_scale=k_scale, interpret=interpret)
    return topk.topk(logits, lens, k, sorted=sorted, interpret=interpret)
