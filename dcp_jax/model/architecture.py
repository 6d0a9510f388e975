"""The architecture registry: config.json's `architectures` -> an `Architecture` value, the one place that names
model files.

An `Architecture` is a HF architecture name, how its config.json reads (`ConfigReading`: which fields the model
uses, which it implements only for given values, which have no effect on inference), its model file (imported
on first use: the nnx modules, layer stacks, partition specs, initializers and the HF tensor-name map, exposed as
that file's `MODEL`, a `ModelFunctions`) and its attention variant (`attention/variant.py`). The runtime, the
loader, the memory plan, MTP and training reach a model only through `of(cfg)`; no other module imports a model
file. A new architecture is one model file plus a row of `ARCHITECTURES` (or a row alone, for a config-level
variant of a known model file).

Reading a config is strict (vLLM's behaviour): an architecture this engine does not run is a ValueError naming it
before any weight is read, and so is a config field that would change the computation but that the architecture
does not implement (`ConfigReading.implemented` holds the values it does implement; any field neither read nor
listed as without effect is refused by name). No jax at import: `dcp-jax plan` and the host read configs too.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import os
from collections.abc import Callable, Mapping
from typing import Any

from dcp_jax.config import IndexerConfig, ModelConfig, indexer_layer_types

# config.json fields HF writes for every model that change nothing at inference: bookkeeping, training-only knobs
# (dropout, initialization), generation and output switches, and fields read elsewhere (`quantization_config` by
# the loader, `dtype` / `torch_dtype` into ModelConfig.torch_dtype).
NO_EFFECT_FIELDS = frozenset({
    "architectures", "model_type", "transformers_version", "_name_or_path", "auto_map", "dtype", "torch_dtype",
    "quantization_config", "use_cache", "initializer_range", "attention_dropout", "pad_token_id", "return_dict",
    "output_hidden_states", "output_attentions", "torchscript", "use_bfloat16", "tf_legacy_loss", "pruned_heads",
    "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder", "add_cross_attention", "tie_encoder_decoder",
    "cross_attention_hidden_size", "finetuning_task", "id2label", "label2id", "tokenizer_class", "prefix",
    "sep_token_id", "decoder_start_token_id", "task_specific_params", "problem_type", "_attn_implementation",
    "_attn_implementation_autoset", "_commit_hash", "output_router_logits", "router_aux_loss_coef", "aux_loss_alpha",
    "seq_aux", "ep_size", "pretraining_tp", "num_key_value_heads", "head_dim",
})


@dataclasses.dataclass(frozen=True)
class ConfigReading:
    """How an architecture's config.json becomes a `ModelConfig`.

    fields: ModelConfig fields read under their own names (the rest of ModelConfig: `architecture`, `indexer`,
    RoPE, dtype, are read by `read_config`).
    implemented: field -> the value(s) this engine implements for it (a tuple: any of them); any other value is
    refused by name. A field absent from config.json takes HF's default, which must be implemented too.
    no_effect: the fields besides NO_EFFECT_FIELDS that change nothing at inference.
    has_indexer: whether the model has DSA's lightning indexer (its three fields are then required).
    defaults: the values HF's config class gives the fields config.json may leave out (none: they are required).
    indexer_extras: config.json -> the `IndexerConfig` fields beyond the three (RoPE layout, layer types) and the
    config fields they were read from; None: the DeepSeek-V3.2 indexer.
    """

    fields: frozenset[str]
    implemented: Mapping[str, tuple[Any, ...]]
    no_effect: frozenset[str] = frozenset()
    has_indexer: bool = False
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    indexer_extras: Callable[[dict[str, Any]], tuple[dict[str, Any], frozenset[str]]] | None = None


@dataclasses.dataclass(frozen=True)
class ModelFunctions:
    """What a model file exposes (its `MODEL`): the functions the runtime, the loader, the memory plan, MTP and
    training call. Each takes the `ModelConfig` (or what it made) first; see deepseek_v32.py for their contracts."""

    abstract_model: Callable  # (cfg, dtype, fp8_block) -> (graphdef, abstract state)
    init_params: Callable  # (cfg, seed, dtype, fp8_block) -> pure dict of the whole model
    merge: Callable  # (graphdef, abstract, params) -> a model (or MTP layer) of these weights
    param_specs: Callable  # (params, *, expert_parallel) -> PartitionSpecs, same tree
    check_divisible: Callable  # (cfg, tp, *, expert_parallel) -> None or ValueError
    layer_stacks: Callable  # (cfg) -> the layer stacks, in layer order
    scan_groups: Callable  # (cfg) -> the stacks as the scans run them (groups of stacks taking turns), in order
    stack_of: Callable  # (cfg, layer) -> the stack holding a decoder layer
    layer_params: Callable  # (cfg, params, layer) -> one decoder layer's weights
    abstract_mtp: Callable  # (cfg, dtype, fp8_block) -> (graphdef, abstract) of the MTP layer
    init_mtp_params: Callable  # (cfg, seed, dtype) -> the MTP layer's pure dict
    check_kernels: Callable  # (cfg, per-rank params (abstract ok), kernels backend, dtype) -> None or ValueError
    checkpoint: Any  # the HF tensor-name map (`deepseek_v32.DeepseekCheckpoint`'s methods)


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One architecture of the registry (module docstring)."""

    name: str  # HF's, config.json `architectures`
    model_type: str  # config.json `model_type` (the one `config_to_hf` writes)
    reading: ConfigReading
    model_file: str  # the module defining MODEL
    attention_file: str  # the module defining VARIANT (an `AttentionVariant`)
    other_model_types: tuple[str, ...] = ()  # model_type values released configs of it also carry

    @property
    def model_types(self) -> tuple[str, ...]:
        return (self.model_type, *self.other_model_types)

    @functools.cached_property
    def model(self) -> ModelFunctions:
        return importlib.import_module(self.model_file).MODEL

    @functools.cached_property
    def attention(self):
        """The attention variant (`attention/variant.py`)."""
        return importlib.import_module(self.attention_file).VARIANT


