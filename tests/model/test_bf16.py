"""bf16 models: the weights HF keeps in fp32 stay fp32 and exact (loading and random init alike)."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dcp_jax.model.architecture import config_from_dict
from dcp_jax.config import TINY
from dcp_jax.model.deepseek_v32 import abstract_model, init_params, layer_params, layer_stacks, stack_of
from dcp_jax.model.weights import _check_filled, load_hf_params

from tests.oracle import hf_tiny

HF_CONFIG = hf_tiny.tiny_configs()["default_rope"]
CFG = config_from_dict(HF_CONFIG)
F32_KEPT = {("mlp", "router"): "mlp.gate.weight", ("mlp", "router_bias"): "mlp.gate.e_score_correction_bias",
            ("attention", "index_weights"): "self_attn.indexer.weights_proj.weight"}


@pytest.fixture(scope="module")
def tensors():
    return hf_tiny.random_tensors(HF_CONFIG, seed=11)


def test_bf16_load_keeps_hf_fp32_weights_exact(tensors, tmp_path):
    hf_tiny.write_checkpoint(HF_CONFIG, tensors, tmp_path)
    params = load_hf_params(CFG, tmp_path, dtype=jnp.bfloat16)
    seen = set()
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = [getattr(k, "key", None) for k in path]
        kept = F32_KEPT.get((names[-2], names[-1])) if len(names) >= 2 else None
        if kept is None:
            assert leaf.dtype == jnp.bfloat16, jax.tree_util.keystr(path)
            continue
        assert leaf.dtype == jnp.float32, jax.tree_util.keystr(path)
        stack = next(stack for stack in layer_stacks(CFG) if stack.name == names[0])
        for i, layer in enumerate(stack.layers):
            want = tensors[f"model.layers.{layer}.{kept}"]
            np.testing.assert_array_equal(np.asarray(leaf[i]), want.T if want.ndim == 2 else want)
        seen.add(kept)
    assert seen == set(F32_KEPT.values())  # the tiny config has a MoE layer


def test_random_init_keeps_the_same_fp32_leaves():
    _, abstract = abstract_model(TINY, jnp.bfloat16)
    params = init_params(TINY, seed=0, dtype=jnp.bfloat16)
    _check_filled(nnx.to_pure_dict(abstract), params)
    dense, moe = layer_params(TINY, params, 0), layer_params(TINY, params, 1)
    assert dense["attention"]["index_weights"].dtype == jnp.float32
    assert moe["mlp"]["router"].dtype == jnp.float32
    assert moe["mlp"]["router_bias"].dtype == jnp.float32
    assert dense["attention"]["wqkv_a"].dtype == jnp.bfloat16


def test_check_filled_rejects_a_wrong_dtype():
    _, abstract = abstract_model(TINY, jnp.bfloat16)
    abstract = nnx.to_pure_dict(abstract)
    params = init_params(TINY, seed=0, dtype=jnp.bfloat16)
    moe = params[stack_of(TINY, 1).name]["mlp"]
    moe["router"] = moe["router"].astype(jnp.bfloat16)
    with pytest.raises(ValueError, match="router.*dtype bfloat16 != model dtype float32"):
        _check_filled(abstract, params)
