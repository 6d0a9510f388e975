"""pallas_kernels.indexer_top_k: the indexer's top-k, with the group maxima fused into the Mosaic indexer on the GPU;
elsewhere the plain composition of the Triton kernels."""

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import _indexer_mosaic, _topk_triton, reference
from tests.kernels.test_indexer import FP8, _case


def test_unfused_matches_reference():
    """On CPU: the interpreted indexer, then the top-k, against reference.indexer_top_k (f32: same logits up to
    rounding, far from ties on random data)."""
    lens = [0, 5, 64, 200, 256]
    args = _case(8, rows=5, heads=8, dim=32, page_size=16, max_blocks=16, lens=lens, dtype=jnp.float32,
                 with_scale=True)
    assert pallas_kernels.choose("indexer_top_k", "pallas", *args, k=32) == "triton"
    for sorted_ in (True, False):
        values, indices = pallas_kernels.indexer_top_k(*args, k=32, sorted=sorted_)
        want_values, want_indices = reference.indexer_top_k(*args, k=32, sorted=sorted_)
        np.testing.assert_array_equal(np.asarray(indices), np.asarray(want_indices))
        np.testing.assert_allclose(np.asarray(values), np.asarray(want_values), rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("max_blocks, sorted_", [(512, True), (1024, False)])
def test_fused_matches_separate_kernels_on_gpu(max_blocks, sorted_):
    """The fused path returns exactly the top-k of the Mosaic indexer's logits, and its maxima are those of the
    logits' groups of 16 tokens."""
    full = max_blocks * 64
    lens = [0, 1000, full // 2 + 37, full]
    args = _case(9, rows=len(lens), heads=64, dim=128, page_size=64, max_blocks=max_blocks, lens=lens, dtype=FP8)
    q, weights, cache, tables, lens_ = args
    assert pallas_kernels.choose("indexer_top_k", "pallas", *args, k=2048) == "mosaic"
    assert _indexer_mosaic.fuses_group_maxima(cache.keys, tables, 2048)
    logits, maxima = _indexer_mosaic.indexer_logits_and_group_maxima(q, weights, cache.keys, tables, lens_,
                                                                     k_scale=cache.scales)
    np.testing.assert_array_equal(np.asarray(logits),
                                  np.asarray(pallas_kernels.indexer_logits(*args, backend="mosaic")))
    grouped = np.asarray(logits).reshape(len(lens), -1, 16).max(axis=2)
    np.testing.assert_array_equal(np.asarray(maxima), np.asarray(_topk_triton._to_key(jnp.asarray(grouped))))
    values, indices = pallas_kernels.indexer_top_k(*args, k=2048, sorted=sorted_)
    want_values, want_indices = pallas_kernels.topk(logits, lens_, k=2048, sorted=sorted_, backend="triton")
    np.testing.assert_array_equal(np.asarray(indices), np.asarray(want_indices))
    np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))
