"""HF safetensors in and out (`dcp_jax/weights.py`): strict loading, sharded placement, exact round trip."""

import dataclasses
import json
import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from dcp_jax.model.architecture import config_from_hf
from dcp_jax.model.architecture import config_from_dict
from dcp_jax.config import TINY, EngineConfig, ParallelConfig
from dcp_jax.model import fp8_linear, weights
from dcp_jax.model.mesh import HEADS, make_mesh
from dcp_jax.model.deepseek_v32 import (abstract_model, check_divisible, init_params, layer_params,
                                         layer_stacks, stack_of)
from dcp_jax.model.deepseek_v32 import abstract_mtp, init_mtp_params
from dcp_jax.model.deepseek_v32 import DeepseekCheckpoint
from dcp_jax.model.weights import load_hf_params, load_mtp_params, save_hf
from dcp_jax.runtime.runner import ModelRunner
from dcp_jax.runtime import oracle

from tests.oracle import hf_tiny

# The HF tensor-name map of the model file.
CHECKPOINT = DeepseekCheckpoint()
hf_tensor_shapes, layer_to_hf, layer_to_ours, mtp_to_hf = (CHECKPOINT.tensor_shapes, CHECKPOINT.layer_to_hf,
                                                          CHECKPOINT.layer_to_ours, CHECKPOINT.mtp_to_hf)
HF_CONFIG = hf_tiny.tiny_configs()["default_rope"]
CFG = config_from_dict(HF_CONFIG)


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


