"""dcp_jax/model/kv_cache.py: KV pools by name (the attention variant's cache spec), and whole pages exported from one
runner's pools and imported into another's (`ModelRunner.export_pages` / `import_pages`): the importing runner
decodes the same next tokens from them, on other devices, with other page ids. f32 on CPU (exact)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dcp_jax.config import TINY, EngineConfig, ParallelConfig
from dcp_jax.model.deepseek_v32 import init_params
from dcp_jax.model.kv_cache import allocate_kv_cache, cache_pools, gather_pages, page_buckets, scatter_pages
from dcp_jax.model.mesh import make_mesh
from dcp_jax.runtime import oracle
from dcp_jax.runtime.runner import ModelRunner

ENGINE = EngineConfig(page_size=4, num_pages=12, max_num_seqs=2, max_model_len=40, bucket_ladder=(2, 16),
                      max_num_batched_tokens=16)
PARALLEL = ParallelConfig(tp=2, dcp=2, interleave=2)
PROMPT = [5, 9, 17, 3, 88, 41, 7, 250, 13, 2, 64, 300, 12, 6, 77, 19, 1, 45, 23, 8, 99]  # 21 > index_topk 16


def test_the_pools_are_the_variants_by_name_in_their_formats():
    fp8 = EngineConfig(page_size=4, num_pages=3, latent_cache="fp8", index_cache="fp8")
    cache = allocate_kv_cache(TINY, fp8, 2, make_mesh(ParallelConfig(tp=2, dcp=2)))
    assert list(cache.pools) == [pool.name for pool in cache_pools(TINY, fp8)] == ["latent", "index_k"]
    assert (cache.entries("latent"), cache.entries("index_k"), cache.num_pages, cache.page_size) == (
        TINY.num_hidden_layers, TINY.num_hidden_layers, 3, 4)
    assert cache.pools["index_k"].keys.dtype == jnp.float8_e4m3fn
    assert [pool.format for pool in cache_pools(TINY, fp8)] == ["fp8", "fp8"]


def test_gather_then_scatter_moves_exactly_the_pages_asked_for():
    cache = allocate_kv_cache(TINY, ENGINE, 2, make_mesh(PARALLEL))
    filled = jax.tree.map(lambda a: jnp.arange(a.size, dtype=a.dtype).reshape(a.shape), cache)
    pages = gather_pages(filled, jnp.array([7, 2, -1], jnp.int32))  # -1: a pad, zeros
    latent = pages.pools["latent"]
    assert latent.shape[:4] == (2, TINY.num_hidden_layers, 3, 4)
    np.testing.assert_array_equal(latent[:, :, 0], filled.pools["latent"][:, :, 7])
    np.testing.assert_array_equal(latent[:, :, 1], filled.pools["latent"][:, :, 2])
    assert not np.asarray(latent[:, :, 2]).any()
    moved = scatter_pages(cache, pages, jnp.array([0, 11, -1], jnp.int32))
    for name in cache.pools:
        got, want = np.asarray(moved.pools[name]), np.asarray(filled.pools[name])
        np.testing.assert_array_equal(got[:, :, 0], want[:, :, 7])
        np.testing.assert_array_equal(got[:, :, 11], want[:, :, 2])
        assert not np.delete(got, [0, 11], axis=2).any()  # the pad wrote nothing
    assert page_buckets(12) == (1, 2, 4, 8, 12)


@pytest.fixture(scope="module")
def runners():
    """Two runners of one model: the first on devices 0-1, the second on devices 2-3."""
    params = init_params(TINY, seed=3)
    devices = jax.devices()
    return [ModelRunner(TINY, params, PARALLEL, ENGINE, make_mesh(PARALLEL, devices[first:first + 2]), "reference")
            for first in (0, 2)]


def test_exported_pages_imported_into_another_runner_give_the_same_next_tokens(runners):
    source, target = runners
    blocks = int(source.layout.virtual_blocks(len(PROMPT) + 3))
    source_pages, target_pages = [9, 4, 6][:blocks], [1, 10, 3][:blocks]
    _, _, first = oracle.prefill(source, [PROMPT], [source_pages])
    pages = source.export_pages(source_pages)
    assert jax.tree.leaves(pages)[0].shape[2] == 4  # padded to the page-count bucket of 3 pages
    target.import_pages(pages, target_pages)
    tokens, lens = [int(first[0])], [len(PROMPT) + 1]
    for _ in range(3):  # the next tokens decoded on each side from its own pages
        want = oracle.decode(source, tokens, lens, [source_pages])
        got = oracle.decode(target, tokens, lens, [target_pages])
        np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)
        assert got[2].tolist() == want[2].tolist()
        tokens, lens = [int(want[2][0])], [lens[0] + 1]
    assert len(source._page_programs) == 1 and len(target._page_programs) == 1  # one program per bucket
    source.export_pages([0, 1, 2])  # the same bucket: no new program
    assert len(source._page_programs) == 1


def test_page_ids_and_foreign_pages_are_refused(runners):
    source, target = runners
    for bad in ([], [3, 3], [-1], [12]):
        with pytest.raises(ValueError, match="page ids must be distinct, in \\[0, 12\\)"):
            source.export_pages(bad)
    with pytest.raises(ValueError, match="take a bucket of 1 pages; the export holds 2"):
        target.import_pages(source.export_pages([0, 1]), [5])
    other = allocate_kv_cache(TINY, EngineConfig(page_size=4, num_pages=12, latent_cache="fp8"), 2,
                              make_mesh(PARALLEL))
    with pytest.raises(ValueError, match="not of this runner's pools"):
        target.import_pages(gather_pages(other, jnp.array([0, 1], jnp.int32)), [0, 1])