# DeepSeek-V3.2 (`DeepseekV32ForCausalLM`): MLA with the lightning indexer and top-k (DSA), DeepSeek MoE with group
# routing, YaRN, one MTP layer. Its indexer's RoPE is half-split, MLA's interleaved.
DEEPSEEK_V32 = Architecture(
    name="DeepseekV32ForCausalLM",
    model_type="deepseek_v32",
    reading=ConfigReading(
        fields=frozenset({
            "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "first_k_dense_replace", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
            "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
            "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob", "rms_norm_eps",
            "max_position_embeddings", "num_nextn_predict_layers", "bos_token_id", "eos_token_id"}),
        implemented={"hidden_act": ("silu",), "tie_word_embeddings": (False,), "attention_bias": (False,),
                     "scoring_func": ("sigmoid",), "topk_method": ("noaux_tc",), "moe_layer_freq": (1,),
                     "rope_interleave": (True,), "mlp_bias": (False,)},
        has_indexer=True),
    model_file="dcp_jax.model.deepseek_v32",
    attention_file="dcp_jax.model.attention.sparse_dcp",
)

# The fields the DeepSeek-family architectures (V3.2, V3, GLM) read, and the values of theirs they implement.
_DEEPSEEK_FIELDS = DEEPSEEK_V32.reading.fields
_DEEPSEEK_IMPLEMENTED = DEEPSEEK_V32.reading.implemented

# DeepSeek-V3, R1 and V3.1 (`DeepseekV3ForCausalLM`), and Kimi-K2, which ships the same architecture under its own
# model_type (64 heads, 384 experts in one group): dense MLA (every cached token attended), DeepSeek MoE, YaRN, one
# MTP layer (V3 / R1). MLA's RoPE is interleaved (HF's `rope_interleave`, default true).
DEEPSEEK_V3 = Architecture(
    name="DeepseekV3ForCausalLM",
    model_type="deepseek_v3",
    reading=ConfigReading(fields=_DEEPSEEK_FIELDS, implemented=_DEEPSEEK_IMPLEMENTED),
    model_file="dcp_jax.model.deepseek_v32",
    attention_file="dcp_jax.model.attention.dense_dcp",
    other_model_types=("kimi_k2",),
)



