"""pallas_kernels/_split_merge_triton.py: the split-K merge as one Pallas kernel, against `_lse.merge_splits`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _lse, _split_merge_triton
from tests.kernels.triton_ir import triton_modules


def _partials(seed, rows, splits, heads, width, dtype):
    """Random partial outputs and lses: row 0's first split empty, row 1's first three heads empty everywhere."""
    rng = np.random.default_rng(seed)
    lses = 3 * rng.normal(size=(rows, splits, heads))
    lses[0, 0] = -np.inf
    if rows > 1:
        lses[1, :, :3] = -np.inf
    return jnp.asarray(rng.normal(size=(rows, splits, heads, width)), dtype), jnp.asarray(lses, jnp.float32)


@pytest.mark.parametrize("rows, splits, heads, width, block_h",
                         [(3, 4, 32, 64, 16), (2, 3, 16, 512, 16), (2, 1, 16, 128, 8), (4, 17, 64, 32, 32)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_equals_the_reference(rows, splits, heads, width, block_h, dtype):
    """Any split count (not a power of two, one), empty splits, rows whose heads are empty in every split
    (out 0, lse -inf); outputs in f32 and in bf16."""
    outs, lses = _partials(rows + splits, rows, splits, heads, width, dtype)
    for out_dtype in (jnp.float32, jnp.bfloat16):
        out, lse = _split_merge_triton.merge_splits(outs, lses, out_dtype=out_dtype, block_h=block_h)
        ref_out, ref_lse = _lse.merge_splits(outs, lses, out_dtype=out_dtype)
        assert out.dtype == ref_out.dtype == out_dtype and lse.dtype == jnp.float32
        tolerance = 1e-6 if out_dtype == jnp.float32 else 8e-3  # one bf16 rounding apart at most
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32), rtol=tolerance,
                                   atol=tolerance)
        np.testing.assert_allclose(lse, ref_lse, rtol=1e-6, atol=1e-6)
        if rows > 1:
            assert np.all(np.asarray(out)[1, :3] == 0) and np.all(np.isneginf(np.asarray(lse)[1, :3]))


def test_rejects_what_it_cannot_merge():
    outs, lses = _partials(0, 1, 2, 32, 64, jnp.float32)
    merge = _split_merge_triton.merge_splits
    with pytest.raises(ValueError, match="H a multiple of block_h"):
        merge(outs[:, :, :24], lses[:, :, :24])
    with pytest.raises(ValueError, match="H a multiple of block_h"):
        merge(outs[..., :48], lses)  # C not a power of two
    for block_h in (0, 12):
        with pytest.raises(ValueError, match="H a multiple of block_h"):
            merge(outs, lses, block_h=block_h)
    with pytest.raises(ValueError, match="want outs .* and f32 lses"):
        merge(outs, lses[:, :1])
    with pytest.raises(ValueError, match="want outs .* and f32 lses"):
        merge(outs, lses.astype(jnp.bfloat16))


@pytest.mark.parametrize("rows, splits", [(64, 8), (3, 3), (7, 17)])
def test_lowers_for_cuda(monkeypatch, rows, splits):
    S = jax.ShapeDtypeStruct
    merge = lambda outs, lses: _split_merge_triton.merge_splits(outs, lses, out_dtype=jnp.bfloat16, interpret=False)
    assert triton_modules(monkeypatch, merge, S((rows, splits, 128, 512), jnp.bfloat16),
                          S((rows, splits, 128), jnp.float32))
