"""pallas_kernels/indexer_topk.py: the indexer's top-k, with the group maxima fused into the Mosaic indexer on
the GPU; elsewhere the plain composition."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import indexer, indexer_topk, reference, topk
from tests.kernels.test_indexer import FP8, _case


def test_unfused_matches_reference():
    """On CPU: the interpreted indexer, then the top-k, against reference.indexer_top_k (f32: same logits up to
    rounding, far from ties on random data)."""
    lens = [0, 5, 64, 200, 256]
    args, kwargs = _case(8, rows=5, heads=8, dim=32, page_size=16, max_blocks=16, lens=lens, dtype=jnp.float32,
                         with_scale=True)
    assert not indexer_topk.fuses_group_maxima(args[0], args[2], kwargs["k_scale"], args[3], 32)
    for sorted_ in (True, False):
        values, indices = indexer_topk.indexer_top_k(*args, k=32, sorted=sorted_, **kwargs)
        want_values, want_indices = reference.indexer_top_k(*args, k=32, sorted=sorted_, **kwargs)
        np.testing.assert_array_equal(np.asarray(indices), np.asarray(want_indices))
        np.testing.assert_allclose(np.asarray(values), np.asarray(want_values), rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("max_blocks, sorted_", [(512, True), (1024, False)])
def test_fused_matches_separate_kernels_on_gpu(max_blocks, sorted_):
    """The fused path returns exactly the top-k of the Mosaic indexer's logits, and its maxima are those of the
    logits' groups of 16 tokens."""
    full = max_blocks * 64
    lens = [0, 1000, full // 2 + 37, full]
    args, kwargs = _case(9, rows=len(lens), heads=64, dim=128, page_size=64, max_blocks=max_blocks, lens=lens,
                         dtype=FP8)
    q, _, keys, tables, lens_ = args
    assert indexer_topk.fuses_group_maxima(q, keys, kwargs["k_scale"], tables, 2048)
    logits, maxima = indexer.indexer_logits_and_group_maxima(*args, **kwargs)
    np.testing.assert_array_equal(np.asarray(logits),
                                  np.asarray(indexer.indexer_logits(*args, **kwargs, backend="mosaic")))
    grouped = np.asarray(logits).reshape(len(lens), -1, 16).max(axis=2)
    np.testing.assert_array_equal(np.asarray(maxima), np.asarray(topk._to_key(jnp.asarray(grouped))))
    values, indices = indexer_topk.indexer_top_k(*args, k=2048, sorted=sorted_, **kwargs)
    want_values, want_indices = topk.topk(logits, lens_, 2048, sorted=sorted_)
    np.testing.assert_array_equal(np.asarray(indices), np.asarray(want_indices))
    np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))