# config.json fields GLM's indexer layout is read from (`_glm_indexer_extras`).
_GLM_LAYER_FIELDS = frozenset({"indexer_types", "index_topk_pattern", "index_topk_freq", "index_skip_topk_offset",
                               "mlp_layer_types", "layer_types"})


def _glm_indexer_extras(raw: dict[str, Any]) -> tuple[dict[str, Any], frozenset[str]]:
    """GLM's indexer beyond V3.2's: RoPE interleaved, and each layer's kind as HF's GlmMoeDsaConfig derives it
    (`indexer_types`; else `index_topk_pattern` ("F" / "S" per layer, or a list); else the schedule of
    `index_topk_freq` / `index_skip_topk_offset`, HF's defaults 1 and 2: every layer full). ValueError for
    `mlp_layer_types` other than first_k_dense_replace's dense-then-sparse and `layer_types` other than indexed
    attention everywhere (what HF derives; this engine runs that)."""
    layers = raw["num_hidden_layers"]
    types = raw.get("indexer_types")
    pattern = raw.get("index_topk_pattern")
    if types is None and pattern is not None:
        if isinstance(pattern, str):
            if set(pattern) - {"F", "S"}:
                raise ValueError(f"index_topk_pattern must be 'F' / 'S' per layer, got {pattern!r}")
            types = [{"F": "full", "S": "shared"}[c] for c in pattern]
        else:
            types = list(pattern)
    if types is None:
        types = indexer_layer_types(layers, raw.get("index_topk_freq", 1), raw.get("index_skip_topk_offset", 2))
    if not isinstance(types, (list, tuple)) or len(types) != layers:
        raise ValueError(f"indexer_types must name each of the {layers} layers, got {types!r}")
    dense = min(raw["first_k_dense_replace"], layers)
    derived_mlp = ["dense"] * dense + ["sparse"] * (layers - dense)
    if raw.get("mlp_layer_types") is not None and list(raw["mlp_layer_types"]) != derived_mlp:
        raise ValueError(f"mlp_layer_types {raw['mlp_layer_types']} is not implemented: this engine runs the first "
                         f"first_k_dense_replace={dense} layers dense and the rest MoE")
    if raw.get("layer_types") is not None and set(raw["layer_types"]) != {"indexed_attention"}:
        raise ValueError(f"layer_types {raw['layer_types']} is not implemented (only 'indexed_attention')")
    layer_types = None if all(t == "full" for t in types) else tuple(types)
    return {"rope_interleave": True, "layer_types": layer_types}, _GLM_LAYER_FIELDS


# GLM-5, 5.1 and 5.2 (`GlmMoeDsaForCausalLM`): V3.2's DSA with RoPE interleaved in the indexer too, and (5.2's
# IndexShare) layers without an indexer that reuse the selection of the most recent full layer (`indexer_types`).
# One expert group, plain RoPE. HF's config class defaults every field (GLM-5's shapes), so config.json may omit any.
GLM_MOE_DSA = Architecture(
    name="GlmMoeDsaForCausalLM",
    model_type="glm_moe_dsa",
    reading=ConfigReading(
        fields=_DEEPSEEK_FIELDS,
        implemented=_DEEPSEEK_IMPLEMENTED | {"indexer_rope_interleave": (True,)},
        has_indexer=True,
        defaults={
            "vocab_size": 154880, "hidden_size": 6144, "intermediate_size": 12288, "moe_intermediate_size": 2048,
            "num_hidden_layers": 78, "num_attention_heads": 64, "n_shared_experts": 1, "n_routed_experts": 256,
            "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 2048, "qk_rope_head_dim": 64,
            "v_head_dim": 256, "qk_nope_head_dim": 192, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8,
            "norm_topk_prob": True, "max_position_embeddings": 202752, "rms_norm_eps": 1e-5, "bos_token_id": 0,
            "eos_token_id": 1, "first_k_dense_replace": 3, "index_topk": 2048, "index_head_dim": 128,
            "index_n_heads": 32},
        indexer_extras=_glm_indexer_extras),
    model_file="dcp_jax.model.deepseek_v32",
    attention_file="dcp_jax.model.attention.sparse_dcp",
)

