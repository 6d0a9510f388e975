"""pallas_kernels.grouped_matmul (the Triton kernel) against reference.grouped_matmul: interpreted on CPU,
compiled on GPU. Groups of no rows, of fewer rows than a block, of several blocks, rows past the last group."""

import re

import numpy as np
import pytest

import jax
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
    _check(args, rtol=rtol, block_m=block_m, block_n=32, block_k=16)


def test_the_default_backend_runs_the_kernel_with_its_default_blocks():
    args = _case(1, [3, 0, 9], rows=14, depth=48, width=32, dtype=jnp.float32)
    assert pallas_kernels.choose("grouped_matmul", "pallas", *args) == "triton"
    _check(args, rtol=1e-5, backend="pallas")


def test_default_tiles_follow_the_rows_a_group_given_or_counted():
    """Decode tiles below PREFILL_ROWS_PER_GROUP rows a group, prefill tiles from it (the measured choice,
    `default_knobs`; f32 keeps 64-row tiles, fp8 keeps block_n within its scale block). The rows a group are A / G
    unless `rows_per_group` says (expert parallelism); a prefill-shaped call with the defaults matches the
    reference; an unknown knob is refused."""
    experts = jax.ShapeDtypeStruct((256, 7168, 2048), jnp.bfloat16)
    fp8_experts = jax.ShapeDtypeStruct(experts.shape, jnp.float8_e4m3fn)
    assert kernel.default_knobs(2, experts) == dict(block_m=16, block_n=128, block_k=64, num_warps=4, num_stages=3)
    assert kernel.default_knobs(8, experts) == dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4)
    assert kernel.default_knobs(8, jax.ShapeDtypeStruct(experts.shape, jnp.float32))["block_m"] == 64
    assert kernel.default_knobs(8, fp8_experts, (128, 128))["block_m"] == 16  # fp8: decode tiles at 8 a group
    assert kernel.default_knobs(128, fp8_experts, (128, 128)) == dict(block_m=128, block_n=128, block_k=128,
                                                                      num_warps=8, num_stages=4)
    args = _case(2, [40, 3, 0, 30], rows=80, depth=48, width=32, dtype=jnp.bfloat16)  # 20 rows a group

    def kernel_name(**knobs):
        jaxpr = str(jax.make_jaxpr(lambda *a: pallas_kernels.grouped_matmul(*a, backend="triton", **knobs))(*args))
        return re.search(r"grouped_matmul_block_m=\d+", jaxpr).group()

    assert kernel_name() == "grouped_matmul_block_m=128"
    assert kernel_name(rows_per_group=2.5) == "grouped_matmul_block_m=16"  # most rows another rank's
    _check(args, rtol=2e-2)
    with pytest.raises(TypeError, match="unknown grouped matmul knobs"):
        pallas_kernels.grouped_matmul(*args, backend="triton", block_rows=16)


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
    with pytest.raises(ValueError, match="block_n dividing N"):  # a knob is run as given or refused
        pallas_kernels.grouped_matmul(x[:, :16], w[:, :16], sizes, backend="triton", block_n=64)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [64 * 8, 4096])
def test_grouped_matmul_compiled_deepseek_experts(rows):
    """DeepSeek-V3.2's routed experts (256 of hidden 7168; 256 output columns of the width, bf16) with a decode's
    or a prefill's rows routed at random, compiled."""
    rng = np.random.default_rng(2)
    sizes = np.bincount(rng.integers(0, 256, rows), minlength=256).astype(np.int32)
    x, w, _ = _case(3, [0] * 256, rows=rows, depth=7168, width=256, dtype=jnp.bfloat16)
    _check((x, w, jnp.asarray(sizes)), rtol=2e-2, interpret=False)


def _fp8_case(seed, sizes, *, rows, depth, width, block):
    """Block-fp8 operands as DeepSeek's act_quant and weight format make them: blocks `block` = (bn, bk) (an int:
    square), the weights K-major [G, N, K]."""
    from dcp_jax.model import fp8_linear

    block = (block, block) if isinstance(block, int) else block
    x, w, sizes = _case(seed, sizes, rows=rows, depth=depth, width=width, dtype=jnp.float32)
    x_values, x_scales = fp8_linear.act_quant(x, block[1])
    weight = fp8_linear.quantize(w, block, (-2,), (-1,))
    return x_values, x_scales, weight.values, weight.scales, sizes


