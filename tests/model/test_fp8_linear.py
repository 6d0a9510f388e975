"""Block-fp8 weights and the fine-grained fp8 GEMM (`dcp_jax/model/fp8_linear.py`): the pure-jnp reference equals
float64 numpy of the blockwise sum (per (token, input block) activation scale times per block weight scale times
the e4m3 products), partial edge blocks and one-row inputs included; quantize / dequantize; scale specs."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import pallas_kernels
from dcp_jax.model import fp8_linear
from dcp_jax.model.memory_plan import BLOCK_FP8_LEAVES
from dcp_jax.model.mesh import HEADS


def _act_quant_numpy(x, group):
    """DeepSeek's act_quant in numpy: per row, per `group` channels, scale max(amax, 1e-4) / 448."""
    k = x.shape[-1]
    xs = np.zeros((x.shape[0], -(-k // group)), np.float32)
    x8 = np.zeros(x.shape, ml_dtypes.float8_e4m3fn)
    for g in range(xs.shape[1]):
        cols = slice(g * group, (g + 1) * group)
        xs[:, g] = np.maximum(np.abs(x[:, cols]).max(axis=1), np.float32(1e-4)) / np.float32(448)
        x8[:, cols] = (x[:, cols] / xs[:, g : g + 1]).astype(ml_dtypes.float8_e4m3fn)
    return x8, xs


def _blockwise_gemm_numpy(x, w: fp8_linear.Fp8BlockWeight):
    """x [M, K] times each of w's matrices [N, K] (side by side over its batch axes, in order) as DeepSeek's fp8 GEMM
    sums it, in float64: out[m, n] = sum over input blocks b of x_scale[m, b] * w_scale[n // bn, b] *
    sum_{k in b} x8[m, k] * w8[n, k]."""
    bn, bk = w.block
    x8, xs = _act_quant_numpy(np.asarray(x, np.float32), bk)
    matrices = np.asarray(w.matrices()).astype(np.float64)
    all_scales = np.asarray(w.scales, np.float64)
    outs = []
    for w8, ws in zip(matrices.reshape(-1, *matrices.shape[-2:]), all_scales.reshape(-1, *all_scales.shape[-2:])):
        out = np.zeros((x.shape[0], w8.shape[0]))
        for b in range(ws.shape[1]):
            rows = slice(b * bk, (b + 1) * bk)
            partial = x8[:, rows].astype(np.float64) @ w8[:, rows].T
            per_column = np.repeat(ws[:, b], bn)[: w8.shape[0]]
            out += xs[:, b : b + 1].astype(np.float64) * per_column * partial
        outs.append(out)
    return np.concatenate(outs, axis=1)


@pytest.mark.parametrize("m, k, n, block", [(1, 256, 128, (128, 128)), (5, 200, 130, (128, 128)),
                                            (3, 40, 24, (16, 16)), (7, 45, 37, (8, 12)), (1, 12, 5, (16, 16))])
def test_reference_gemm_equals_blockwise_float64(m, k, n, block):
    rng = np.random.default_rng(m * 1000 + k + n)
    x = jnp.asarray(rng.standard_normal((m, k)) * np.exp(rng.standard_normal((1, k))), jnp.float32)  # outliers
    w = fp8_linear.quantize(jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.float32), block, (0,), (1,))
    got = np.asarray(fp8_linear.einsum("mk,kn->mn", x, w, backend="reference"))
    want = _blockwise_gemm_numpy(x, w)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # Through the grouped form too: one group of all rows.
    experts = fp8_linear.Fp8BlockWeight(w.values[None], w.scales[None], w.block, (1,), (2,))
    grouped = fp8_linear.ragged_dot(x, experts, jnp.array([m], jnp.int32))
    np.testing.assert_allclose(np.asarray(grouped), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_output_has_the_activations_dtype_and_fp8_error_is_small():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4, 64)), jnp.bfloat16)
    plain = jnp.asarray(rng.standard_normal((64, 48)) / 8, jnp.float32)
    w = fp8_linear.quantize(plain, (16, 16), (0,), (1,))
    got = fp8_linear.einsum("rk,kn->rn", x, w, backend="reference")
    assert got.dtype == jnp.bfloat16 and w.values.dtype == jnp.float8_e4m3fn and w.scales.shape == (3, 4)
    assert w.values.shape == (48, 64) and w.shape == (64, 48)  # K-major: [N, K]
    exact = np.asarray(x, np.float32) @ np.asarray(plain)
    assert np.linalg.norm(np.asarray(got, np.float32) - exact) / np.linalg.norm(exact) < 0.06


