"""The MoE (`dcp_jax/model/moe.py`): the grouped experts equal the dense reference (f32 and bf16, balanced and
unbalanced routing, experts given no row, 1 and odd row counts; through XLA's ragged_dot and the Pallas grouped
matmul); the rank shares of both splits (whole experts, slices of the width) sum to the whole; which computation a
kernels backend runs; MXFP4 experts (AMD Quark's) run grouped under every backend as the dense experts of their
values, their declared MXFP4 activations quantize-dequantized before each product; the whole model with expert
parallelism equals it without, and the single-device model, at tp 2, 4, 8 and dcp 1, 2."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dcp_jax.config import TINY, EngineConfig, ParallelConfig
from dcp_jax.model import fp8_linear, moe, mxfp4
from dcp_jax.model.deepseek_v32 import init_params
from dcp_jax.model.mesh import make_mesh
from dcp_jax.runtime.runner import ModelRunner
from dcp_jax.runtime import oracle
from pallas_kernels import formats

X = TINY.n_routed_experts  # 8 experts, 2 per row, in 2 groups of 4 (one kept per row)


@functools.cache
def layer(dtype):
    return moe.MoE(TINY, rngs=nnx.Rngs(0), dtype=dtype)


def inputs(rows: int, dtype, *, seed: int = 0, router_bias=None):
    """(x, experts, weights, gate, up, down) of `rows` random rows routed by the tiny MoE layer."""
    m = layer(dtype)
    x = jax.random.normal(jax.random.key(seed), (rows, TINY.hidden_size)).astype(dtype)
    bias = m.router_bias[...] if router_bias is None else router_bias
    experts, weights = moe.route(x, m.router[...], bias, TINY)
    return x, experts, weights, m.experts_gate[...], m.experts_up[...], m.experts_down[...]


def tolerance(dtype, reference) -> float:
    """f32: summation order only. bf16: a few roundings of the intermediates, relative to the output's scale."""
    return 1e-5 if dtype == jnp.float32 else 0.03 * float(np.abs(reference).max())


def assert_grouped_equals_dense(args, dtype, *, matmul=fp8_linear.ragged_dot, **kwargs):
    grouped = np.asarray(jax.jit(functools.partial(moe.grouped_experts, matmul=matmul, **kwargs))(*args), np.float32)
    dense = np.asarray(jax.jit(functools.partial(moe.dense_experts, **kwargs))(*args), np.float32)
    assert np.abs(dense).max() > 0.1  # the routed experts contribute
    np.testing.assert_allclose(grouped, dense, atol=tolerance(dtype, dense), rtol=0)
    return grouped


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows", [1, 7, 33])
def test_grouped_equals_dense(dtype, rows):
    args = inputs(rows, dtype, seed=rows)
    out = assert_grouped_equals_dense(args, dtype, first_expert=0)
    assert out.shape == (rows, TINY.hidden_size)
    assert jax.jit(functools.partial(moe.grouped_experts, first_expert=0))(*args).dtype == dtype


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_unbalanced_routing_and_experts_without_rows(dtype):
    """A router bias that sends every row to expert 3 (and its group's others): one group holds most
    assignments, the other group's experts get none."""
    bias = jnp.zeros(X).at[3].set(10.0)
    args = inputs(19, dtype, router_bias=bias)
    counts = np.bincount(np.asarray(args[1]).ravel(), minlength=X)
    assert counts[3] == 19 and counts[4:].sum() == 0  # experts 4-7 (the other group) receive no row
    assert_grouped_equals_dense(args, dtype, first_expert=0)


