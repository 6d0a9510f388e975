"""GLM-5.2 as AMD Quark exports it (amd/GLM-5.2-MXFP4): routed experts kept in MXFP4 (`dcp_jax/model/mxfp4.py`,
loaded by `weights.py` from a Quark `quantization_config`, `quark.py`) equal HF transformers' GlmMoeDsaForCausalLM on
the dequantized weights; what Quark can declare and this engine does not run is refused before any weight is read;
the memory plan of the real model in this format.

The fixture `glm52_mxfp4` (tests/oracle/README.md) is `glm52_index_share` with moe_intermediate_size 64 and a Quark
weight-only MXFP4 config: routed and shared experts stored as uint8 e2m1 codes and e8m0 scales drawn at random, the
rest float32; HF recorded its outputs on the checkpoint dequantized to float32 (HF reads Quark's fp4 only through
the quark package). The engine keeps the routed experts MXFP4 (the checkpoint's bytes), dequantizes the shared ones,
and runs in fp32 at tp = dcp 2 (each rank's 32 inputs of down_proj are one scale block): prefill log-softmax within
2e-3 of HF's at every position, greedy tokens equal, with the reference kernels and with the Pallas kernels
(interpreted on CPU).
"""

import dataclasses
import json

import jax
import numpy as np
import pytest

from dcp_jax.config import GLM52, EngineConfig, ParallelConfig
from dcp_jax.model import mxfp4, weights
from dcp_jax.model.architecture import config_from_hf
from dcp_jax.model.memory_plan import make_plan
from dcp_jax.model.mesh import make_mesh
from dcp_jax.model.weights import load_hf_params
from dcp_jax.runtime.runner import ModelRunner
from pallas_kernels.formats import Mxfp4Weight
from tests.oracle import golden, hf_tiny

NAME = "glm52_mxfp4"
TOL = 2e-3  # log-softmax agreement (fp32, highest matmul precision), as the other oracle tests
ENGINE = EngineConfig(page_size=4, num_pages=96, max_num_seqs=4, max_model_len=64, bucket_ladder=(4,),
                      max_num_batched_tokens=64)
