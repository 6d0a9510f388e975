"""dcp_jax/model/architecture.py: config.json's `architectures` picks the registry's entry, an architecture this
engine does not run is refused by name before any weight is read, so is a config field that would change the
computation but is not implemented, fields with no effect on inference are ignored; and no module but the registry
imports a model file."""

import ast
import dataclasses
import json
import pathlib

import pytest

from dcp_jax.config import TINY
from dcp_jax.model import architecture
from dcp_jax.model.architecture import (ARCHITECTURES, DEEPSEEK_V32, config_from_dict, config_from_hf, config_to_hf,
                                        with_hf_overrides)
from tests.oracle import hf_tiny

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "dcp_jax"
HF_CONFIG = hf_tiny.tiny_configs()["default_rope"]


def test_the_registry_reads_a_hf_config_into_its_architecture():
    cfg = config_from_dict(HF_CONFIG)
    assert cfg.architecture == "DeepseekV32ForCausalLM" and architecture.of(cfg) is DEEPSEEK_V32
    assert (cfg.indexer.heads, cfg.indexer.head_dim, cfg.indexer.topk) == (HF_CONFIG["index_n_heads"],
                                                                             HF_CONFIG["index_head_dim"],
                                                                             HF_CONFIG["index_topk"])
    assert DEEPSEEK_V32.attention.name == "dsa" and DEEPSEEK_V32.model.checkpoint is not None
    assert config_from_dict(config_to_hf(cfg)) == cfg and config_from_dict(config_to_hf(TINY)) == TINY


def test_an_unknown_architecture_is_refused_by_name_before_any_weight_is_read(tmp_path):
    from dcp_jax import LLM

    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG | {"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")  # never opened
    with pytest.raises(ValueError, match="architecture 'LlamaForCausalLM' is not supported; this engine runs "
                                         r"\['DeepseekV32ForCausalLM', 'DeepseekV3ForCausalLM', "
                                         r"'GlmMoeDsaForCausalLM'\]"):
        LLM(str(tmp_path))
    for bad in ([], ["A", "B"], "DeepseekV32ForCausalLM", None):
        with pytest.raises(ValueError, match="must name one architecture"):
            config_from_dict(HF_CONFIG | {"architectures": bad})


@pytest.mark.parametrize("field, value", [("tie_word_embeddings", True), ("hidden_act", "gelu"),
                                          ("scoring_func", "softmax"), ("topk_method", "greedy"),
                                          ("attention_bias", True), ("rope_interleave", False),
                                          ("moe_layer_freq", 2)])
def test_a_value_the_architecture_does_not_implement_is_refused_by_name(field, value):
    with pytest.raises(ValueError, match=f"config values not implemented by this engine: {field}={value!r}"):
        config_from_dict(HF_CONFIG | {field: value})
    implemented = DEEPSEEK_V32.reading.implemented[field][0]
    assert config_from_dict(HF_CONFIG | {field: implemented}) == config_from_dict(HF_CONFIG)


def test_an_unknown_field_is_refused_by_name_and_fields_without_effect_are_ignored(tmp_path):
    for extra in ({"index_topk_pattern": "FSS"}, {"indexer_types": ["full", "shared"]}, {"sliding_window": 128}):
        with pytest.raises(ValueError, match=rf"config fields \['{next(iter(extra))}'\] are not implemented"):
            config_from_dict(HF_CONFIG | extra)
    quiet = {"initializer_range": 0.02, "use_cache": False, "attention_dropout": 0.1, "transformers_version": "5.24",
             "pad_token_id": 3, "output_hidden_states": True, "ep_size": 8, "num_key_value_heads": 8}
    assert config_from_dict(HF_CONFIG | quiet) == config_from_dict(HF_CONFIG)
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG | {"mystery_switch": 1}))
    with pytest.raises(ValueError, match=r"config.json: DeepseekV32ForCausalLM: config fields \['mystery_switch'\]"):
        config_from_hf(tmp_path)


def test_the_indexer_fields_are_required_and_missing_fields_named():
    for name in ("index_topk", "hidden_size"):
        with pytest.raises(ValueError, match=rf"lacks required fields \['{name}'\]"):
            config_from_dict({k: v for k, v in HF_CONFIG.items() if k != name})
    with pytest.raises(ValueError, match="model_type 'llama' is not 'deepseek_v32'"):
        config_from_dict(HF_CONFIG | {"model_type": "llama"})


def test_hf_overrides_change_only_what_the_architecture_reads():
    assert with_hf_overrides(TINY, {"index_topk": 64}) == TINY.with_indexer(topk=64)
    with pytest.raises(ValueError, match=r"unknown config fields \['tie_word_embedding'\]"):
        with_hf_overrides(TINY, {"tie_word_embedding": True})
    with pytest.raises(ValueError, match="tie_word_embeddings=True"):
        with_hf_overrides(TINY, {"tie_word_embeddings": True})
    with pytest.raises(ValueError, match="has no indexer to change"):
        dataclasses.replace(TINY, indexer=None).with_indexer(topk=4)


