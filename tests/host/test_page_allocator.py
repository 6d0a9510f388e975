"""dcp_jax/host/page_allocator.py: pages are never lost or handed out twice; shared pages are counted; cached
blocks are found by their prefix and evicted least recently used first; block tables read as int32 arrays."""

import collections
import random

import numpy as np
import pytest

from dcp_jax.host.page_allocator import BlockTable, PageAllocator, block_hashes


def test_allocate_and_free_round_trip():
    pool = PageAllocator(8)
    a, b = pool.allocate(3), pool.allocate(5)
    assert sorted(a + b) == list(range(8)) and pool.num_free == 0
    with pytest.raises(ValueError, match="only 0 free"):
        pool.allocate(1)
    pool.free(a)
    assert pool.num_free == 3 and pool.num_used == 5
    with pytest.raises(ValueError, match="not all in use"):
        pool.free(a)  # double free leaves the pool unchanged
    with pytest.raises(ValueError, match="not all in use"):
        pool.free([b[0], b[0]])  # one hold, freed twice: nothing freed
    pool.free(b)
    assert pool.num_free == 8 and pool.num_used == 0


def test_failed_allocation_takes_nothing():
    pool = PageAllocator(4)
    pool.allocate(3)
    with pytest.raises(ValueError):
        pool.allocate(2)
    assert pool.num_free == 1


def test_block_table_grows_and_reads_as_an_int32_array():
    table = BlockTable([7, 3])
    for page in range(40):  # past the first buffer: growth keeps the ids in order
        table.extend([page])
    table.extend([])
    ids = [7, 3] + list(range(40))
    assert len(table) == 42 and list(table) == ids and table == ids
    view = np.asarray(table)
    assert view.dtype == np.int32 and view.tolist() == ids and not view.flags.writeable
    assert np.asarray(table, np.int64).flags.writeable  # another dtype is a copy
    assert table.clear() == ids and len(table) == 0 and not table
    table.extend([5])
    assert table == [5]


def test_block_hashes_name_prefixes():
    """Full blocks only; a block's hash depends on every token before it, so equal hashes mean equal prefixes."""
    a = block_hashes([1, 2, 3, 4, 5, 6, 7], 3)
    assert len(a) == 2
    assert block_hashes([1, 2, 3, 4, 5, 6], 3) == a  # the partial tail block has no hash
    assert block_hashes([1, 2, 3, 9, 9, 9], 3)[0] == a[0] and block_hashes([1, 2, 3, 9, 9, 9], 3)[1] != a[1]
    assert block_hashes([0, 2, 3, 4, 5, 6], 3)[1] != a[1]  # same second block, other first: another prefix
    assert block_hashes([1, 2], 3) == []


def test_cached_blocks_outlive_their_requests_until_evicted_lru():
    pool = PageAllocator(4, enable_prefix_caching=True)
    hashes = block_hashes(list(range(8)), 2)  # 4 blocks
    pages = pool.allocate(3)
    for page, h in zip(pages, hashes):
        pool.cache(page, h)
    pool.free(pages)
    assert pool.num_free == 4 and pool.num_used == 0 and pool.num_cached == 3
    again = pool.take_cached(hashes)  # the first three blocks' pages, the fourth block was never computed
    assert again == pages and pool.num_used == 3 and pool.num_free == 1
    shared = pool.take_cached(hashes[:2])  # a second request with the same first two blocks shares their pages
    assert shared == pages[:2] and pool.refs(pages[0]) == 2
    pool.free(again)
    pool.free(shared)
    assert pool.take_cached([block_hashes([9, 9], 2)[0]]) == []  # another prefix: nothing
    # Evicting: the free page first, then the least recently freed cached one (the third block's: its last hold
    # went first).
    fresh = pool.allocate(2)
    assert fresh[0] not in pages and fresh[1] == pages[2] and pool.num_cached == 2
    assert pool.take_cached(hashes) == pages[:2]  # the chain breaks at the evicted block
    pool.check_invariants(collections.Counter(fresh + pages[:2]))


def test_a_block_cached_already_keeps_its_page_and_caching_off_caches_nothing():
    pool = PageAllocator(4, enable_prefix_caching=True)
    h = block_hashes([1, 2], 2)[0]
    first, second = pool.allocate(2)
    pool.cache(first, h)
    pool.cache(second, h)  # the same block computed twice: the first page stays the cached one
    pool.free([first, second])
    assert pool.num_cached == 1 and pool.take_cached([h]) == [first]
    off = PageAllocator(2)
    (page,) = off.allocate(1)
    off.cache(page, h)
    off.free([page])
    assert off.num_cached == 0 and off.take_cached([h]) == [] and off.num_free == 2


@pytest.mark.parametrize("seed", range(3))
def test_random_sharing_and_eviction_never_lose_a_page(seed):
    rnd = random.Random(seed)
    pool = PageAllocator(12, enable_prefix_caching=True)
    prompts = [[rnd.randint(0, 2) for _ in range(8)] for _ in range(6)]  # few tokens: many shared prefixes
    tables = []
    for _ in range(300):
        if tables and rnd.random() < 0.45:
            pool.free(tables.pop(rnd.randrange(len(tables))))
        else:
            hashes = block_hashes(rnd.choice(prompts), 2)
            cached = pool.take_cached(hashes)
            need = len(hashes) - len(cached)
            if need > pool.num_free:
                pool.free(cached)
                continue
            table = cached + pool.allocate(need)
            for page, h in zip(table, hashes):
                pool.cache(page, h)
            tables.append(table)
        pool.check_invariants(collections.Counter(p for t in tables for p in t))
    for table in tables:
        pool.free(table)
    assert pool.num_used == 0 and pool.num_free == 12