ONE_SHOT = 64
PARALLEL = ParallelConfig(tp=2, dcp=2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp(NAME)
    return path, golden.write_checkpoint(NAME, path)


@pytest.fixture(scope="module")
def loaded(checkpoint):
    """(cfg, params) of the checkpoint at tp = dcp 2, routed experts kept MXFP4."""
    path, _ = checkpoint
    cfg = config_from_hf(path)
    return cfg, load_hf_params(cfg, path, make_mesh(PARALLEL))


_RESULTS = {}


def run(checkpoint, loaded, kernels: str, chunk: int):
    if kernels not in _RESULTS:
        cfg, params = loaded
        runner = ModelRunner(cfg, params, PARALLEL, ENGINE, make_mesh(PARALLEL), kernels)
        fx = golden.fixture(NAME)
        tables = golden.block_tables(ENGINE, PARALLEL.dcp, len(fx["prompt_lens"]), seed=7)
        _RESULTS[kernels] = golden.run_greedy(runner, fx, tables, chunk)
    return _RESULTS[kernels]


def test_checkpoint_is_the_one_written_for_hf(checkpoint):
    """The rebuilt bytes are the fixture's, its config a Quark one, and its dequantized float32 copy the one HF
    read."""
    path, sha = checkpoint
    fx = golden.fixture(NAME)
    assert sha == str(fx["checkpoint_sha256"])
    config = json.loads((path / "config.json").read_text())
    assert config == json.loads(str(fx["config_json"])) and config["quantization_config"]["quant_method"] == "quark"
    hf_cfg, hf_tensors = hf_tiny.dequantized(config, hf_tiny.read_safetensors(path / "model.safetensors"))
    assert hf_tiny.write_checkpoint(hf_cfg, hf_tensors, path.parent / "hf") == str(fx["hf_checkpoint_sha256"])


def test_routed_experts_stay_mxfp4_as_the_checkpoints_bytes(checkpoint, loaded):
    """Every MoE layer's routed experts are Mxfp4Experts whose packed codes and scales are the checkpoint's uint8
    tensors stacked (no repacking), split over F on the two ranks (gate / up along out, down along in: 32 inputs,
    one scale block, a rank); the shared experts are plain, their dequantized values."""
    path, _ = checkpoint
    cfg, params = loaded
    stored = hf_tiny.read_safetensors(path / "model.safetensors")
    moe_layers = [layer for layer in range(cfg.num_hidden_layers) if cfg.is_moe_layer(layer)]
    from dcp_jax.model.deepseek_v32 import layer_params, stack_of

    for layer in moe_layers:
        mlp = layer_params(cfg, params, layer)["mlp"]
        stack = stack_of(cfg, layer).name
        for kind in ("gate", "up", "down"):
            leaf = params[stack]["mlp"][f"experts_{kind}"]
            assert isinstance(leaf, Mxfp4Weight) and mxfp4.is_mxfp4(leaf) and leaf.activations == "model_dtype"
            assert leaf.packed.dtype == np.uint8 and leaf.scales.dtype == np.uint8
            name = f"model.layers.{layer}.mlp.experts.{{}}.{kind}_proj.weight"
            want = np.stack([stored[name.format(x)] for x in range(cfg.n_routed_experts)])
            want_scales = np.stack([stored[name.format(x) + "_scale"] for x in range(cfg.n_routed_experts)])
            np.testing.assert_array_equal(np.asarray(mlp[f"experts_{kind}"].packed), want)
            np.testing.assert_array_equal(np.asarray(mlp[f"experts_{kind}"].scales), want_scales)
            # A rank's share: gate / up [X, F/2, D/2] codes and [X, F/2, D/32] scales (F = 64 split along out), down
            # [X, D, F/2/2] and [X, D, F/2/32] (along in: 32 inputs, one block).
            layers = leaf.packed.shape[0]
            want_shards = {"gate": ((8, 32, 128), (8, 32, 8)), "up": ((8, 32, 128), (8, 32, 8)),
                           "down": ((8, 256, 16), (8, 256, 1))}[kind]
            assert leaf.packed.addressable_shards[0].data.shape == (layers, *want_shards[0])
            assert leaf.scales.addressable_shards[0].data.shape == (layers, *want_shards[1])
        shared = np.asarray(mlp["shared"]["down"])
        prefix = f"model.layers.{layer}.mlp.shared_experts.down_proj.weight"
        np.testing.assert_array_equal(shared, hf_tiny.dequantize_mxfp4(stored[prefix], stored[prefix + "_scale"]).T)
    bytes_routed = sum(x.nbytes for kind in ("gate", "up", "down")
                       for x in jax.tree.leaves(params["moe_layers"]["mlp"][f"experts_{kind}"]))
    per_weight = 0.5 + 1 / 32  # bytes
    one_layer = cfg.n_routed_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    assert bytes_routed == one_layer * per_weight * params["moe_layers"]["mlp"]["experts_gate"].packed.shape[0]


def test_prefill_logits_equal_hf_reference_kernels(checkpoint, loaded):
    result = run(checkpoint, loaded, "reference", 6)
    golden.assert_prefill_equal(golden.fixture(NAME), result["prefill_logits"], TOL)


def test_greedy_decode_equals_hf_reference_kernels(checkpoint, loaded):
    golden.assert_greedy_equal(golden.fixture(NAME), run(checkpoint, loaded, "reference", 6), TOL)


def test_prefill_and_greedy_decode_equal_hf_pallas_kernels(checkpoint, loaded):
    """The routed experts through the MXFP4 grouped-matmul Triton kernel (interpreted)."""
    fx = golden.fixture(NAME)
    result = run(checkpoint, loaded, "pallas", ONE_SHOT)
    golden.assert_prefill_equal(fx, result["prefill_logits"], TOL)
    golden.assert_greedy_equal(fx, result, TOL)


def test_quantization_none_loads_the_dequantized_experts(checkpoint, loaded):
    """Under "none" every MXFP4 module loads plain, the exact values of the kept leaves."""
    path, _ = checkpoint
    cfg, params = loaded
    plain = load_hf_params(cfg, path, quantization="none")
    assert mxfp4.experts_format(plain) is None
    for kind in ("gate", "up", "down"):
        kept = params["moe_layers"]["mlp"][f"experts_{kind}"]
        np.testing.assert_array_equal(np.asarray(plain["moe_layers"]["mlp"][f"experts_{kind}"]),
                                      np.asarray(mxfp4.dequantize(kept)))


def _write(tmp_path, change):
    """The fixture's config.json, changed by `change(config)`, with an empty model.safetensors: a refusal before
    any file is opened never notices."""
    config = hf_tiny.tiny_configs()[NAME]
    change(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"")
    return tmp_path, config_from_hf(tmp_path)


def _weight(**changes):
    def change(config):
        config["quantization_config"]["global_quant_config"]["weight"].update(changes)
    return change


def _set(path: tuple, value):
    def change(config):
        node = config["quantization_config"]
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return change


MXFP4_INPUTS = {"dtype": "fp4", "qscheme": "per_group", "group_size": 32, "scale_format": "e8m0", "is_dynamic": True}
QUARK_EXCLUDE = list(hf_tiny.QUARK_MXFP4["exclude"])


@pytest.mark.parametrize("change, message", [
    (_weight(dtype="fp8_e4m3"), "weight dtype 'fp8_e4m3'"),
    (_weight(dtype="fp6_e2m3"), "weight dtype 'fp6_e2m3'"),
    (_weight(qscheme="per_tensor"), "weight qscheme 'per_tensor'"),
    (_weight(qscheme="per_channel", group_size=None), "weight qscheme 'per_channel'"),
    (_weight(group_size=16), "weight group_size 16"),
    (_weight(scale_format="e4m3"), "scale_format 'e4m3'"),
    (_set(("global_quant_config", "input_tensors"), dict(MXFP4_INPUTS, is_dynamic=False)),
     "input_tensors is_dynamic False"),
    (_set(("global_quant_config", "input_tensors"), {"dtype": "fp8_e4m3", "qscheme": "per_tensor",
                                                     "is_dynamic": False}), "input_tensors dtype 'fp8_e4m3'"),
    (_set(("global_quant_config", "input_tensors"), dict(MXFP4_INPUTS, scale_calculation_mode="ceil")),
     "scale_calculation_mode 'ceil'"),
    (_set(("global_quant_config", "output_tensors"), dict(MXFP4_INPUTS)), "output_tensors quantized"),
    (_set(("exclude",), ["*self_attn*", "*mlp.gate", "*lm_head"]), "modules other than experts in MXFP4"),
    (_set(("exclude",), ["*mlp.gate", "*lm_head", "*mlp.gate_proj", "*mlp.up_proj", "*mlp.down_proj"]),
     "model.layers.0.self_attn"),
    (_set(("exclude",), QUARK_EXCLUDE + ["re:model\\.layers\\.2\\.mlp\\.experts\\..*"]),
     "in some layers or experts and not in others"),
    (_set(("layer_quant_config",), {"*experts.3.*": {"weight": None}}), "in some layers or experts"),
    (_set(("layer_quant_config",), {"*layers.4.mlp.experts*": {
        "weight": dict(hf_tiny.QUARK_MXFP4["global_quant_config"]["weight"]), "input_tensors": MXFP4_INPUTS}}),
     "different activation schemes"),
    (_set(("layer_type_quant_config",), {"Linear": {}}), "layer_type_quant_config"),
    (_set(("export", "kv_cache_group"), ["*kv_b_proj"]), "KV-cache quantization"),
    (_set(("export", "weight_format"), "fake_quantized"), "fake_quantized"),
    (_set(("algo_config",), [{"name": "rotation"}]), "algo_config ['rotation']"),
    (_set(("softmax_quant_spec",), {"dtype": "fp8_e4m3"}), "softmax"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_unsupported_quark_configs_are_refused_before_any_weight_is_read(tmp_path, change, message):
    path, cfg = _write(tmp_path, change)
    with pytest.raises(ValueError, match="Quark quantization_config not implemented") as error:
        load_hf_params(cfg, path)
    assert message in str(error.value)



def test_exclude_entries_match_as_vllm_and_quark_spell_them():
    """An exact module name, a "re:" regex (vLLM's rule) and an fnmatch pattern (Quark's --exclude_layers) each
    exclude; a pattern matches the whole name."""
    from dcp_jax.model import quark

    config = quark.read({"quant_method": "quark", "global_quant_config": {"weight": None},
                         "exclude": ["lm_head", "re:model\\.layers\\.\\d+\\.self_attn\\.", "*mlp.gate"]})
    assert config.excluded("lm_head") and not config.excluded("model.lm_head")
    assert config.excluded("model.layers.7.self_attn.q_a_proj")
    assert config.excluded("model.layers.3.mlp.gate") and not config.excluded("model.layers.3.mlp.gate_proj")
    assert not config.excluded("model.layers.3.mlp.shared_experts.gate_proj")


def test_reading_a_quark_config_imports_no_jax():
    """`quark.py` is a host module (the loader's and `dcp-jax plan`'s first look at a checkpoint)."""
    import subprocess
    import sys

    code = "import sys, dcp_jax.model.quark; sys.exit('jax' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_quantization_fp8_and_a_tp_splitting_scale_blocks_are_refused(checkpoint):
    path, _ = checkpoint
    cfg = config_from_hf(path)
    with pytest.raises(ValueError, match="quantization='fp8' does not apply to an AMD Quark MXFP4 checkpoint"):
        load_hf_params(cfg, path, quantization="fp8")
    with pytest.raises(ValueError, match="not a whole number of MXFP4 scale blocks of 32"):  # 64 / 4 = 16 inputs
        load_hf_params(cfg, path, make_mesh(ParallelConfig(tp=4, dcp=4)))


def test_a_tensor_contradicting_the_config_is_refused(checkpoint, tmp_path):
    """An excluded module stored in uint8 (here: the config excludes the shared experts the file holds in MXFP4)."""
    path, _ = checkpoint
    config = hf_tiny.tiny_configs()[NAME]
    config["quantization_config"]["exclude"] = QUARK_EXCLUDE + ["*shared_experts*"]
    tensors = hf_tiny.read_safetensors(path / "model.safetensors")
    hf_tiny.write_checkpoint(config, tensors, tmp_path)
    with pytest.raises(ValueError, match="unexpected tensors .*shared_experts.*weight_scale"):
        load_hf_params(config_from_hf(tmp_path), tmp_path)
    del_scales = {n: t for n, t in tensors.items() if not n.endswith("shared_experts.down_proj.weight_scale")}
    config["quantization_config"]["exclude"] = QUARK_EXCLUDE + ["*shared_experts.down_proj"]
    hf_tiny.write_checkpoint(config, del_scales, tmp_path)
    with pytest.raises(ValueError, match="shared_experts.down_proj.weight: U8, the Quark config says unquantized"):
        load_hf_params(config_from_hf(tmp_path), tmp_path)


def test_glm52_mxfp4_memory_plan_on_four_h200s():
    """GLM-5.2-MXFP4 at tp 4, dcp 4 in bf16: the 75 MoE layers' routed experts (256 x 3 x 6144 x 2048 weights a
    layer) at 0.5 + 1/32 bytes a weight over 4 ranks, 89.6 GiB per rank, in place of their 2 bytes (337.5 GiB);
    everything else as the bf16 plan has it (13.7 GiB: attention, shared experts, dense layers, embeddings). 103.4
    GiB of weights a rank leave an H200 (140.4 GiB) at gpu_memory_utilization 0.9 room for 1.6M tokens of context in
    the fp8 caches (bf16: no room); with ptpc_fp8 99.2 GiB and 1.9M tokens."""
    parallel = ParallelConfig(tp=4, dcp=4)
    kwargs = dict(dtype="bfloat16", device_bytes=143771 * 2**20, gpu_memory_utilization=0.9)
    plan = make_plan(GLM52, parallel, weight_format="mxfp4", **kwargs)
    bf16 = make_plan(GLM52, parallel, weight_format="model_dtype", **kwargs)
    routed = 75 * 256 * 3 * 6144 * 2048  # weights
    assert plan.weight_bytes == pytest.approx(bf16.weight_bytes - routed * 2 / 4 + routed * (0.5 + 1 / 32) / 4, abs=2)
    assert round(routed * (0.5 + 1 / 32) / 4 / 2**30, 1) == 89.6 and round(routed * 2 / 4 / 2**30, 1) == 337.5
    assert round(plan.weight_bytes / 2**30, 1) == 103.4
    assert bf16.pool_tokens["fp8", "fp8"] == 0 and plan.pool_tokens["fp8", "fp8"] == 1_610_240
    # The seed's --quantization ptpc_fp8 on top: attention, dense and the indexer's projections in per-channel fp8.
    ptpc = make_plan(GLM52, parallel, weight_format="mxfp4", channel_fp8=True, **kwargs)
    assert round(ptpc.weight_bytes / 2**30, 1) == 99.2 and ptpc.pool_tokens["fp8", "fp8"] == 1_907_968
    with pytest.raises(ValueError, match="weight_format='mxfp4'"):  # 2064 / 4 = 516 inputs a rank: 16 blocks + 4
        make_plan(dataclasses.replace(GLM52, moe_intermediate_size=2064), parallel, weight_format="mxfp4", **kwargs)


def test_plan_cli_reads_a_quark_checkpoint_as_mxfp4(checkpoint, capsys):
    from dcp_jax import cli

    path, _ = checkpoint
    assert cli.main(["plan", "--model", str(path), "-tp", "2", "-dcp", "2"]) == 0
    assert "weights in mxfp4 (the routed experts; the rest in the model dtype)" in capsys.readouterr().out
    assert weights.checkpoint_weight_format(str(path), config_from_hf(path)) == "mxfp4"


def test_declared_mxfp4_activations_reach_the_experts(tmp_path):
    """A config declaring dynamic MXFP4 inputs (as amd/GLM-5.2-MXFP4's does) keeps experts whose activations are
    quantize-dequantized with its scale rule; weight-only keeps them as they are; "none" keeps none."""
    path, cfg = _write(tmp_path, _set(("global_quant_config", "input_tensors"),
                                      dict(MXFP4_INPUTS, scale_calculation_mode="even")))
    assert weights.loaded_mxfp4_experts(str(path), cfg, "auto") == mxfp4.ExpertsFormat("mxfp4", "even")
    assert weights.loaded_mxfp4_experts(str(path), cfg, "none") is None
    path, cfg = _write(tmp_path, lambda config: None)
    assert weights.loaded_mxfp4_experts(str(path), cfg, "auto") == mxfp4.ExpertsFormat("model_dtype", None)


@pytest.mark.slow
def test_llm_serves_the_mxfp4_checkpoint(checkpoint):
    """`LLM` (serving/loading.py) loads the checkpoint with its routed experts MXFP4 and decodes HF's greedy
    tokens (two prompts at tp = dcp 2, reference kernels, fp32; slow: the runner cases above compare the same)."""
    from dcp_jax.host.sampling import SamplingParams
    from dcp_jax.serving.llm import LLM

    path, _ = checkpoint
    fx = golden.fixture(NAME)
    llm = LLM(model=str(path), tensor_parallel_size=2, dcp=2, kernels="reference", dtype="float32", max_num_seqs=2,
              max_model_len=64, num_pages=64, page_size=4, max_num_batched_tokens=64)
    assert mxfp4.experts_format(llm.runner.params) == mxfp4.ExpertsFormat()
    prompts = [fx["prompt_ids"][i, :fx["prompt_lens"][i]].tolist() for i in (0, 3)]
    out = llm.generate(sampling_params=SamplingParams(max_tokens=10, temperature=0.0), prompt_token_ids=prompts)
    assert [list(o.outputs[0].token_ids) for o in out] == fx["gen_tokens"][[0, 3]].tolist()


@pytest.mark.slow
def test_the_mtp_layers_mxfp4_experts_load_dequantized(checkpoint, tmp_path):
    """An MTP layer whose experts are MXFP4 (as its decoder layer's would be without amd/GLM-5.2-MXFP4's
    "*layers.78.*" exclusion) loads them plain, their exact values, under "auto" as under "none" (the runner's MTP
    layer takes plain experts); the main layers still keep theirs MXFP4."""
    from dcp_jax.model.deepseek_v32 import DeepseekCheckpoint, init_mtp_params
    from pallas_kernels.formats import quantize_mxfp4

    path, _ = checkpoint
    cfg = dataclasses.replace(config_from_hf(path), num_nextn_predict_layers=1)
    tensors = hf_tiny.read_safetensors(path / "model.safetensors")
    main = {"embed": tensors["model.embed_tokens.weight"], "lm_head": tensors["lm_head.weight"].T}
    mtp = DeepseekCheckpoint().mtp_to_hf(cfg, jax.tree.map(np.asarray, init_mtp_params(cfg, seed=3)), main)
    prefix = f"model.layers.{cfg.num_hidden_layers}.mlp."
    stored, values = dict(mtp), {}
    for name, t in mtp.items():
        if name.startswith((prefix + "experts.", prefix + "shared_experts.")):
            stored[name], stored[name + "_scale"] = quantize_mxfp4(np.asarray(t, np.float32))
            values[name] = hf_tiny.dequantize_mxfp4(stored[name], stored[name + "_scale"])
    config = hf_tiny.tiny_configs()[NAME] | {"num_nextn_predict_layers": 1}
    config["quantization_config"]["exclude"] = QUARK_EXCLUDE + ["*eh_proj", "*shared_head.head"]
    hf_tiny.write_checkpoint(config, tensors | stored, tmp_path)
    loaded = {q: weights.load_mtp_params(cfg, tmp_path, quantization=q) for q in ("auto", "none")}
    for kind in ("gate", "up", "down"):
        want = np.stack([values[f"{prefix}experts.{x}.{kind}_proj.weight"].T for x in range(cfg.n_routed_experts)])
        for q in ("auto", "none"):
            got = loaded[q]["layer"]["mlp"][f"experts_{kind}"]
            assert not mxfp4.is_mxfp4(got)
            np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(loaded["auto"]["layer"]["mlp"]["shared"]["down"],
                                  values[prefix + "shared_experts.down_proj.weight"].T)
    main_params = load_hf_params(config_from_hf(tmp_path), tmp_path)
    assert mxfp4.experts_format(main_params) == mxfp4.ExpertsFormat()