def _imported_modules(path: pathlib.Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
            modules |= {f"{node.module}.{alias.name}" for alias in node.names}
    return modules


def test_no_module_but_the_registry_imports_a_model_file():
    model_files = {arch.model_file for arch in ARCHITECTURES.values()}
    importers = sorted(str(path.relative_to(PACKAGE.parent)) for path in PACKAGE.rglob("*.py")
                       if _imported_modules(path) & model_files)
    assert importers == [], f"{importers} import a model file; reach it through architecture.of(cfg).model"
    registry = (PACKAGE / "model" / "architecture.py").read_text()
    assert all(f'"{name}"' in registry for name in model_files)


def test_deepseek_v3_reads_kimi_k2_and_moonlight_configs():
    """DeepseekV3ForCausalLM: dense MLA (no indexer; its fields are unknown to it), under model_type deepseek_v3 or
    Kimi-K2's kimi_k2, with or without a low-rank query (Moonlight's q_lora_rank null; the indexer of V3.2 needs
    one)."""
    v3 = {k: v for k, v in HF_CONFIG.items() if not k.startswith("index_")}
    v3 |= {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
    cfg = config_from_dict(v3)
    assert cfg.architecture == "DeepseekV3ForCausalLM" and cfg.indexer is None
    assert config_from_dict(v3 | {"model_type": "kimi_k2"}) == cfg
    assert config_from_dict(v3 | {"q_lora_rank": None}).query_input_dim == cfg.hidden_size
    with pytest.raises(ValueError, match=r"config fields \['index_topk'\] are not implemented"):
        config_from_dict(v3 | {"index_topk": 16})
    with pytest.raises(ValueError, match="model_type 'llama' is not 'deepseek_v3' or 'kimi_k2'"):
        config_from_dict(v3 | {"model_type": "llama"})
    with pytest.raises(ValueError, match="q_lora_rank null is not implemented"):
        config_from_dict(HF_CONFIG | {"q_lora_rank": None})


def test_glm_reads_its_indexer_layout_and_hf_defaults():
    """GlmMoeDsaForCausalLM: fields config.json leaves out take HF's GlmMoeDsaConfig defaults (GLM-5's shapes); the
    indexer's RoPE is interleaved; the layer kinds come from `indexer_types`, else `index_topk_pattern`, else the
    `index_topk_freq` / `index_skip_topk_offset` schedule (HF's defaults: every layer full); and read back."""
    bare = config_from_dict({"architectures": ["GlmMoeDsaForCausalLM"]})
    assert (bare.hidden_size, bare.num_hidden_layers, bare.vocab_size, bare.n_group, bare.rms_norm_eps) == (
        6144, 78, 154880, 1, 1e-5)
    assert bare.indexer.rope_interleave and bare.indexer.layer_types is None
    assert not any(bare.shares_index_selection(layer) for layer in range(78))
    small = {"architectures": ["GlmMoeDsaForCausalLM"], "num_hidden_layers": 4, "first_k_dense_replace": 1}
    by_pattern = config_from_dict(small | {"index_topk_pattern": "FSSF"})
    by_types = config_from_dict(small | {"indexer_types": ["full", "shared", "shared", "full"]})
    by_schedule = config_from_dict(small | {"index_topk_freq": 3, "index_skip_topk_offset": 1})
    assert by_pattern == by_types == by_schedule
    assert [by_types.shares_index_selection(layer) for layer in range(5)] == [False, True, True, False, False]
    assert config_from_dict(config_to_hf(by_types)) == by_types
    assert config_from_dict(small | {"mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]}).num_hidden_layers == 4


@pytest.mark.parametrize("fields, message", [
    ({"mlp_layer_types": ["sparse", "dense", "sparse", "sparse"]}, "mlp_layer_types"),
    ({"layer_types": ["full_attention"] * 4}, "layer_types"),
    ({"indexer_types": ["shared", "full", "full", "full"]}, "layer 0 'full'"),
    ({"indexer_types": ["full", "full"]}, "each of the 4 layers"),
    ({"index_topk_pattern": "FXSF"}, "index_topk_pattern"),
    ({"indexer_rope_interleave": False}, "indexer_rope_interleave"),
])
def test_glm_layouts_it_does_not_run_are_refused_by_name(fields, message):
    small = {"architectures": ["GlmMoeDsaForCausalLM"], "num_hidden_layers": 4, "first_k_dense_replace": 1}
    with pytest.raises(ValueError, match=message):
        config_from_dict(small | fields)


def test_deepseek_v32_refuses_glms_indexer_types():
    raw = config_to_hf(TINY) | {"indexer_types": ["full", "shared"]}
    with pytest.raises(ValueError, match="indexer_types"):
        config_from_dict(raw)