ARCHITECTURES: dict[str, Architecture] = {arch.name: arch for arch in (DEEPSEEK_V32, DEEPSEEK_V3, GLM_MOE_DSA)}


def lookup(name: str) -> Architecture:
    """The registry's entry for HF architecture `name`; ValueError naming it and the ones this engine runs."""
    if name not in ARCHITECTURES:
        raise ValueError(f"architecture {name!r} is not supported; this engine runs {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[name]


def of(cfg: ModelConfig) -> Architecture:
    """The architecture that runs `cfg`."""
    return lookup(cfg.architecture)


# ---- reading and writing config.json ----------------------------------------------------------------------------

_INDEXER_FIELDS = {"index_n_heads": "heads", "index_head_dim": "head_dim", "index_topk": "topk"}
_ROPE_FIELDS = frozenset({"rope_theta", "rope_scaling", "rope_parameters"})


def config_from_hf(path: str | os.PathLike) -> ModelConfig:
    """Read a HF `config.json` (a file or a model directory); ValueError naming the file when it is missing, not
    JSON, of an architecture this engine does not run, or has a field the architecture does not implement."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
        return config_from_dict(raw)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file (a model directory needs a HF config.json)") from None
    except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"{path}: {e}") from None


def config_from_dict(raw: dict[str, Any]) -> ModelConfig:
    """A config.json's dict -> ModelConfig (`config_from_hf`'s checks)."""
    if "architectures" not in raw:  # HF's AutoConfig names the architecture by model_type alone
        by_type = [arch for arch in ARCHITECTURES.values() if raw.get("model_type") in arch.model_types]
        if not by_type:
            raise ValueError(f"config.json lacks required fields ['architectures'] (and its model_type "
                             f"{raw.get('model_type')!r} names no architecture this engine runs)")
        return read_config(by_type[0], raw)
    names = raw["architectures"]
    if not isinstance(names, list) or len(names) != 1 or not isinstance(names[0], str):
        raise ValueError(f"config.json must name one architecture in 'architectures', got {names!r}")
    return read_config(lookup(names[0]), raw)


def read_config(arch: Architecture, raw: dict[str, Any]) -> ModelConfig:
    """`raw` (config.json's fields) as `arch` reads it (`ConfigReading`)."""
    reading = arch.reading
    raw = dict(reading.defaults) | raw
    indexer_fields = set(_INDEXER_FIELDS) if reading.has_indexer else set()
    if reading.indexer_extras is not None:
        extras, extra_fields = reading.indexer_extras(raw)
        indexer_fields |= extra_fields
    known = reading.fields | indexer_fields | set(reading.implemented) | reading.no_effect | NO_EFFECT_FIELDS
    unknown = sorted(set(raw) - known - _ROPE_FIELDS)
    if unknown:
        raise ValueError(f"{arch.name}: config fields {unknown} are not implemented by this engine (they may change "
                         f"the model's computation)")
    wrong = [f"{name}={raw[name]!r} (implemented: {' or '.join(map(repr, values))})"
             for name, values in reading.implemented.items() if name in raw and raw[name] not in values]
    if wrong:
        raise ValueError(f"{arch.name}: config values not implemented by this engine: {', '.join(wrong)}")
    if "model_type" in raw and raw["model_type"] not in arch.model_types:
        raise ValueError(f"{arch.name}: model_type {raw['model_type']!r} is not "
                         f"{' or '.join(map(repr, arch.model_types))}")
    kwargs = {k: v for k, v in raw.items() if k in reading.fields}
    kwargs.update(_read_rope(raw))
    if isinstance(raw.get("torch_dtype", raw.get("dtype")), str):
        kwargs["torch_dtype"] = raw.get("torch_dtype", raw.get("dtype"))
    if isinstance(kwargs.get("eos_token_id"), list):
        kwargs["eos_token_id"] = kwargs["eos_token_id"][0]
    indexer = None
    if reading.has_indexer and raw.get("q_lora_rank", 0) is None:
        raise ValueError(f"{arch.name}: q_lora_rank null is not implemented (the indexer reads the low-rank query)")
    if reading.has_indexer:
        missing = sorted(n for n in _INDEXER_FIELDS if n not in raw)
        if missing:
            raise ValueError(f"config.json lacks required fields {missing}")
        indexer = IndexerConfig(**{ours: raw[hf] for hf, ours in _INDEXER_FIELDS.items()},
                                **(extras if reading.indexer_extras is not None else {}))
    required = {f.name for f in dataclasses.fields(ModelConfig)
                if f.default is dataclasses.MISSING and f.name not in ("architecture", "indexer")}
    missing = sorted(required - set(kwargs))
    if missing:
        raise ValueError(f"config.json lacks required fields {missing}")
    return ModelConfig(architecture=arch.name, indexer=indexer, **kwargs)


def _read_rope(raw: dict[str, Any]) -> dict[str, Any]:
    """rope_theta and rope_scaling of config.json's `rope_parameters` (HF v5) or legacy `rope_scaling` +
    `rope_theta`; ValueError for a rope_type other than default and yarn."""
    out = {"rope_theta": raw["rope_theta"]} if "rope_theta" in raw else {}
    rope = raw.get("rope_parameters") or raw.get("rope_scaling")
    if rope:
        rope = dict(rope)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if "rope_theta" in rope:
            out["rope_theta"] = rope["rope_theta"]
        if rope_type == "yarn":
            # The legacy spelling says {"type": "yarn"}; store it as rope_type so `rope` always names it.
            rope = {k: v for k, v in rope.items() if k not in ("type", "rope_theta")} | {"rope_type": "yarn"}
            out["rope_scaling"] = tuple(sorted(rope.items()))
        elif rope_type != "default":
            raise ValueError(f"unsupported rope_type {rope_type!r}; expected 'default' or 'yarn'")
    return out


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """A `config.json` dict of `cfg` that HF reads (v5 `rope_parameters`) and `config_from_dict` inverts."""
    arch = of(cfg)
    raw = {name: getattr(cfg, name) for name in sorted(arch.reading.fields)}
    raw["rope_theta"] = cfg.rope_theta
    raw["rope_parameters"] = {"rope_theta": cfg.rope_theta, **cfg.rope}
    if cfg.indexer is not None:
        raw |= {hf: getattr(cfg.indexer, ours) for hf, ours in _INDEXER_FIELDS.items()}
        if cfg.indexer.layer_types is not None:
            raw["indexer_types"] = list(cfg.indexer.layer_types[:cfg.num_hidden_layers])
    if cfg.torch_dtype is not None:
        raw["torch_dtype"] = cfg.torch_dtype
    return raw | dict(architectures=[arch.name], model_type=arch.model_type,
                      num_key_value_heads=cfg.num_attention_heads, tie_word_embeddings=False)


def with_hf_overrides(cfg: ModelConfig, overrides: dict | None) -> ModelConfig:
    """`cfg` with the HF config.json fields of `overrides` replaced (vLLM's `hf_overrides`; read as config.json is:
    `rope_scaling` and `rope_parameters` alike replace the RoPE parameters); ValueError for a field the
    architecture does not read or a value of the wrong type."""
    if overrides is None:
        return cfg
    if not isinstance(overrides, dict):
        raise ValueError(f"hf_overrides must be a JSON object of config.json fields, got {overrides!r}")
    base = config_to_hf(cfg)
    fields = set(base) - {"architectures", "model_type"} | {"rope_scaling"}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"hf_overrides: unknown config fields {unknown}; known: {sorted(fields)}")
    for name, value in overrides.items():
        if name in base and base[name] is not None and type(value) is not type(base[name]) and not (
                isinstance(base[name], float) and type(value) is int):
            raise ValueError(f"hf_overrides: {name} must be a {type(base[name]).__name__}, got {value!r}")
    overrides = dict(overrides)
    rope = overrides.pop("rope_parameters", None) or overrides.pop("rope_scaling", None)
    if rope is not None:  # config.json's RoPE block, read before any top-level rope_theta
        base["rope_parameters"] = {"rope_theta": cfg.rope_theta} | rope
    if "rope_theta" in overrides:
        base["rope_parameters"] = base["rope_parameters"] | {"rope_theta": overrides.pop("rope_theta")}
    return config_from_dict(base | overrides)
