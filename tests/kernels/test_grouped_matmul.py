"""pallas_kernels.grouped_matmul (the Triton kernel) against reference.grouped_matmul: interpreted on CPU,
compiled on GPU. Groups of no rows, of fewer rows than a block, of several blocks, rows past the last group."""

import numpy as np
import pytest

import jax.numpy as jnp

import pallas_kernels
from pallas_kernels import _grouped_matmul_triton as kernel
from pallas_kernels import reference


def _case(seed, sizes, *, rows, depth, width, dtype):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, depth)), dtype)
    w = jnp.asarray(rng.standard_normal((len(sizes), depth, width)) * depth**-0.5, dtype)
    return x, w, jnp.asarray(sizes, jnp.int32)


def _check(args, *, rtol, backend="triton", **knobs):
    covered = int(np.asarray(args[2]).sum())
    out = np.asarray(pallas_kernels.grouped_matmul(*args, backend=backend, **knobs), np.float32)[:covered]
    ref = np.asarray(reference.grouped_matmul(*args), np.float32)[:covered]
    assert out.shape == ref.shape
    np.testing.assert_allclose(out, ref, rtol=rtol, atol=rtol)


@pytest.mark.parametrize("dtype, rtol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)], ids=["f32", "bf16"])
@pytest.mark.parametrize("sizes, block_m", [([7, 0, 20, 1, 0, 15], 16), ([0, 40, 0, 3], 32), ([0, 0, 0], 16)],
                         ids=["small-groups", "several-blocks", "no-rows"])
def test_grouped_matmul_matches_reference(sizes, block_m, dtype, rtol):
    args = _case(0, sizes, rows=max(sum(sizes), 1) + 5, depth=48, width=32, dtype=dtype)  # 5 rows past the groups
    _check(args, rtol=rtol, block_m=block_m, block_k=16)
    _check(args, rtol=rtol, backend="pallas")


def test_work_items_list_each_groups_blocks_in_order():
    groups, starts, rows = (np.asarray(a) for a in kernel.work_items(jnp.asarray([7, 0, 20, 1], jnp.int32), 30, 16))
    assert len(groups) == 2 + 4  # ceil(30 / 16) + G
    np.testing.assert_array_equal(rows, [7, 16, 4, 1, 0, 0])
    np.testing.assert_array_equal(groups[:4], [0, 2, 2, 3])
    np.testing.assert_array_equal(starts[:4], [0, 7, 23, 27])


def test_grouped_matmul_refuses_what_it_cannot_run():
    x, w, sizes = _case(1, [2, 3], rows=5, depth=24, width=32, dtype=jnp.float32)
    with pytest.raises(ValueError, match="triton.*multiples of 16"):
        pallas_kernels.grouped_matmul(x, w, sizes)
    with pytest.raises(ValueError, match="one dtype"):
        pallas_kernels.grouped_matmul(x[:, :16].astype(jnp.bfloat16), w[:, :16], sizes, backend="triton")
    with pytest.raises(ValueError, match="group_sizes"):
        pallas_kernels.grouped_matmul(x, w, sizes[:1])
    with pytest.raises(ValueError, match="block_m"):
        pallas_kernels.grouped_matmul(x[:, :16], w[:, :16], sizes, backend="triton", block_m=24)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [64 * 8, 4096])
def test_grouped_matmul_compiled_deepseek_experts(rows):
    """DeepSeek-V3.2's routed experts (256 of hidden 7168 and width 2048, bf16) with a decode's or a prefill's
    rows routed at random, compiled."""
    rng = np.random.default_rng(2)
    sizes = np.bincount(rng.integers(0, 256, rows), minlength=256).astype(np.int32)
    x, w, _ = _case(3, [0] * 256, rows=rows, depth=7168, width=256, dtype=jnp.bfloat16)
    _check((x, w, jnp.asarray(sizes)), rtol=2e-2, interpret=False)