def test_multi_axis_layouts_round_trip_through_the_matrix_form():
    """wo [H, V, D] (input axes H, V) and w_uk [H, N, C] (batch H, output N, input C): quantize / dequantize keeps
    each element within e4m3's relative step of 2^-4 of its block's max, and the einsum contracts H and V."""
    rng = np.random.default_rng(1)
    wo = jnp.asarray(rng.standard_normal((4, 8, 24)), jnp.float32)
    q = fp8_linear.quantize(wo, (8, 16), (0, 1), (2,))
    assert q.scales.shape == (3, 2) and q.values.shape == (24, 4, 8) and q.shape == wo.shape
    np.testing.assert_allclose(fp8_linear.dequantize(q), wo, atol=np.abs(wo).max() * 2**-4)
    x = jnp.asarray(rng.standard_normal((3, 4, 8)), jnp.float32)
    want = _blockwise_gemm_numpy(x.reshape(3, 32), fp8_linear.Fp8BlockWeight(
        q.values.reshape(24, 32), q.scales, q.block, (0,), (1,)))
    np.testing.assert_allclose(fp8_linear.einsum("rhv,hvd->rd", x, q, backend="reference"), want, rtol=1e-5,
                               atol=1e-5)
    w_uk = jnp.asarray(rng.standard_normal((2, 16, 24)), jnp.float32)
    q = fp8_linear.quantize(w_uk, (8, 12), (2,), (1,))
    assert q.scales.shape == (2, 2, 2) and q.values.shape == (2, 16, 24)
    np.testing.assert_allclose(fp8_linear.weight_values(q, jnp.float32), w_uk, atol=np.abs(w_uk).max() * 2**-4)


def test_contracting_an_output_axis_is_refused():
    w = fp8_linear.quantize(jnp.ones((2, 16, 24)), (8, 12), (2,), (1,))
    with pytest.raises(ValueError, match="contracts its input axes"):
        fp8_linear.einsum("rhn,hnc->rhc", jnp.ones((1, 2, 16)), w, backend="pallas")


def test_scale_specs_follow_the_split_axes():
    wq_b = fp8_linear.quantize(jnp.ones((16, 4, 12)), (16, 16), *fp8_linear.FP8_AXES["wq_b"])
    spec = fp8_linear.weight_spec(wq_b, P(None, HEADS, None))  # values [H, N+E, Q], scales [out, in]
    assert spec.values == P(HEADS, None, None) and spec.scales == P(HEADS, None)
    wo = fp8_linear.quantize(jnp.ones((4, 8, 16)), (16, 16), *fp8_linear.FP8_AXES["wo"])
    spec = fp8_linear.weight_spec(wo, P(HEADS, None, None))  # values [D, H, V]
    assert spec.values == P(None, HEADS, None) and spec.scales == P(None, HEADS)
    experts = fp8_linear.quantize(jnp.ones((4, 16, 32)), (16, 16), *fp8_linear.FP8_AXES["experts_down"])
    spec = fp8_linear.weight_spec(experts, P(None, HEADS, None))  # values [X, D, F]: F split
    assert spec.values == P(None, None, HEADS) and spec.scales == P(None, None, HEADS)
    assert fp8_linear.weight_spec(experts, P(HEADS, None, None)).scales == P(HEADS, None, None)
    gate_up = fp8_linear.quantize(jnp.ones((16, 2, 32)), (16, 16), *fp8_linear.FP8_AXES["gate_up"])
    spec = fp8_linear.weight_spec(gate_up, P(None, None, HEADS))  # [D, 2, F] -> values [2, F, D]: F split
    assert spec.values == P(None, HEADS, None) and spec.scales == P(None, HEADS, None)
    for w, plain in ((wq_b, P(None, HEADS, None)), (wo, P(HEADS, None, None)), (experts, P(None, None, HEADS))):
        assert fp8_linear.plain_spec(w, fp8_linear.weight_spec(w, plain).values) == plain
    fp8_linear.check_shardable("wo", wo, P(HEADS, None, None), {"dcp_group": 1, "dcp": 2})
    edge = fp8_linear.quantize(jnp.ones((4, 6, 16)), (16, 16), *fp8_linear.FP8_AXES["wo"])  # 24 inputs: 1.5 blocks
    fp8_linear.check_shardable("wo", edge, P(HEADS, None, None), {"dcp_group": 1, "dcp": 1})  # one rank: the whole
    with pytest.raises(ValueError, match="wo: a rank's input slice of 8 is not a whole number of fp8 blocks"):
        fp8_linear.check_shardable("wo", wo, P(HEADS, None, None), {"dcp_group": 2, "dcp": 2})