def test_routing_weights_are_normalized_and_scaled():
    _, experts, weights, *_ = inputs(5, jnp.float32)
    assert experts.dtype == jnp.int32 and weights.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(weights).sum(-1), TINY.routed_scaling_factor, rtol=1e-6)
    groups = np.asarray(experts) // (X // TINY.n_group)
    assert (groups == groups[:, :1]).all()  # topk_group = 1: a row's experts share one group


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_rank_shares_sum_to_the_whole(dtype, tp):
    """Expert parallel: rank r runs experts r*X/tp.. on the assignments routed to them, none other; tensor
    parallel: every rank runs every assignment on its F/tp slice. Either way the shares sum to the whole."""
    x, experts, weights, gate, up, down = inputs(13, dtype, seed=tp)
    whole = np.asarray(moe.dense_experts(x, experts, weights, gate, up, down, first_expert=0), np.float32)
    grouped = jax.jit(moe.grouped_experts)
    local, width = X // tp, gate.shape[-1] // tp
    by_experts = sum(np.asarray(grouped(x, experts, weights, *(w[r * local:(r + 1) * local] for w in (gate, up, down)),
                                        first_expert=r * local), np.float32) for r in range(tp))
    f = [slice(r * width, (r + 1) * width) for r in range(tp)]
    by_width = sum(np.asarray(grouped(x, experts, weights, gate[..., f[r]], up[..., f[r]], down[:, f[r]],
                                      first_expert=0), np.float32) for r in range(tp))
    np.testing.assert_allclose(by_experts, whole, atol=tolerance(dtype, whole), rtol=0)
    np.testing.assert_allclose(by_width, whole, atol=tolerance(dtype, whole), rtol=0)


def test_grouped_experts_multiply_through_ragged_dots_only():
    """The grouped path has the three ragged dots and no dense product over the experts."""
    jaxpr = str(jax.make_jaxpr(functools.partial(moe.grouped_experts, first_expert=0))(*inputs(4, jnp.float32)))
    assert jaxpr.count("ragged_dot_general") == 3
    assert "dot_general" not in jaxpr.replace("ragged_dot_general", "")


