"""HF safetensors in and out (`dcp_jax/weights.py`): strict loading, sharded placement, exact round trip."""

import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dcp_jax.config import TINY, ModelConfig, ParallelConfig
from dcp_jax.mesh import HEADS, make_mesh
from dcp_jax.model import abstract_model, check_divisible, init_params
from dcp_jax.weights import hf_tensor_shapes, layer_to_hf, layer_to_ours, load_hf_params, save_hf

sys.path.insert(0, str(Path(__file__).parent / "oracle"))
import hf_tiny  # noqa: E402

HF_CONFIG = hf_tiny.tiny_configs()["default_rope"]
CFG = ModelConfig.from_dict(HF_CONFIG)


@pytest.fixture(scope="module")
def tensors():
    return hf_tiny.random_tensors(HF_CONFIG, seed=5)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tensors):
    path = tmp_path_factory.mktemp("ckpt")
    hf_tiny.write_checkpoint(HF_CONFIG, tensors, path)
    return path


def test_expected_names_are_hf_names(tensors):
    """Our list of expected tensors is exactly what the HF-layout writer produces, shapes included."""
    assert hf_tensor_shapes(CFG) == {name: t.shape for name, t in tensors.items()}


def test_layer_converters_are_inverse(tensors):
    for layer in range(CFG.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        hf = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        back = layer_to_hf(CFG, layer, layer_to_ours(CFG, layer, hf))
        assert back.keys() == hf.keys()
        for name in hf:
            np.testing.assert_array_equal(back[name], hf[name], err_msg=name)


def test_load_places_heads_and_experts_split_and_save_round_trips(checkpoint, tensors, tmp_path):
    mesh = make_mesh(ParallelConfig(tp=4, dcp=2))
    params = load_hf_params(CFG, checkpoint, mesh)
    attention = params["layers"][1]["attention"]
    assert attention["wq_b"].sharding.spec == P(None, HEADS, None)
    assert attention["wo"].sharding.spec == P(HEADS, None, None)
    assert attention["wq_b"].addressable_shards[0].data.shape[1] == CFG.num_attention_heads // 4
    mlp = params["layers"][1]["mlp"]
    assert mlp["experts_gate"].sharding.spec == P(HEADS, None, None)
    assert mlp["experts_gate"].addressable_shards[0].data.shape[0] == CFG.n_routed_experts // 4
    assert mlp["shared"]["down"].sharding.spec == P(HEADS, None)
    assert mlp["router"].sharding.spec == P()
    # HF's kv_b_proj rows are [k_nope | v] per head: w_uk is the first qk_nope_head_dim rows of head 0.
    kv_b = tensors["model.layers.0.self_attn.kv_b_proj.weight"]
    np.testing.assert_array_equal(np.asarray(params["layers"][0]["attention"]["w_uk"])[0],
                                  kv_b[: CFG.qk_nope_head_dim])
    save_hf(CFG, params, tmp_path)
    saved = hf_tiny.read_safetensors(tmp_path / "model.safetensors")
    assert saved.keys() == tensors.keys()
    for name in tensors:
        np.testing.assert_array_equal(saved[name], tensors[name], err_msg=name)
    assert ModelConfig.from_hf(tmp_path) == CFG


@pytest.mark.parametrize("change, message", [
    ("missing", "missing tensors .*model.layers.1.mlp.experts.3.up_proj.weight"),
    ("unexpected", "unexpected tensors .*model.layers.3.input_layernorm.weight"),
    ("shape", "model.layers.0.self_attn.indexer.k_norm.bias: file \\(31,\\)"),
])
def test_strict_loading_names_the_problem(tensors, tmp_path, change, message):
    bad = dict(tensors)
    if change == "missing":
        del bad["model.layers.1.mlp.experts.3.up_proj.weight"]
    elif change == "unexpected":
        bad["model.layers.3.input_layernorm.weight"] = np.ones(CFG.hidden_size, np.float32)
    else:
        bad["model.layers.0.self_attn.indexer.k_norm.bias"] = np.ones(31, np.float32)
    hf_tiny.write_checkpoint(HF_CONFIG, bad, tmp_path)
    with pytest.raises(ValueError, match=message):
        load_hf_params(CFG, tmp_path)


def test_random_init_fills_every_parameter():
    _, abstract = abstract_model(TINY)
    params = init_params(TINY, seed=0)
    want = jax.tree.map(lambda a: a.shape, jax.tree.leaves(abstract))
    assert [p.shape for p in jax.tree.leaves(params)] == want
    assert not np.allclose(params["layers"][0]["attention"]["q_a_norm"], 1.0)


def test_tp_must_divide_every_split_dimension():
    check_divisible(CFG, 4)
    with pytest.raises(ValueError, match="tp=3 must divide"):
        check_divisible(CFG, 3)