def test_fp8_values_kept_k_major_are_the_checkpoints_bytes(tensors):
    """The K-major values of the fp8 leaves are views of the HF [out, in] tensors (no host copy); wqkv_a (q_a_proj
    then kv_a_proj_with_mqa), gate_up (gate_proj and up_proj) and the routed experts are one stacked copy in the
    checkpoint's order (contiguous: placing them copies nothing more)."""
    for layer in range(CFG.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        hf = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        ours = layer_to_ours(CFG, layer, hf)
        attention = ours["attention"]
        for leaf, name in (("wq_b", "q_b_proj"), ("wo", "o_proj"), ("index_wq", "indexer.wq_b"),
                           ("index_wk", "indexer.wk")):
            values = fp8_linear.from_plain_layout(attention[leaf], None, BLOCK, *fp8_linear.FP8_AXES[leaf]).values
            assert np.shares_memory(values, hf[f"self_attn.{name}.weight"]), leaf
            assert values.flags.c_contiguous, leaf
        values = fp8_linear.from_plain_layout(attention["wqkv_a"], None, BLOCK, *fp8_linear.FP8_AXES["wqkv_a"]).values
        np.testing.assert_array_equal(values, np.concatenate([hf["self_attn.q_a_proj.weight"],
                                                              hf["self_attn.kv_a_proj_with_mqa.weight"]]))
        assert values.flags.c_contiguous
        if "shared" in ours["mlp"]:
            mlp, hf_mlp = ours["mlp"]["shared"], "mlp.shared_experts."
        else:
            mlp, hf_mlp = ours["mlp"], "mlp."
        values = fp8_linear.from_plain_layout(mlp["gate_up"], None, BLOCK, *fp8_linear.FP8_AXES["gate_up"]).values
        np.testing.assert_array_equal(values, np.stack([hf[hf_mlp + "gate_proj.weight"],
                                                        hf[hf_mlp + "up_proj.weight"]]))
        assert values.flags.c_contiguous
        if "experts_gate" in ours["mlp"]:
            for kind in ("gate", "up", "down"):
                leaf = f"experts_{kind}"
                values = fp8_linear.from_plain_layout(ours["mlp"][leaf], None, BLOCK, *fp8_linear.FP8_AXES[leaf])
                assert values.values.flags.c_contiguous, leaf


def _spec(placed: jax.Array) -> P:
    """The PartitionSpec of an array, with the trailing Nones a jit output's spec may drop written out."""
    spec = tuple(placed.sharding.spec)
    return P(*spec, *(None,) * (placed.ndim - len(spec)))


def test_load_places_heads_and_experts_split_and_save_round_trips(checkpoint, tensors, tmp_path):
    mesh = make_mesh(ParallelConfig(tp=4, dcp=2))
    params = load_hf_params(CFG, checkpoint, mesh)  # routed experts split along their width F
    moe = stack_of(CFG, 1)  # placed as a stack: its leading (layer) axis whole on every rank
    attention = params[moe.name]["attention"]
    assert _spec(attention["wq_b"]) == P(None, None, HEADS, None)
    assert _spec(attention["wo"]) == P(None, HEADS, None, None)
    assert attention["wq_b"].addressable_shards[0].data.shape[:3] == (moe.count, CFG.q_lora_rank,
                                                                       CFG.num_attention_heads // 4)
    mlp = params[moe.name]["mlp"]
    assert _spec(mlp["experts_gate"]) == P(None, None, None, HEADS)
    assert _spec(mlp["experts_down"]) == P(None, None, HEADS, None)
    assert mlp["experts_gate"].addressable_shards[0].data.shape == (moe.count, CFG.n_routed_experts,
                                                                     CFG.hidden_size, CFG.moe_intermediate_size // 4)
    assert _spec(mlp["shared"]["down"]) == P(None, HEADS, None)
    assert _spec(mlp["shared"]["gate_up"]) == P(None, None, None, HEADS)  # [L, D, 2, F]: F split, the pair whole
    assert _spec(mlp["router"]) == P(None, None, None)  # replicated
    # HF's kv_b_proj rows are [k_nope | v] per head: w_uk is the first qk_nope_head_dim rows of head 0.
    kv_b = tensors["model.layers.0.self_attn.kv_b_proj.weight"]
    np.testing.assert_array_equal(np.asarray(layer_params(CFG, params, 0)["attention"]["w_uk"])[0],
                                  kv_b[: CFG.qk_nope_head_dim])
    save_hf(CFG, params, tmp_path)
    saved = hf_tiny.read_safetensors(tmp_path / "model.safetensors")
    assert saved.keys() == tensors.keys()
    for name in tensors:
        np.testing.assert_array_equal(saved[name], tensors[name], err_msg=name)
    assert config_from_hf(tmp_path) == CFG


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


def test_the_first_layers_of_a_checkpoint_load_alone(checkpoint):
    """A config with fewer layers than the checkpoint loads its first layers and skips the rest (not an error:
    the count is asked for), equal to the same layers of a full load."""
    full = load_hf_params(CFG, checkpoint)
    two_layers = dataclasses.replace(CFG, num_hidden_layers=2)
    first = load_hf_params(two_layers, checkpoint)
    stacks = layer_stacks(two_layers)
    assert [stack.count for stack in stacks] == [1, 1]
    want = {**full, **{stack.name: jax.tree.map(lambda a, n=stack.count: a[:n], full[stack.name]) for stack in stacks}}
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_random_init_fills_every_parameter():
    _, abstract = abstract_model(TINY)
    params = init_params(TINY, seed=0)
    want = jax.tree.map(lambda a: a.shape, jax.tree.leaves(abstract))
    assert [p.shape for p in jax.tree.leaves(params)] == want
    assert not np.allclose(layer_params(TINY, params, 0)["attention"]["q_a_norm"], 1.0)


def test_expert_parallel_load_places_whole_experts_on_each_rank(checkpoint):
    mesh = make_mesh(ParallelConfig(tp=4, dcp=2, enable_expert_parallel=True))
    moe = stack_of(CFG, 1)
    mlp = load_hf_params(CFG, checkpoint, mesh, expert_parallel=True)[moe.name]["mlp"]
    for name in ("experts_gate", "experts_up", "experts_down"):
        assert _spec(mlp[name]) == P(None, HEADS, None, None)
    assert mlp["experts_gate"].addressable_shards[0].data.shape == (moe.count, CFG.n_routed_experts // 4,
                                                                     CFG.hidden_size, CFG.moe_intermediate_size)
    assert _spec(mlp["shared"]["down"]) == P(None, HEADS, None)


def test_tp_must_divide_every_split_dimension():
    for expert_parallel in (False, True):
        check_divisible(CFG, 4, expert_parallel=expert_parallel)
        with pytest.raises(ValueError, match="tp=3 must divide"):
            check_divisible(CFG, 3, expert_parallel=expert_parallel)
    # Expert parallelism splits the expert count X, tensor parallelism each expert's width F.
    twelve_experts = dataclasses.replace(CFG, n_routed_experts=12)
    check_divisible(twelve_experts, 8, expert_parallel=False)
    with pytest.raises(ValueError, match=r"tp=8 must divide \{'n_routed_experts': 12\} \(with expert parallelism\)"):
        check_divisible(twelve_experts, 8, expert_parallel=True)
    narrow = dataclasses.replace(CFG, moe_intermediate_size=36, n_shared_experts=2)
    check_divisible(narrow, 8, expert_parallel=True)
    with pytest.raises(ValueError, match=r"\{'moe_intermediate_size': 36\} \(without expert parallelism\)"):
        check_divisible(narrow, 8, expert_parallel=False)


BLOCK = (8, 12)  # not a divisor of every dimension: edge blocks are partial


def _is_quantized(name: str, shape) -> bool:
    """What DeepSeek's release stores in fp8: the 2-D projections of attention, indexer and MLP."""
    return len(shape) == 2 and (".self_attn." in name or ".mlp." in name) and not name.endswith(
        ("weights_proj.weight", "mlp.gate.weight"))


def _block_fp8(tensors, block=BLOCK, is_quantized=_is_quantized):
    """(fp8 tensors with their *_scale_inv, the f32 weights they stand for), in blocks of `block`, of the tensors
    `is_quantized(name, shape)` picks."""
    import ml_dtypes

    BLOCK = block  # noqa: N806
    quantized, dequantized = {}, dict(tensors)
    for name, w in tensors.items():
        if not is_quantized(name, w.shape):
            continue
        rows, cols = -(-w.shape[0] // BLOCK[0]), -(-w.shape[1] // BLOCK[1])
        padded = np.zeros((rows * BLOCK[0], cols * BLOCK[1]), np.float32)
        padded[: w.shape[0], : w.shape[1]] = np.abs(w)
        scale = padded.reshape(rows, BLOCK[0], cols, BLOCK[1]).max(axis=(1, 3)) / 448 + 1e-12
        full = np.repeat(np.repeat(scale, BLOCK[0], 0), BLOCK[1], 1)[: w.shape[0], : w.shape[1]]
        q = (w / full).astype(ml_dtypes.float8_e4m3fn)
        quantized[name], quantized[name + "_scale_inv"] = q, scale.astype(np.float32)
        dequantized[name] = q.astype(np.float32) * full
    return quantized, dequantized


def _write_fp8(path, tensors, config_extra):
    import json

    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(HF_CONFIG | config_extra))


FP8_CONFIG = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": list(BLOCK)}, "num_nextn_predict_layers": 1}


def test_block_fp8_checkpoint_loads_dequantized(tensors, checkpoint, tmp_path):
    """DeepSeek's release format: e4m3 weights with one f32 scale per 8 x 12 block and an MTP layer. Loading it
    dequantized (quantization "none") gives exactly the params of an f32 checkpoint holding the dequantized weights,
    within fp8 error of the originals."""
    quantized, dequantized = _block_fp8(tensors)
    mtp = {f"model.layers.{CFG.num_hidden_layers}.enorm.weight": np.ones(CFG.hidden_size, np.float32)}
    _write_fp8(tmp_path / "fp8", tensors | quantized | mtp, FP8_CONFIG)
    hf_tiny.write_checkpoint(HF_CONFIG, dequantized, tmp_path / "f32")
    got = load_hf_params(CFG, tmp_path / "fp8", quantization="none")
    want = load_hf_params(CFG, tmp_path / "f32")
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
    w, w0 = (np.asarray(layer_params(CFG, p, 1)["attention"]["wq_b"])
             for p in (got, load_hf_params(CFG, checkpoint)))
    assert 0 < np.linalg.norm(w - w0) / np.linalg.norm(w0) < 0.05


@pytest.mark.parametrize("change, message", [
    ("no_scale", "q_a_proj.weight: F8_E4M3 without a weight_scale_inv"),
    ("scale_shape", "q_a_proj.weight_scale_inv: file .*blocks of \\(8, 12\\)"),
    ("method", "unsupported quantization_config"),
    ("no_mtp", "unexpected tensors .*model.layers.3.enorm.weight"),
])
def test_block_fp8_errors_name_the_problem(tensors, tmp_path, change, message):
    quantized, _ = _block_fp8(tensors)
    files = tensors | quantized | {"model.layers.3.enorm.weight": np.ones(CFG.hidden_size, np.float32)}
    config = dict(FP8_CONFIG)
    scale = "model.layers.0.self_attn.q_a_proj.weight_scale_inv"
    if change == "no_scale":
        del files[scale]
    elif change == "scale_shape":
        files[scale] = files[scale][:, :1].copy()
    elif change == "method":
        config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    else:
        config["num_nextn_predict_layers"] = 0
    _write_fp8(tmp_path, files, config)
    with pytest.raises(ValueError, match=message):
        load_hf_params(CFG, tmp_path)


@pytest.mark.parametrize("block", [BLOCK, (32, 12)], ids=["8x12", "32x12"])
def test_block_fp8_checkpoint_stays_fp8(tensors, tmp_path, block):
    """Loaded with quantization "auto" (the default), the leaves DeepSeek stores in fp8 stay e4m3 with their block
    scales (edge blocks partial; at 32 rows wqkv_a's last, kv_a_proj_with_mqa's, is, as at DeepSeek's 576 rows and
    128), and each dequantizes to exactly the "none" load's weight."""
    quantized, _ = _block_fp8(tensors, block)
    blocks = {"weight_block_size": list(block)}
    _write_fp8(tmp_path, tensors | quantized | MTP,
               FP8_CONFIG | {"quantization_config": FP8_CONFIG["quantization_config"] | blocks})
    kept, dequantized = load_hf_params(CFG, tmp_path), load_hf_params(CFG, tmp_path, quantization="none")
    flat = jax.tree_util.tree_flatten_with_path(kept, is_leaf=fp8_linear.is_fp8)[0]
    fp8_names = set()
    for (path, a), b in zip(flat, jax.tree.leaves(dequantized)):
        if fp8_linear.is_fp8(a):
            fp8_names.add(path[-1].key)
            assert a.values.dtype == jnp.float8_e4m3fn and a.scales.dtype == jnp.float32 and a.block == block
            a = fp8_linear.dequantize(a)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
    assert fp8_names == set(fp8_linear.FP8_AXES)


def test_block_fp8_q_a_proj_must_fill_whole_blocks():
    """Kept in fp8, q_a_proj and kv_a_proj_with_mqa are one weight (wqkv_a) with their scale grids stacked, so
    q_a_proj's rows must end on a block edge (DeepSeek's 1536 do at 128)."""
    problems = weights._fp8_problems(dataclasses.replace(CFG, q_lora_rank=48), None, {}, {}, {}, (32, 32), True)
    assert problems == ["q_a_proj: its 48 rows do not fill blocks of 32, so its scales cannot be stacked with "
                        "kv_a_proj_with_mqa's in wqkv_a; load with quantization='none'"]
    assert not weights._fp8_problems(dataclasses.replace(CFG, q_lora_rank=64), None, {}, {}, {}, (32, 32), True)


# Blocks of 16 divide every dimension the tiny model splits over 2 ranks.
BLOCK16 = (16, 16)
FP8_16_CONFIG = FP8_CONFIG | {"quantization_config": FP8_CONFIG["quantization_config"]
                              | {"weight_block_size": list(BLOCK16)}}
MTP = {f"model.layers.{CFG.num_hidden_layers}.enorm.weight": np.ones(CFG.hidden_size, np.float32)}
ENGINE = EngineConfig(page_size=4, num_pages=32, max_num_seqs=2, max_model_len=32, bucket_ladder=(16,),
                      max_num_batched_tokens=16)
PROMPTS = [[5, 9, 17, 3, 88, 41, 7, 250, 13, 2, 64], [300, 12, 6, 77, 19, 1, 45]]


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory, tensors):
    path = tmp_path_factory.mktemp("fp8_16")
    _write_fp8(path, tensors | _block_fp8(tensors, BLOCK16)[0] | MTP, FP8_16_CONFIG)
    return path


@functools.cache
def _prompt_log_probs(path, tp: int, quantization: str, *, quantize_activations: bool = True) -> np.ndarray:
    """Log-softmax at every position of PROMPTS (one prefill step each) through the checkpoint on a tp x dcp 2
    mesh (dcp 1 at tp 1), NaN past a prompt; the fp8 GEMMs skip their activation quantization when
    `quantize_activations` is False."""
    if not quantize_activations:
        unquantized = mock.patch.object(fp8_linear, "_quantized_activations",
                                        lambda x, axes, group: x.astype(jnp.float32))
        with unquantized:
            return _prompt_log_probs.__wrapped__(path, tp, quantization)
    parallel = ParallelConfig(tp=tp, dcp=min(tp, 2))
    mesh = make_mesh(parallel)
    runner = ModelRunner(CFG, load_hf_params(CFG, path, mesh, quantization=quantization), parallel, ENGINE, mesh,
                         "reference")
    attention = layer_params(CFG, runner.params, 1)["attention"]
    wq_b = attention["wq_b"].values if quantization == "auto" else attention["wq_b"]
    assert wq_b.dtype == (jnp.float8_e4m3fn if quantization == "auto" else jnp.float32)
    blocks = ENGINE.max_blocks_per_seq(parallel.dcp)
    logits, _, _ = oracle.prefill(runner, PROMPTS, [list(range(blocks)), list(range(blocks, 2 * blocks))],
                                  all_logits=True)
    return np.asarray(jax.nn.log_softmax(logits, axis=-1))


def test_fp8_model_is_close_to_the_dequantized_one(fp8_checkpoint):
    """The checkpoint kept in fp8 and dequantized hold the same weight values; they differ by the run-time e4m3
    quantization of the activations before each fp8 GEMM (relative steps up to 2^-4), and only by it: without it
    the fp8 model matches to f32 rounding. Measured at tp 1: max |log-softmax diff| 0.32 (mean 0.047), greedy
    tokens 16 of 18 the same. The tiny random model's distributions are nearly flat (top token at 1.5-4 %), so
    near-ties flip; the bounds 0.5 and 14 of 18 leave room for other CPUs' rounding."""
    fp8, dequantized = _prompt_log_probs(fp8_checkpoint, 1, "auto"), _prompt_log_probs(fp8_checkpoint, 1, "none")
    valid = ~np.isnan(fp8)
    assert valid.sum() == sum(map(len, PROMPTS)) * CFG.vocab_size
    assert 0.01 < np.abs(fp8 - dequantized)[valid].max() < 0.5
    rows = valid[..., 0]
    assert np.sum(fp8.argmax(-1)[rows] == dequantized.argmax(-1)[rows]) >= 14
    unquantized = _prompt_log_probs(fp8_checkpoint, 1, "auto", quantize_activations=False)
    np.testing.assert_allclose(unquantized[valid], dequantized[valid], atol=2e-5)


def test_fp8_model_sharded_equals_one_device(fp8_checkpoint):
    """At tp 2 x dcp 2 the fp8 model (scales split with their values) equals itself on one device, compared with
    the activations unquantized: with them quantized, f32 reordering upstream (the TP psum, the DCP merge) flips
    some e4m3 roundings, so the two differ by up to fp8 error (measured 0.15 max |log-softmax diff|)."""
    sharded, one_device = (_prompt_log_probs(fp8_checkpoint, tp, "auto", quantize_activations=False) for tp in (2, 1))
    valid = ~np.isnan(one_device)
    np.testing.assert_allclose(sharded[valid], one_device[valid], atol=1e-4)


@pytest.mark.parametrize("change, message", [
    ("nan", "q_b_proj.weight_scale_inv: a non-finite or non-positive scale"),
    ("zero", "o_proj.weight_scale_inv: a non-finite or non-positive scale"),
    ("unquantized", "q_a_proj.weight: F32 without a weight_scale_inv; load with quantization='none'"),
    ("tp4", "experts_down.*a rank's input slice of 8 is not a whole number of fp8 blocks of 16"),
])
def test_malformed_fp8_weights_are_refused_before_placing(tensors, tmp_path, change, message):
    quantized, _ = _block_fp8(tensors, BLOCK16)
    layer = "model.layers.1.self_attn."
    mesh = None
    if change == "nan":
        quantized[layer + "q_b_proj.weight_scale_inv"][0, 0] = np.nan
    elif change == "zero":
        quantized[layer + "o_proj.weight_scale_inv"][1, 0] = 0.0
    elif change == "unquantized":
        del quantized["model.layers.0.self_attn.q_a_proj.weight"], quantized[
            "model.layers.0.self_attn.q_a_proj.weight_scale_inv"]
    else:
        mesh = make_mesh(ParallelConfig(tp=4, dcp=2))  # expert width 32 / 4 ranks = 8 < one block
    _write_fp8(tmp_path, tensors | quantized | MTP, FP8_16_CONFIG)
    placed = jax.live_arrays()
    with pytest.raises(ValueError, match=message):
        load_hf_params(CFG, tmp_path, mesh)
    assert len(jax.live_arrays()) == len(placed)


MTP_CFG = dataclasses.replace(CFG, num_nextn_predict_layers=1)
MTP_LAYER = f"model.layers.{CFG.num_hidden_layers}."


def _with_mtp_layer(tensors) -> dict:
    """`tensors` and a random MTP layer's (`mtp_to_hf`; its copies of the embedding and head are the model's)."""
    main = {"embed": tensors["model.embed_tokens.weight"], "lm_head": tensors["lm_head.weight"].T}
    return tensors | mtp_to_hf(MTP_CFG, jax.tree.map(np.asarray, init_mtp_params(MTP_CFG, seed=7)), main)


def _mtp_leaves(mtp: dict) -> dict:
    flat = jax.tree_util.tree_flatten_with_path(mtp, is_leaf=fp8_linear.is_fp8)[0]
    return {jax.tree_util.keystr(path): leaf for path, leaf in flat}


def test_block_fp8_mtp_layer_loads_as_the_decoder_layers_do(tensors, tmp_path):
    """The MTP layer of DeepSeek's release format, its decoder layer in block fp8 (and eh_proj too here, should a
    checkpoint store it so): "auto" keeps the decoder layer's fp8 leaves e4m3, each dequantizing to the "none"
    load's weight; "none" equals the MTP layer of an f32 checkpoint holding the dequantized tensors."""
    full = _with_mtp_layer(tensors)
    quantized, dequantized = _block_fp8(full, is_quantized=lambda name, shape: _is_quantized(name, shape) or (
        name == MTP_LAYER + "eh_proj.weight"))
    assert MTP_LAYER + "eh_proj.weight_scale_inv" in quantized
    _write_fp8(tmp_path / "fp8", full | quantized, FP8_CONFIG)
    hf_tiny.write_checkpoint(HF_CONFIG | {"num_nextn_predict_layers": 1}, dequantized, tmp_path / "f32")
    loaded = load_mtp_params(MTP_CFG, tmp_path / "fp8")
    abstract = nnx.to_pure_dict(abstract_mtp(MTP_CFG, jnp.float32, BLOCK)[1])  # what the runner builds it as
    assert jax.tree.structure(loaded) == jax.tree.structure(abstract)
    assert all(a.shape == b.shape and a.dtype == b.dtype for a, b in zip(jax.tree.leaves(loaded),
                                                                            jax.tree.leaves(abstract)))
    kept = _mtp_leaves(loaded)
    none = _mtp_leaves(load_mtp_params(MTP_CFG, tmp_path / "fp8", quantization="none"))
    want = _mtp_leaves(load_mtp_params(MTP_CFG, tmp_path / "f32"))
    assert none.keys() == want.keys() == kept.keys()
    fp8_leaves = {name for name, leaf in kept.items() if fp8_linear.is_fp8(leaf)}
    assert {name.split("'")[-2] for name in fp8_leaves} >= {"wqkv_a", "wq_b", "wo"}
    assert all(name.startswith("['layer']") for name in fp8_leaves)  # eh_proj dequantized: a plain einsum takes it
    for name, leaf in kept.items():
        np.testing.assert_array_equal(none[name], want[name], err_msg=name)
        if fp8_linear.is_fp8(leaf):
            assert leaf.values.dtype == jnp.float8_e4m3fn and leaf.block == BLOCK
            leaf = fp8_linear.dequantize(leaf)
        np.testing.assert_array_equal(np.asarray(leaf), none[name], err_msg=name)


def test_block_fp8_mtp_layer_without_a_scale_is_refused(tensors, tmp_path):
    full = _with_mtp_layer(tensors)
    quantized, _ = _block_fp8(full)
    del quantized[MTP_LAYER + "self_attn.o_proj.weight_scale_inv"]
    _write_fp8(tmp_path, full | quantized, FP8_CONFIG)
    with pytest.raises(ValueError, match="o_proj.weight: F8_E4M3 without a weight_scale_inv"):
        load_mtp_params(MTP_CFG, tmp_path)


def test_quantization_fp8_quantizes_an_unquantized_checkpoint_on_load(tensors, checkpoint, tmp_path):
    """quantization "fp8" (vLLM's online fp8): an f32 checkpoint's FP8_AXES leaves, the MTP layer's too, become block
    fp8 of ONLINE_FP8_BLOCK, each the `fp8_linear.quantize` of the plain load's weight; the rest is the plain load's.
    A block fp8 checkpoint loads under "fp8" exactly as under "auto"."""
    from dcp_jax.config import ONLINE_FP8_BLOCK

    def assert_quantized(online, plain):
        """online's fp8 leaves are the quantized plain ones, the rest plain's; the same leaves either way."""
        flat = jax.tree_util.tree_flatten_with_path(online, is_leaf=fp8_linear.is_fp8)[0]
        plain_leaves = jax.tree.leaves(plain)
        assert len(flat) == len(plain_leaves) and fp8_linear.weight_block(online) == ONLINE_FP8_BLOCK
        for (path, got), want in zip(flat, plain_leaves):
            if fp8_linear.is_fp8(got):
                want = fp8_linear.quantize(want, ONLINE_FP8_BLOCK, *fp8_linear.FP8_AXES[path[-1].key])
                np.testing.assert_array_equal(np.asarray(got.scales), np.asarray(want.scales))
                got, want = got.values.astype(jnp.float32), want.values.astype(jnp.float32)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=jax.tree_util.keystr(path))

    assert_quantized(load_hf_params(CFG, checkpoint, quantization="fp8"), load_hf_params(CFG, checkpoint))
    hf_tiny.write_checkpoint(HF_CONFIG | {"num_nextn_predict_layers": 1}, _with_mtp_layer(tensors), tmp_path / "mtp")
    assert_quantized(load_mtp_params(MTP_CFG, tmp_path / "mtp", "fp8"), load_mtp_params(MTP_CFG, tmp_path / "mtp"))
    quantized, _ = _block_fp8(tensors)
    _write_fp8(tmp_path / "fp8", tensors | quantized | MTP, FP8_CONFIG)
    as_fp8, as_auto = (load_hf_params(CFG, tmp_path / "fp8", quantization=q) for q in ("fp8", "auto"))
    assert jax.tree.structure(as_fp8) == jax.tree.structure(as_auto)  # the blocks (pytree metadata) included
    for a, b in zip(jax.tree.leaves(as_fp8), jax.tree.leaves(as_auto)):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))


