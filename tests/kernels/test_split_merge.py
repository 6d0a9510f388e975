"""pallas_kernels/_split_merge_triton.py: the split-K merge as one Pallas kernel, against `_lse.merge_splits`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _lse, _split_merge_triton
from tests.kernels.triton_ir import triton_modules


def _partials(seed, rows, splits, heads, width, dtype):
    """Random partial outputs and lses: row 0's first split empty, row 1's first three heads empty everywhere, and
    in row 2 (where there is one) lses near 1000 spread over 200, so that exp(lse) overflows and light splits'
    weights underflow to 0 (the maximum must be subtracted first)."""
    rng = np.random.default_rng(seed)
    lses = 3 * rng.normal(size=(rows, splits, heads))
    lses[0, 0] = -np.inf
    if rows > 1:
        lses[1, :, :3] = -np.inf
    if rows > 2:
        lses[2] = 1000 + 200 * rng.random(size=(splits, heads))
    return jnp.asarray(rng.normal(size=(rows, splits, heads, width)), dtype), jnp.asarray(lses, jnp.float32)


@pytest.mark.parametrize("rows, splits, heads, width, block_h, block_c",
                         [(3, 4, 32, 64, 16, 32), (2, 3, 16, 512, 8, 128), (2, 1, 16, 128, 8, 128),
                          (4, 17, 64, 32, 32, 128)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_equals_the_reference(rows, splits, heads, width, block_h, block_c, dtype):
    """Any split count (not a power of two, one), empty splits, rows whose heads are empty in every split
    (out 0, lse -inf), several column blocks and one narrower than block_c; outputs in f32 and in bf16."""
    outs, lses = _partials(rows + splits, rows, splits, heads, width, dtype)
    for out_dtype in (jnp.float32, jnp.bfloat16):
        out, lse = _split_merge_triton.merge_splits(outs, lses, out_dtype=out_dtype, block_h=block_h,
                                                    block_c=block_c)
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
    with pytest.raises(ValueError, match=r"block_h must be a power of two dividing 20 \(larger shrinks to 20\); got "
                                         "block_h=8"):
        merge(outs[:, :, :20], lses[:, :, :20], block_h=8)  # the default halves to 4 here, which divides 20
    with pytest.raises(ValueError, match=r"block_c must be a power of two dividing 48 \(larger shrinks to 48\); got "
                                         "block_c=128"):
        merge(outs[..., :48], lses, block_c=128)  # the default takes 16 here
    for block_h in (0, 12):
        with pytest.raises(ValueError, match=f"block_h must be a power of two dividing 32 .*; got {block_h=}"):
            merge(outs, lses, block_h=block_h)
    with pytest.raises(ValueError, match="block_c must be a power of two dividing 64 .*; got block_c=24"):
        merge(outs, lses, block_c=24)
    with pytest.raises(ValueError, match="want outs .* and f32 lses"):
        merge(outs, lses[:, :1])
    with pytest.raises(ValueError, match="want outs .* and f32 lses"):
        merge(outs, lses.astype(jnp.bfloat16))


@pytest.mark.parametrize("rows, heads, width, blocks", [
    (1, 128, 512, (4, 64)), (2, 128, 512, (8, 64)), (8, 128, 512, (8, 128)), (1, 16, 128, (4, 64)),
    (1, 8, 64, (4, 64)), (64, 2, 32, (2, 32)), (64, 20, 48, (4, 16)), (1, 6, 100, (2, 4)),
])
def test_default_blocks_reach_the_programs_or_their_floor(rows, heads, width, blocks):
    """Columns halve to 64, then heads to 4, while under 256 programs; from 8 x 128 or the largest powers of two
    dividing H and C, so that any shape merges."""
    assert _split_merge_triton.default_blocks(rows, heads, width) == blocks


@pytest.mark.parametrize("rows, heads, width", [(1, 16, 128), (2, 20, 48)])
def test_default_blocks_equal_the_reference(rows, heads, width):
    """The default blocks (4 x 64 at one row; 4 x 16 for H = 20, C = 48) merge as the reference does."""
    outs, lses = _partials(5, rows, 3, heads, width, jnp.bfloat16)
    out, lse = _split_merge_triton.merge_splits(outs, lses, out_dtype=jnp.bfloat16)
    ref_out, ref_lse = _lse.merge_splits(outs, lses, out_dtype=jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32), rtol=8e-3, atol=8e-3)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows, splits", [(64, 8), (3, 3), (7, 17), (1, 16)])
def test_lowers_for_cuda(monkeypatch, rows, splits):
    S = jax.ShapeDtypeStruct
    merge = lambda outs, lses: _split_merge_triton.merge_splits(outs, lses, out_dtype=jnp.bfloat16, interpret=False)
    assert triton_modules(monkeypatch, merge, S((rows, splits, 128, 512), jnp.bfloat16),
                          S((rows, splits, 128), jnp.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("rows, splits", [(1, 16), (8, 8), (3, 17)])
def test_equals_the_reference_on_gpu(rows, splits):
    """Compiled: the sparse MLA's widths (128 heads, 512 columns), bf16 partials, the default blocks."""
    outs, lses = _partials(rows * splits, rows, splits, 128, 512, jnp.bfloat16)
    out, lse = _split_merge_triton.merge_splits(outs, lses, out_dtype=jnp.bfloat16, interpret=False)
    ref_out, ref_lse = _lse.merge_splits(outs, lses, out_dtype=jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32), rtol=8e-3, atol=8e-3)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6, atol=1e-6)
