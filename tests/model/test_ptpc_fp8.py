"""`--quantization ptpc_fp8` (vLLM's and ATOM's online per-token per-channel fp8, the seed's `--online_quant_config
ptpc_fp8`): which leaves it quantizes (not the experts, routed or shared, nor the router, the embedding, lm_head),
its format and product, and a served tiny GLM model close to the unquantized one at any TP / DCP split, its MXFP4
routed experts kept MXFP4. f32 models; the fp8 error bounds are stated where asserted."""

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dcp_jax.config import TINY_GLM, ParallelConfig
from dcp_jax.model import fp8_linear, mxfp4
from dcp_jax.model.deepseek_v32 import init_params
from dcp_jax.model.fp8_linear import Fp8ChannelWeight
from dcp_jax.model.mesh import make_mesh
from dcp_jax.runtime import oracle
from dcp_jax.runtime.runner import ModelRunner
from dcp_jax.serving.llm import LLM
from pallas_kernels.formats import E4M3_MAX

from tests.oracle import golden

KW = dict(max_model_len=64, max_num_seqs=2, page_size=4, dtype="float32", kernels="reference",
          max_num_batched_tokens=64)
PROMPTS = [list(range(3, 40)), [7, 11, 300, 41, 5, 99, 23, 8, 17]]


def test_per_channel_format_one_scale_an_output_channel():
    w = jax.random.normal(jax.random.key(0), (6, 4, 5)) * jnp.arange(1, 6)  # [Q, H, K]: in Q, out (H, K)
    q = fp8_linear.quantize_channels(w, (-3,), (-2, -1))
    assert q.values.dtype == jnp.float8_e4m3fn and q.values.shape == (4, 5, 6) and q.scales.shape == (20,)
    amax = np.abs(np.asarray(w)).max(axis=0).reshape(-1)
    np.testing.assert_allclose(q.scales, amax / E4M3_MAX, rtol=1e-6)
    assert q.shape == w.shape
    np.testing.assert_allclose(fp8_linear.dequantize_channels(q), w, rtol=2**-3, atol=0)  # e4m3: 3 mantissa bits


def test_the_product_quantizes_each_token_over_what_it_contracts():
    """x @ W with W per-channel: each row of x quantized with one scale (amax / 448) over its contracted inputs, the
    weight dequantized; the row scale and the channel scale factor out of the f32 sum."""
    x = jax.random.normal(jax.random.key(1), (3, 2, 8))  # [R, H, V], contracted over (H, V)
    w = jax.random.normal(jax.random.key(2), (2, 8, 16))  # [H, V, D]
    q = fp8_linear.quantize_channels(w, (-3, -2), (-1,))
    got = fp8_linear.einsum("rhv,hvd->rd", x, q, backend="pallas")
    rows = np.asarray(x).reshape(3, -1)
    scale = np.abs(rows).max(-1, keepdims=True) / E4M3_MAX
    x8 = np.asarray(jnp.asarray(rows / scale).astype(jnp.float8_e4m3fn).astype(jnp.float32)) * scale
    want = x8 @ np.asarray(fp8_linear.dequantize_channels(q)).reshape(16, 16)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("equation, x_shape, w_shape, axes", [
    ("rd,dn->rn", (5, 32), (32, 48), ((-2,), (-1,))),  # wqkv_a
    ("rq,qhk->rhk", (3, 32), (32, 2, 24), ((-3,), (-2, -1))),  # wq_b: two output axes
    ("rhv,hvd->rd", (4, 2, 16), (2, 16, 32), ((-3, -2), (-1,))),  # wo: two contracted axes
    ("...d,dgf->...gf", (2, 3, 32), (32, 2, 16), ((-3,), (-1,))),  # gate_up: the pair stacked along N
], ids=["wqkv_a", "wq_b", "wo", "gate_up"])
def test_the_fp8_gemm_kernel_multiplies_per_channel_weights(equation, x_shape, w_shape, axes):
    """Under a kernels backend the product is one fp8 GEMM of scale blocks (1, K) (the Triton kernel, interpreted):
    equal to the reference's dequantized product to f32 rounding."""
    x = jax.random.normal(jax.random.key(3), x_shape)
    q = fp8_linear.quantize_channels(jax.random.normal(jax.random.key(4), w_shape), *axes)
    got = fp8_linear.einsum(equation, x, q, backend="pallas")
    want = fp8_linear.einsum(equation, x, q, backend="reference")
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_ptpc_quantizes_the_linear_layers_but_the_experts():
    params = jax.eval_shape(lambda: fp8_linear.quantize_channels_params(init_params(TINY_GLM, seed=0)))
    leaves = {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(
        params, is_leaf=fp8_linear.is_quantized)[0]}
    channel = {name for name, leaf in leaves.items() if isinstance(leaf, Fp8ChannelWeight)}
    for name in ("['dense_layers']['attention']['wqkv_a']", "['dense_layers']['attention']['index_wq']",
                 "['moe_layers']['attention']['wo']", "['dense_layers']['mlp']['gate_up']",
                 "['dense_layers']['mlp']['down']", "['moe_layers_1']['attention']['w_uk']"):
        assert any(n.startswith(name) for n in channel), name
    assert not any("experts" in n or "['shared']" in n or "router" in n or "index_weights" in n
                   or n.startswith(("['embed']", "['lm_head']")) for n in channel)


