"""The relayout plan (`dcp_jax/host/relayout.py`) by brute force against the layouts' own slot mappings: random
source and destination layouts (DCP N to M, to plain TP, interleave and page-size changes), random lengths (0, 1,
past a page, past a virtual block) and random block tables; then the same move of real KV pools between two meshes
of disjoint simulated devices, compiled."""

import numpy as np
import pytest

from dcp_jax.host.layout import DcpLayout
from dcp_jax.host.relayout import padded_places, relayout_pages, relayout_plan

ENTRIES, CHANNELS, SENTINEL = 2, 3, -7.0


def _random_layout(rng) -> DcpLayout:
    page = int(rng.choice([1, 2, 4, 8]))
    divisors = [s for s in (1, 2, 4, 8) if page % s == 0]
    return DcpLayout(int(rng.choice([1, 2, 3, 4, 8])), int(rng.choice(divisors)), page)


def _cache_of(layout: DcpLayout, length: int, table: np.ndarray, num_pages: int) -> np.ndarray:
    """[W, entries, pages, B, C]: token p's value (p + 1, times entry + 1) at the place `slot_mapping` gives its
    owner; SENTINEL everywhere else."""
    cache = np.full((layout.dcp_size, ENTRIES, num_pages, layout.page_size, CHANNELS), SENTINEL)
    positions = np.arange(length)
    slots = layout.slot_mapping(positions[None], table[None])[:, 0]  # [W, L]: -1 where another rank owns it
    for rank, token in zip(*np.nonzero(slots >= 0)):
        page, offset = divmod(int(slots[rank, token]), layout.page_size)
        cache[rank, :, page, offset] = (token + 1) * (np.arange(ENTRIES)[:, None] + 1)
    return cache


def _table(rng, layout: DcpLayout, length: int, num_pages: int) -> np.ndarray:
    blocks = max(int(layout.virtual_blocks(length)), 1)
    return rng.permutation(num_pages)[:blocks].astype(np.int32)


@pytest.mark.parametrize("seed", range(40))
def test_each_token_lands_where_the_destination_layout_keeps_it(seed):
    rng = np.random.default_rng(seed)
    source, destination = _random_layout(rng), _random_layout(rng)
    length = int(rng.choice([0, 1, int(rng.integers(2, 40)), int(rng.integers(40, 200))]))
    num_pages = 64 + 2 * length
    source_table, destination_table = (_table(rng, layout, length, num_pages) for layout in (source, destination))
    plan = relayout_plan(source, destination, length)
    assert plan.source_blocks == source.virtual_blocks(length)
    assert plan.destination_blocks == destination.virtual_blocks(length)
    exported = _cache_of(source, length, source_table, num_pages)[:, :, source_table[:plan.source_blocks]]
    pages = relayout_pages(exported, plan.source_place)
    received = np.full((destination.dcp_size, ENTRIES, num_pages, destination.page_size, CHANNELS), SENTINEL)
    received[:, :, destination_table[:plan.destination_blocks]] = pages
    want = _cache_of(destination, length, destination_table, num_pages)
    # Places of the written blocks that hold no token read 0 (nothing of the source's sentinel moves); the rest of
    # the pool is as it was.
    written = np.zeros(num_pages, bool)
    written[destination_table[:plan.destination_blocks]] = True
    want[:, :, written] = np.where(want[:, :, written] == SENTINEL, 0.0, want[:, :, written])
    np.testing.assert_array_equal(received, want)


def test_a_wider_bucket_and_the_refusals():
    plan = relayout_plan(DcpLayout(2, 1, 4), DcpLayout(4, 2, 2), 13)
    wide = padded_places(plan, 5)
    assert wide.shape == (4, 5, 2) and (wide[:, plan.destination_blocks:] == -1).all()
    assert (np.sort(wide[wide >= 0]) == np.sort(plan.source_place[plan.source_place >= 0])).all()
    with pytest.raises(ValueError, match="destination_blocks=1 < the plan's 2"):
        padded_places(plan, 1)
    with pytest.raises(ValueError, match="length must be an int >= 0"):
        relayout_plan(DcpLayout(2, 1, 4), DcpLayout(4, 2, 2), -1)


def test_pools_move_between_two_meshes_compiled():
    """tiny's latent and index-key pools (fp8 ones: codes and scales) of requests of 37, 50 and 70 tokens, DCP 2 on
    devices 0-1 to DCP 4, interleave 2, page 8 on devices 2-5 (`runtime.kv_transfer.KvTransfer`): every token's bytes
    are where the destination layout keeps them (the numpy plan's move), the rest of the pool as it was; one export
    and one import program a bucket of page counts (the first two requests share theirs)."""
    import jax
    import jax.numpy as jnp

    from dcp_jax.config import TINY, EngineConfig, ParallelConfig
    from dcp_jax.model.kv_cache import KVCache, allocate_kv_cache
    from dcp_jax.model.mesh import make_mesh
    from dcp_jax.runtime.kv_transfer import KvTransfer

    devices = jax.devices()
    source_layout, destination_layout = DcpLayout(2, 1, 4), DcpLayout(4, 2, 8)
    engines = [EngineConfig(page_size=layout.page_size, num_pages=24, latent_cache="fp8", index_cache="fp8")
               for layout in (source_layout, destination_layout)]
    source_mesh = make_mesh(ParallelConfig(tp=2, dcp=2), devices[:2])
    destination_mesh = make_mesh(ParallelConfig(tp=4, dcp=4, interleave=2), devices[2:6])
    source = allocate_kv_cache(TINY, engines[0], 2, source_mesh, jnp.float32)
    keys = iter(jax.random.split(jax.random.key(0), 8))
    source = KVCache(jax.tree.map(lambda a: jax.random.randint(next(keys), a.shape, -100, 100).astype(a.dtype),
                                  source.pools))
    transfer = KvTransfer(source_layout, destination_layout, source_mesh, destination_mesh, max_blocks=(24, 12))
    destination = allocate_kv_cache(TINY, engines[1], 4, destination_mesh, jnp.float32)
    written = set()
    for length, source_table, destination_table, programs in (
            (37, np.arange(23, 13, -1), [3, 9], 2), (50, np.arange(10), [5, 0], 2),
            (70, np.arange(14, 24), [1, 2, 4], 4)):
        sent = [np.asarray(leaf).astype(np.float32) for leaf in jax.tree.leaves(source.pools)]
        destination = transfer.move(source, source_table, destination, destination_table, length)
        assert transfer.compiled_programs() == programs, length
        plan = relayout_plan(source_layout, destination_layout, length)
        blocks = np.asarray(destination_table[:plan.destination_blocks])
        written |= set(blocks.tolist())
        for (path, got_leaf), sent_leaf in zip(jax.tree_util.tree_leaves_with_path(destination.pools), sent):
            got, name = np.asarray(got_leaf).astype(np.float32), jax.tree_util.keystr(path)
            exported = sent_leaf[:, :, np.asarray(source_table)[:plan.source_blocks]]
            np.testing.assert_array_equal(got[:, :, blocks], relayout_pages(exported, plan.source_place),
                                          err_msg=f"{name} {length}")
            assert not got[:, :, sorted(set(range(24)) - written)].any(), name
    with pytest.raises(ValueError, match="37 tokens fill 5 source and 2 destination virtual blocks"):
        transfer.move(source, np.arange(4), destination, [3, 9], 37)