@pytest.mark.parametrize("sizes, block", [([7, 0, 20, 1, 0, 15], (16, 16)), ([0, 0, 0], (16, 16)),
                                         ([5, 0, 9], (16, 32))], ids=["groups", "no-rows", "non-square-blocks"])
def test_grouped_matmul_fp8_matches_reference_and_the_models_fp8_product(sizes, block):
    """Each block's fp8 product scaled by its row's and its block's scales equals the dequantized product, the
    model's `fp8_linear.ragged_dot` of the same activations and block-fp8 weights."""
    from dcp_jax.model import fp8_linear

    args = _fp8_case(4, sizes, rows=sum(sizes) + 3, depth=64, width=48, block=block)
    covered = sum(sizes)
    out = np.asarray(pallas_kernels.grouped_matmul_fp8(*args, block=block, out_dtype=jnp.float32, backend="triton",
                                                       block_m=16))
    ref = np.asarray(reference.grouped_matmul_fp8(*args, block=block, out_dtype=jnp.float32))
    np.testing.assert_allclose(out[:covered], ref[:covered], rtol=1e-5, atol=1e-5)
    x, _, w, w_scales, group_sizes = args
    weight = fp8_linear.Fp8BlockWeight(w, w_scales, block, (-2,), (-1,))
    x_plain = _case(4, sizes, rows=sum(sizes) + 3, depth=64, width=48, dtype=jnp.float32)[0]
    model = np.asarray(fp8_linear.ragged_dot(x_plain, weight, group_sizes))
    np.testing.assert_allclose(out[:covered], model[:covered], rtol=1e-5, atol=1e-5)


def test_grouped_matmul_fp8_refuses_malformed_scales():
    x, x_scales, w, w_scales, sizes = _fp8_case(5, [2, 3], rows=5, depth=32, width=32, block=16)
    with pytest.raises(ValueError, match="e4m3"):
        pallas_kernels.grouped_matmul_fp8(x.astype(jnp.bfloat16), x_scales, w, w_scales, sizes, block=(16, 16),
                                          out_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="x_scales"):
        pallas_kernels.grouped_matmul_fp8(x, x_scales[:, :1], w, w_scales, sizes, block=(16, 16),
                                          out_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="divide the scale blocks"):
        pallas_kernels.grouped_matmul_fp8(x, x_scales, w, w_scales, sizes, block=(16, 16), out_dtype=jnp.bfloat16,
                                          backend="triton", block_k=32)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [64 * 8, 4096 * 8])
def test_grouped_matmul_fp8_compiled_deepseek_experts(rows):
    """DeepSeek-V3.2's block-fp8 experts (blocks of 128) at a decode's or a prefill's routed rows (the decode and
    the prefill tiles), compiled: within fp8 tensor-core accumulation of the dequantized product, summed a group at
    a time in numpy (XLA's GPU ragged_dot of the reference would materialize every group's masked rows)."""
    rng = np.random.default_rng(6)
    sizes = np.bincount(rng.integers(0, 256, rows), minlength=256).tolist()
    args = _fp8_case(7, sizes, rows=rows, depth=7168, width=256, block=128)
    out = np.asarray(pallas_kernels.grouped_matmul_fp8(*args, block=(128, 128), out_dtype=jnp.float32,
                                                       interpret=False))
    x, x_scales, w, w_scales, _ = (np.asarray(a, np.float32) for a in args)
    x = x * np.repeat(x_scales, 128, axis=1)
    w = w * np.repeat(np.repeat(w_scales, 128, axis=1), 128, axis=2)
    starts = np.cumsum([0] + sizes)
    ref = np.concatenate([x[start:end] @ w[g].T for g, (start, end) in enumerate(zip(starts, starts[1:]))])
    assert np.linalg.norm(out - ref) <= 2e-3 * np.linalg.norm(ref)