def test_a_deepseek_v3_block_fp8_checkpoint_stays_fp8(tensors, tmp_path):
    """DeepseekV3ForCausalLM (dense MLA, no indexer) in DeepSeek's block-fp8 release format: its MLA and MLP leaves
    stay e4m3 (every leaf of `fp8_linear.FP8_AXES` but the indexer's) and each dequantizes to exactly the "none"
    load's weight; the config reads as the dense architecture."""
    v3_tensors = {name: t for name, t in tensors.items() if ".indexer." not in name}
    quantized, _ = _block_fp8(v3_tensors)
    v3_config = {k: v for k, v in HF_CONFIG.items() if not k.startswith("index_")}
    v3_config |= FP8_CONFIG | {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
    _write_fp8(tmp_path, v3_tensors | quantized | MTP, {})
    (tmp_path / "config.json").write_text(json.dumps(v3_config))
    cfg = config_from_hf(tmp_path)
    assert cfg.architecture == "DeepseekV3ForCausalLM" and cfg.indexer is None
    kept, dequantized = load_hf_params(cfg, tmp_path), load_hf_params(cfg, tmp_path, quantization="none")
    flat = jax.tree_util.tree_flatten_with_path(kept, is_leaf=fp8_linear.is_fp8)[0]
    fp8_names = set()
    for (path, a), b in zip(flat, jax.tree.leaves(dequantized), strict=True):
        if fp8_linear.is_fp8(a):
            fp8_names.add(path[-1].key)
            a = fp8_linear.dequantize(a)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
    assert fp8_names == {name for name in fp8_linear.FP8_AXES if not name.startswith("index_")}


def test_a_glm_block_fp8_checkpoint_loads_kept_and_dequantized(tmp_path):
    """GLM-5's FP8 release layout (DeepSeek's 128 x 128 block e4m3 with weight_scale_inv, the indexer's
    weights_proj unquantized) on the IndexShare fixture's shapes: the full layers' indexer projections and every
    layer's MLA and MLP projections stay e4m3, the shared layers have no indexer at all, and each kept weight
    dequantizes to exactly the "none" load's."""
    from safetensors.numpy import save_file

    config = hf_tiny.tiny_configs()["glm52_index_share"]
    cfg = config_from_dict(config)
    glm_tensors = hf_tiny.random_tensors(config, seed=3)
    quantized, _ = _block_fp8(glm_tensors, BLOCK16)
    save_file({k: np.ascontiguousarray(v) for k, v in (glm_tensors | quantized).items()},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config | {"quantization_config": FP8_16_CONFIG[
        "quantization_config"]}))
    kept, dequantized = load_hf_params(cfg, tmp_path), load_hf_params(cfg, tmp_path, quantization="none")
    full, shared = layer_params(cfg, kept, 2)["attention"], layer_params(cfg, kept, 3)["attention"]
    assert fp8_linear.is_fp8(full["index_wq"]) and fp8_linear.is_fp8(shared["wq_b"]) and "index_wq" not in shared
    assert full["index_weights"].dtype == jnp.float32
    for layer in (2, 3):
        for name, leaf in layer_params(cfg, kept, layer)["attention"].items():
            want = layer_params(cfg, dequantized, layer)["attention"][name]
            np.testing.assert_array_equal(np.asarray(fp8_linear.weight_values(leaf, jnp.float32)), np.asarray(want),
                                          err_msg=f"layer {layer} {name}")