def test_fp8_leaves_are_the_memory_plans():
    assert set(fp8_linear.FP8_AXES) == BLOCK_FP8_LEAVES


@pytest.mark.parametrize("equation, x_shape, w_shape, leaf", [
    ("rq,qhk->rhk", (5, 32), (32, 4, 24), "wq_b"),
    ("rhv,hvd->rd", (3, 4, 8), (4, 8, 48), "wo"),
    ("...d,df->...f", (2, 3, 64), (64, 40), "down"),
    ("...d,dgf->...gf", (2, 3, 64), (64, 2, 48), "gate_up"),
])
def test_the_gemm_path_equals_the_reference_path(monkeypatch, equation, x_shape, w_shape, leaf):
    """einsum through `pallas_kernels.fp8_gemm` (its reference standing in for the GPU kernel: the rows, the
    K-major matrices, stacked along N over batch axes x lacks, and the output's axes as the kernel gets and gives
    them) equals the dequantized einsum."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal(x_shape), jnp.float32)
    plain = jnp.asarray(rng.standard_normal(w_shape), jnp.float32)
    w = fp8_linear.quantize(plain, (16, 16), *fp8_linear.FP8_AXES[leaf])
    want = fp8_linear.einsum(equation, x, w, backend="reference")
    calls, kernel_op = [], pallas_kernels.fp8_gemm

    def reference_gemm(*args, backend, **kwargs):
        calls.append(backend)
        return kernel_op(*args, backend="reference", **kwargs)

    monkeypatch.setattr(fp8_linear, "_gemm_implementation", lambda *args: "mosaic")
    monkeypatch.setattr(fp8_linear.pallas_kernels, "fp8_gemm", reference_gemm)
    assert fp8_linear.einsum(equation, x, w, backend="reference") is not None and not calls  # no kernel asked
    got = fp8_linear.einsum(equation, x, w, backend="pallas")
    assert calls == ["mosaic"] and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_a_pair_whose_blocks_do_not_stack_multiplies_matrix_by_matrix_and_shared_batch_axes_are_refused():
    """The fused gate_up whose matrices' N ends mid-block runs one GEMM a matrix through the kernel (the Triton one,
    interpreted on CPU) and equals the reference; a weight whose batch axes the activations share (one product a
    head) is refused under a kernels backend, with the way out."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((2, 3, 64)), jnp.float32)
    w = fp8_linear.quantize(jnp.asarray(rng.standard_normal((64, 2, 48)), jnp.float32), (32, 16),
                            *fp8_linear.FP8_AXES["gate_up"])  # N = 48 ends mid-block of 32
    assert fp8_linear._stacked_matrices(w) == (None, None)
    got = fp8_linear.einsum("...d,dgf->...gf", x, w, backend="pallas")
    want = fp8_linear.einsum("...d,dgf->...gf", x, w, backend="reference")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    w_uk = fp8_linear.quantize(jnp.asarray(rng.standard_normal((4, 16, 32)), jnp.float32), (16, 16),
                               *fp8_linear.FP8_AXES["w_uk"])
    with pytest.raises(ValueError, match="batch axes 'h' they lack; run this product with kernels='reference'"):
        fp8_linear.einsum("rhc,hnc->rhn", jnp.ones((3, 4, 32)), w_uk, backend="pallas")
    assert fp8_linear.einsum("rhc,hnc->rhn", jnp.ones((3, 4, 32)), w_uk, backend="reference").shape == (3, 4, 16)


def test_a_weight_no_gemm_kernel_takes_is_refused_with_the_reasons():
    w = fp8_linear.quantize(jnp.ones((45, 37)), (8, 12), (0,), (1,))
    with pytest.raises(ValueError, match="backend='pallas' cannot run fp8_gemm here: .*triton: it needs K, N"):
        fp8_linear.einsum("mk,kn->mn", jnp.ones((2, 45)), w, backend="pallas")