def _prompt_logprobs(runner):
    """Log-softmax at every position of PROMPTS (one prefill step each) through `runner`, NaN past a prompt."""
    tables = golden.block_tables(runner.engine, runner.parallel.dcp, len(PROMPTS), seed=1)
    logits, _, _ = oracle.prefill(runner, PROMPTS, tables, all_logits=True)
    return np.asarray(jax.nn.log_softmax(logits, axis=-1))


def test_a_ptpc_model_is_its_dequantized_weights_and_per_token_activations():
    """tiny-glm under ptpc_fp8 at 2 TP x 2 DCP ranks: with the activations' quantization left out it equals the f32
    model of its dequantized weights (to f32 rounding), so the format, the split scales and the product are right
    (the per-token step is `test_the_product_quantizes_each_token_over_what_it_contracts`). Measured beside it on
    one device: every prompt token's logprob moves from the f32 model's by a mean 0.25 (max 3.6) under ptpc_fp8 and
    0.31 (3.5) under DeepSeek's block fp8: five random layers amplify fp8's error alike."""
    ptpc = LLM("tiny-glm", quantization="ptpc_fp8", tp=2, dcp=2, **KW).runner
    assert isinstance(ptpc.params["dense_layers"]["attention"]["wqkv_a"], Fp8ChannelWeight)
    params = jax.device_get(ptpc.params)
    dequantized = jax.tree.map(
        lambda leaf: fp8_linear.dequantize_channels(leaf) if isinstance(leaf, Fp8ChannelWeight) else leaf,
        params, is_leaf=lambda leaf: isinstance(leaf, Fp8ChannelWeight))
    parallel = ParallelConfig(tp=2, dcp=2)
    mesh = make_mesh(parallel)
    plain = _prompt_logprobs(ModelRunner(TINY_GLM, dequantized, parallel, ptpc.engine, mesh, "reference"))
    with mock.patch.object(fp8_linear, "_quantized_activations", lambda x, axes, group: x.astype(jnp.float32)):
        unquantized_activations = _prompt_logprobs(ModelRunner(TINY_GLM, params, parallel, ptpc.engine, mesh,
                                                               "reference"))
    valid = ~np.isnan(plain)
    np.testing.assert_allclose(unquantized_activations[valid], plain[valid], atol=1e-4)


def test_ptpc_composes_with_an_mxfp4_checkpoint(tmp_path):
    """The seed's combination: a Quark MXFP4 checkpoint under ptpc_fp8 keeps its routed experts MXFP4 (not
    requantized) and its other linear layers per-channel fp8; a block-fp8 checkpoint is refused."""
    golden.write_checkpoint("glm52_mxfp4", tmp_path)
    llm = LLM(str(tmp_path), quantization="ptpc_fp8", tp=2, dcp=2, **KW)
    moe = llm.runner.params["moe_layers"]
    assert mxfp4.is_mxfp4(moe["mlp"]["experts_gate"]) and isinstance(moe["attention"]["wo"], Fp8ChannelWeight)
    assert not fp8_linear.is_quantized(moe["mlp"]["shared"]["gate_up"])
    assert len(llm.generate(prompt_token_ids=PROMPTS[1:])[0].outputs[0].token_ids) > 0