def test_grouped_experts_through_the_pallas_grouped_matmul_equal_dense():
    """The Pallas kernel (interpreted) as the grouped matmul, on every expert and on one rank's whole experts (the
    other ranks' assignments sort past its groups and add nothing)."""
    x, experts, weights, gate, up, down = inputs(9, jnp.float32, seed=3)
    pallas_matmul = functools.partial(fp8_linear.grouped_matmul, backend="pallas")
    assert_grouped_equals_dense((x, experts, weights, gate, up, down), jnp.float32, first_expert=0,
                                matmul=pallas_matmul)
    half = slice(X // 2, X)
    assert_grouped_equals_dense((x, experts, weights, gate[half], up[half], down[half]), jnp.float32,
                                first_expert=X // 2, matmul=pallas_matmul)


def test_the_kernels_backend_picks_the_routed_experts_computation():
    """The grouped matmul under a kernels backend, the dense experts under "reference"; weights the kernel cannot
    take are a ValueError naming why (never a silent switch to dense experts), whose way out is the reference."""
    x, _, _, gate, up, down = inputs(2, jnp.bfloat16)
    grouped = moe.routed_experts("pallas", x, gate, up, down, rows_per_expert=0.5)
    assert grouped.func is moe.grouped_experts
    assert grouped.keywords["matmul"].keywords == {"backend": "pallas", "rows_per_group": 0.5}
    assert grouped.keywords["matmul"].func is fp8_linear.grouped_matmul
    assert moe.routed_experts("reference", x, gate, up, down, rows_per_expert=0.5) is moe.dense_experts
    with pytest.raises(ValueError, match="one dtype, bf16 or f32; got float32 and bfloat16; kernels='reference'"):
        moe.routed_experts("pallas", x.astype(jnp.float32), gate, up, down, rows_per_expert=0.5)  # dtypes differ
    narrow = [w[..., :8] for w in (gate, up)] + [down[:, :8]]  # F = 8: no Triton dot that narrow
    with pytest.raises(ValueError, match="multiples of 16"):
        moe.routed_experts("pallas", x, *narrow, rows_per_expert=0.5)
    untileable = [fp8_linear.quantize(w, (8, 8), (-2,), (-1,)) for w in (gate, up, down)]  # no 16-wide block
    with pytest.raises(ValueError, match="multiples of 16"):
        moe.routed_experts("pallas", x, *untileable, rows_per_expert=0.5)
    other_axes = [fp8_linear.quantize(w, (16, 16), (1,), (2,)) for w in (gate, up, down)]
    with pytest.raises(ValueError, match="K its input axis"):
        moe.routed_experts("pallas", x, *other_axes, rows_per_expert=0.5)
    assert moe.routed_experts("reference", x, *other_axes, rows_per_expert=0.5) is moe.dense_experts


def test_block_fp8_experts_run_grouped_through_the_fp8_kernel_as_dense():
    """Block-fp8 experts (the model's axes; a block of 32 output rows by 16 input columns, so the two sides of the
    scale block are not confused) are chosen for the fp8 grouped matmul, whose result (interpreted) is the dense
    experts' of the same fp8 weights: both quantize the rows per input block."""
    x, experts, weights, gate, up, down = inputs(13, jnp.float32, seed=4)
    block_fp8 = [fp8_linear.quantize(w, (32, 16), (-2,), (-1,)) for w in (gate, up, down)]
    grouped = moe.routed_experts("pallas", x, *block_fp8, rows_per_expert=13 * TINY.num_experts_per_tok / X)
    assert grouped.func is moe.grouped_experts
    assert_grouped_equals_dense((x, experts, weights, *block_fp8), jnp.float32, first_expert=0,
                                matmul=grouped.keywords["matmul"])


def _mxfp4(w, fmt=mxfp4.ExpertsFormat()):
    """A plain expert weight [X, in, out] rounded to MXFP4 (the OCP conversion) as `mxfp4.Mxfp4Experts`."""
    packed, scales = formats.quantize_mxfp4(np.swapaxes(np.asarray(w, np.float32), -1, -2))
    return mxfp4.from_checkpoint(jnp.asarray(packed), jnp.asarray(scales), fmt)


@pytest.mark.slow  # the GLM-5.2 MXFP4 oracle test runs both in the whole model (tests/model/test_glm_mxfp4.py)
@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_mxfp4_experts_run_grouped_as_the_dense_experts_of_their_values(backend):
    """MXFP4 experts run grouped under every backend ("reference": the dequantize + ragged_dot reference of
    grouped_matmul_mxfp4; "pallas": its Triton kernel, interpreted) and equal the dense experts of their dequantized
    values, on every expert and on one rank's half (expert parallel)."""
    x, experts, weights, gate, up, down = inputs(11, jnp.float32, seed=5)
    kept = [_mxfp4(w) for w in (gate, up, down)]
    run = moe.routed_experts(backend, x, *kept, rows_per_expert=11 * TINY.num_experts_per_tok / X)
    assert run.func is moe.grouped_experts and run.keywords["matmul"].keywords["backend"] == backend
    half = slice(X // 2, X)
    for first, ws in ((0, kept), (X // 2, [jax.tree.map(lambda a: a[half], w) for w in kept])):
        got = jax.jit(functools.partial(run, first_expert=first))(x, experts, weights, *ws)
        want = moe.dense_experts(x, experts, weights, *(mxfp4.dequantize(w) for w in ws), first_expert=first)
        assert np.abs(want).max() > 0.1
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", ["reference", pytest.param("pallas", marks=pytest.mark.slow)])
def test_declared_mxfp4_activations_are_quantize_dequantized_before_each_product(backend):
    """With activations "mxfp4" every product's inputs (x for gate and up, silu(x gate) * x up for down) are rounded
    to MXFP4 per 32 inputs first (`fp8_linear.grouped_matmul`, before either backend's kernel); the result differs
    from unquantized activations'."""
    x, experts, weights, gate, up, down = inputs(6, jnp.float32, seed=6)
    fmt = mxfp4.ExpertsFormat("mxfp4", "even")
    kept = [_mxfp4(w, fmt) for w in (gate, up, down)]
    wg, wu, wd = (np.asarray(mxfp4.dequantize(w)) for w in kept)

    def qdq(v):
        return np.asarray(mxfp4.quantize_dequantize(jnp.asarray(v), "even"))

    want = np.zeros(x.shape, np.float32)
    for r in range(x.shape[0]):
        for e, weight in zip(np.asarray(experts[r]), np.asarray(weights[r])):
            xr = qdq(x[r][None])[0]
            hidden = np.asarray(jax.nn.silu(xr @ wg[e])) * (xr @ wu[e])
            want[r] += weight * (qdq(hidden[None])[0] @ wd[e])
    run = moe.routed_experts(backend, x, *kept, rows_per_expert=1.5)
    np.testing.assert_allclose(run(x, experts, weights, *kept, first_expert=0), want, atol=1e-4, rtol=0)
    unquantized = moe.dense_experts(x, experts, weights, wg, wu, wd, first_expert=0)
    assert np.abs(np.asarray(unquantized) - want).max() > 1e-2


def test_mxfp4_activation_scale_rules():
    """OCP's scale 2^(floor(log2 amax) - 2) saturates a block whose amax has a mantissa of 1.75 (1.75 / 0.25 = 7 ->
    6: 1.5), Quark's "even" rule takes the next scale (1.75 / 0.5 = 3.5 -> 4, ties to even: 2.0); the OCP rule
    equals formats.quantize_mxfp4 then dequantize_mxfp4; widths not whole blocks are refused."""
    block = jnp.zeros((1, 32), jnp.float32).at[0, 0].set(1.75).at[0, 1].set(-0.3)
    assert float(mxfp4.quantize_dequantize(block)[0, 0]) == 1.5
    assert float(mxfp4.quantize_dequantize(block, "even")[0, 0]) == 2.0
    assert float(mxfp4.quantize_dequantize(block, "even")[0, 1]) == -0.25  # 0.6 of the scale 0.5 -> 0.5
    x = np.asarray(jax.random.normal(jax.random.key(0), (5, 96)) * 3, np.float32)
    np.testing.assert_array_equal(np.asarray(mxfp4.quantize_dequantize(jnp.asarray(x))),
                                  formats.dequantize_mxfp4(*formats.quantize_mxfp4(x), np.float32))
    assert mxfp4.quantize_dequantize(jnp.asarray(x, jnp.bfloat16)).dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4.quantize_dequantize(jnp.ones((2, 40)))


def test_mxfp4_experts_the_kernel_cannot_take_are_refused_with_the_reason():
    x, _, _, gate, up, down = inputs(2, jnp.float32)
    narrow = [_mxfp4(w[..., :8]) for w in (gate, up)] + [_mxfp4(down)]  # out = 8: no Triton dot that narrow
    with pytest.raises(ValueError, match="out a multiple of 16.*kernels='reference'"):
        moe.routed_experts("pallas", x, *narrow, rows_per_expert=0.5)
    assert moe.routed_experts("reference", x, *narrow, rows_per_expert=0.5).func is moe.grouped_experts


# ---- the whole model -----------------------------------------------------------------------------------------------

ENGINE = EngineConfig(page_size=4, num_pages=32, max_num_seqs=2, max_model_len=32, bucket_ladder=(16,),
                      max_num_batched_tokens=16)
PROMPTS = [[5, 9, 17, 3, 88, 41, 7, 250, 13, 2, 64], [300, 12, 6, 77, 19, 1, 45]]


@functools.cache
def model_logits(tp: int, dcp: int, expert_parallel: bool, kernels: str = "reference") -> np.ndarray:
    """Every position's logits of the two prompts (prefilled in one step each) through the tiny model of seed 0."""
    parallel = ParallelConfig(tp=tp, dcp=dcp, enable_expert_parallel=expert_parallel)
    mesh = make_mesh(parallel)
    runner = ModelRunner(TINY, init_params(TINY, seed=0), parallel, ENGINE, mesh, kernels)
    blocks = ENGINE.max_blocks_per_seq(dcp)
    tables = [list(range(blocks)), list(range(blocks, 2 * blocks))]
    logits, _, _ = oracle.prefill(runner, PROMPTS, tables, all_logits=True)
    return logits


@pytest.mark.parametrize("tp, dcp", [(2, 2)] + [pytest.param(tp, dcp, marks=pytest.mark.slow)
                                                 for tp, dcp in ((8, 2), (2, 1), (4, 1), (4, 2), (8, 1))])
def test_model_with_expert_parallelism_equals_without_and_one_device(tp, dcp):
    one_device = model_logits(1, 1, False)
    with_ep, without = model_logits(tp, dcp, True), model_logits(tp, dcp, False)
    valid = ~np.isnan(one_device)
    assert valid.sum() == sum(map(len, PROMPTS)) * TINY.vocab_size
    np.testing.assert_allclose(with_ep[valid], without[valid], atol=1e-4, rtol=0)
    np.testing.assert_allclose(with_ep[valid], one_device[valid], atol=1e-4, rtol=0)


def test_expert_parallelism_with_the_pallas_kernels_equals_the_references():
    """Each rank's whole experts through the grouped matmul kernel inside shard_map (its first expert from its
    axis index), the attention kernels interpreted: the reference kernels' logits."""
    with_kernels, reference = model_logits(2, 1, True, "pallas"), model_logits(2, 1, True)
    valid = ~np.isnan(reference)
    np.testing.assert_allclose(with_kernels[valid], reference[valid], atol=1e-4, rtol=0)