@pytest.mark.gpu
@pytest.mark.parametrize("equation, x_shape, w_shape, leaf", [
    ("rq,qhk->rhk", (40, 1536), (1536, 4, 192), "wq_b"),
    ("rhv,hvd->rd", (300, 4, 128), (4, 128, 512), "wo"),
    ("...d,df->...f", (2, 3, 512), (512, 576), "down"),
    ("...d,dgf->...gf", (2, 3, 512), (512, 2, 640), "gate_up"),
])
def test_einsum_runs_the_fp8_gemm_kernel_on_the_gpu(equation, x_shape, w_shape, leaf):
    """On an H100 / H200 an fp8 linear layer runs the Mosaic fp8 GEMM: within fp8 tensor-core accumulation and a
    bf16 output of DeepSeek's blockwise sum of the fp8 activations (bf16 activations), summed in numpy."""
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal(x_shape), jnp.bfloat16)
    plain = jnp.asarray(rng.standard_normal(w_shape) / np.sqrt(np.prod(x_shape[1:])), jnp.float32)
    w = fp8_linear.quantize(plain, (128, 128), *fp8_linear.FP8_AXES[leaf])
    rows = x.reshape(-1, int(np.prod([w.shape[a] for a in w.in_axes])))
    assert fp8_linear._gemm_implementation(rows.shape[0], *fp8_linear._stacked_matrices(w), w, "pallas") == "mosaic"
    got = np.asarray(jax.jit(lambda x, w: fp8_linear.einsum(equation, x, w, backend="pallas"))(x, w), np.float32)
    want = _blockwise_gemm_numpy(rows, w).reshape(got.shape)
    assert np.linalg.norm(got - want) <= 5e-3 * np.linalg.norm(want)


@pytest.mark.gpu
def test_the_dequantized_path_quantizes_the_activations_under_jit_on_the_gpu():
    """XLA's GPU compiler drops an f32 -> e4m3 -> f32 round trip as excess precision (H100, 2026-12-06); the
    reference path's activations keep their e4m3 rounding under jit (the eager result, not x)."""
    x = jax.random.normal(jax.random.key(0), (64, 512)) * 3.3
    quantized = jax.jit(fp8_linear._quantized_activations, static_argnums=(1, 2))(x, 1, 128)
    np.testing.assert_array_equal(quantized, fp8_linear._quantized_activations(x, 1, 128))
    assert not np.array_equal(quantized, x)


@pytest.mark.parametrize("leaf, shape, spec", [
    ("wq_b", (3, 32, 2, 24), P(None, None, HEADS, None)), ("wo", (3, 2, 16, 48), P(None, HEADS, None, None)),
    ("w_uk", (3, 2, 16, 32), P(None, HEADS, None, None)), ("experts_down", (3, 4, 32, 16), P(None, None, HEADS, None)),
    ("gate_up", (3, 32, 2, 48), P(None, None, None, HEADS))])
def test_a_leaf_stacked_over_layers_is_its_layers_quantized_alone(leaf, shape, spec):
    """Weights stacked over layers (`deepseek_v32.LayerStack`: a leading L axis, the FP8_AXES counted from the last)
    keep the plain shape, and each layer's values and scales are those of quantizing it alone."""
    plain = jnp.asarray(np.random.default_rng(5).standard_normal(shape), jnp.float32)
    stacked = fp8_linear.quantize(plain, (16, 16), *fp8_linear.FP8_AXES[leaf])
    assert stacked.shape == shape and stacked.batch_axes[0] == 0
    for layer in range(shape[0]):
        alone = fp8_linear.quantize(plain[layer], (16, 16), *fp8_linear.FP8_AXES[leaf])
        np.testing.assert_array_equal(np.asarray(stacked.values[layer], np.float32),
                                      np.asarray(alone.values, np.float32))
        np.testing.assert_array_equal(stacked.scales[layer], alone.scales)
    np.testing.assert_allclose(fp8_linear.dequantize(stacked), plain, atol=np.abs(plain).max() * 2**-4)
    assert fp8_linear.plain_spec(stacked, fp8_linear.weight_spec(stacked, spec).values) == spec
