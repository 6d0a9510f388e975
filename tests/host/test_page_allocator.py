"""dcp_jax/page_allocator.py: pages are never lost or handed out twice; block tables read as int32 arrays."""

import numpy as np
import pytest

from dcp_jax.host.page_allocator import BlockTable, PageAllocator


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
