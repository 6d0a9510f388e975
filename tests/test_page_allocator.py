"""dcp_jax/page_allocator.py: pages are never lost or handed out twice."""

import pytest

from dcp_jax.page_allocator import PageAllocator


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
    pool.free(b)
    assert pool.num_free == 8 and pool.num_used == 0


def test_failed_allocation_takes_nothing():
    pool = PageAllocator(4)
    pool.allocate(3)
    with pytest.raises(ValueError):
        pool.allocate(2)
    assert pool.num_free == 1
