"""Tiny DeepSeek-V3.2, DeepSeek-V3 and GLM-5.x configs and seeded random checkpoints in HF's on-disk layout (numpy
only, no torch, no jax).

The oracle fixtures (`tests/fixtures/oracle/*.npz`) were produced by HF `DeepseekV32ForCausalLM` (configs with an
indexer) or `DeepseekV3ForCausalLM` (the `v3_*` configs) from exactly the checkpoint
`write_random_checkpoint(tiny_configs()[name], seed, dir)` writes; a test rebuilds the same checkpoint here (CI has
no torch), loads it into our model and compares against the recorded HF outputs. The fixture stores
`checkpoint_sha256` so a test can prove it rebuilt the very bytes HF read.

Determinism: every tensor has its own `numpy.random.Generator(PCG64)` seeded from `(seed, crc32(name))`, draws
`standard_normal` in float64 and is cast to float32, so the bytes do not depend on tensor order, platform or Python
version. The safetensors file is written by hand (sorted names, fixed header) so no extra package is needed.

MXFP4 configs (`glm52_mxfp4`: an AMD Quark `quantization_config`, `QUARK_MXFP4`): each module Quark would quantize
(a linear layer no `exclude` entry names) is stored as Quark exports it, `X.weight` uint8 [out, in / 2] (two e2m1
codes a byte, input 2i in the low nibble) and `X.weight_scale` uint8 [out, in / 32] (e8m0), drawn as uint8 from the
tensor's own generator (`_draw`); `dequantized` gives the float32 checkpoint HF runs (HF cannot read Quark's fp4
without the quark package), decoded here with numpy alone (`dequantize_mxfp4`).
"""

from __future__ import annotations

import copy
import fnmatch
import hashlib
import json
import os
import struct
import zlib
from collections.abc import Iterator

import numpy as np

# Shared by every tiny config (DeepseekV32Config field names, as HF's config.json spells them).
_BASE_CONFIG: dict = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 256,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,  # layer 0 dense MLP, layers 1-2 MoE (MoE after MoE is exercised too)
    "first_k_dense_replace": 1,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,  # HF divides heads by this; it must equal num_attention_heads for MLA
    "q_lora_rank": 64,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "index_n_heads": 8,
    "index_head_dim": 32,
    "index_topk": 16,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


# An AMD Quark export's quantization_config (the fields Quark writes) at weight-only MXFP4: the exclude patterns of
# amd/GLM-5.2-MXFP4's recipe (attention with its indexer, the router, lm_head and the dense MLPs stay unquantized;
# routed and shared experts are MXFP4). input_tensors is None: HF runs the dequantized weights on unquantized
# activations, which a declared MXFP4 activation would not equal.
_MXFP4_SPEC = {"dtype": "fp4", "qscheme": "per_group", "group_size": 32, "ch_axis": -1, "scale_format": "e8m0",
               "scale_calculation_mode": "even", "round_method": "half_even", "is_dynamic": False, "symmetric": None,
               "observer_cls": "PerBlockMXObserver", "is_scale_quant": False, "mx_element_dtype": None,
               "scale_type": "float"}
QUARK_MXFP4 = {
    "quant_method": "quark",
    "version": "0.11",
    "quant_mode": "eager_mode",
    "export": {"kv_cache_group": [], "min_kv_scale": 0.0, "pack_method": "reorder", "weight_format": "real_quantized",
               "weight_merge_groups": None},
    "global_quant_config": {"weight": _MXFP4_SPEC, "input_tensors": None, "output_tensors": None, "bias": None,
                            "target_device": None},
    "layer_quant_config": {},
    "layer_type_quant_config": {},
    "kv_cache_quant_config": {},
    "softmax_quant_spec": None,
    "algo_config": None,
    "exclude": ["*self_attn*", "*mlp.gate", "*lm_head", "*mlp.gate_proj", "*mlp.up_proj", "*mlp.down_proj"],
}
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes of the e2m1 codes 0..7; bit 3 is the sign
MX_BLOCK = 32


def tiny_configs() -> dict[str, dict]:
    """Named config dicts, each written verbatim as `config.json` (fresh deep copies on every call).

    `DeepseekV32ForCausalLM` (indexer: 8 heads of 32, index_topk 16):

    - `default_rope`: plain RoPE, HF v5 style `rope_parameters = {"rope_type": "default", "rope_theta": 1e4}`.
    - `yarn`: YaRN in the legacy style the real DeepSeek-V3.2 `config.json` uses (`rope_theta` at top level,
      `rope_scaling = {"type": "yarn", ...}`); HF v5 normalizes it into `rope_parameters`. `factor` 4 with
      `original_max_position_embeddings` 32 makes YaRN change most frequencies at our lengths; `mscale` =
      `mscale_all_dim` = 1.0 as in the real checkpoint (softmax scale * (0.1 ln 4 + 1)^2, cos/sin unscaled).
    - `yarn_mscale`: `yarn` with `mscale` 1.0 != `mscale_all_dim` 0.707, so both YaRN factors differ from `yarn`:
      cos/sin * (0.1 ln 4 + 1) / (0.0707 ln 4 + 1) and softmax scale * (0.0707 ln 4 + 1)^2.

    `GlmMoeDsaForCausalLM` (V3.2's tensors, RoPE interleaved in the indexer, one expert group, rms eps 1e-5):
    - `glm5`: every layer runs its indexer; `rope_theta` 1e6 at the top level (GLM-5's), no `rope_parameters`.
    - `glm52_index_share`: GLM-5.2's IndexShare at five layers: `index_topk_freq` 2, `index_skip_topk_offset` 1
      (layers 0, 2, 4 full; 1 and 3 shared: no indexer tensors, the previous full layer's selection), plain RoPE
      theta 8e6 in `rope_parameters`, `mlp_layer_types` spelled out.
    - `glm52_mxfp4`: `glm52_index_share` as AMD Quark exports GLM-5.2 (`QUARK_MXFP4`): routed and shared experts
      in MXFP4 (weights only), the rest float32; `moe_intermediate_size` 64, so tp 2 splits an expert's 64 inputs
      of down_proj into whole scale blocks of 32.

    `DeepseekV3ForCausalLM` (dense MLA, no indexer: the same tensors minus `*.indexer.*`):
    - `v3_default_rope`, `v3_yarn_mscale`: `default_rope` and `yarn_mscale` without the indexer.
    - `v3_kimi`: shaped like Kimi-K2 (model_type `kimi_k2`, `n_group` = `topk_group` = 1, YaRN factor 32 with
      `beta_fast` = `beta_slow` = 1 and `rope_theta` 50000 in the legacy spelling, as in its config.json).
    - `v3_no_q_lora`: `v3_default_rope` with `q_lora_rank` null (HF's direct `q_proj` [H*(N+E), D] instead of
      q_a_proj, q_a_layernorm and q_b_proj, as in Moonlight's and DeepSeek-V2-Lite's config.json) and legacy YaRN
      `rope_scaling = {"type": "yarn", "factor": 8, "original_max_position_embeddings": 32}`: no mscale, no
      mscale_all_dim (HF then scales cos/sin by 0.1 ln 8 + 1 and leaves the softmax scale at 48^-0.5) and no
      beta_fast / beta_slow (HF's defaults 32 / 1).
    """
    default_rope = copy.deepcopy(_BASE_CONFIG)
    default_rope["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}

    yarn = copy.deepcopy(_BASE_CONFIG)
    yarn["max_position_embeddings"] = 128  # = factor * original, as in the real config (163840 = 40 * 4096)
    yarn["rope_theta"] = 10000.0
    yarn["rope_scaling"] = {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }

    yarn_mscale = copy.deepcopy(yarn)
    yarn_mscale["rope_scaling"]["mscale_all_dim"] = 0.707

    # Kimi-K2-Instruct's config.json at tiny shapes: model_type kimi_k2 on the V3 architecture, one expert group,
    # one dense layer, routed_scaling_factor 2.827, rope_theta 50000 and YaRN factor 32 with beta_fast = beta_slow
    # = 1 (its original_max_position_embeddings 4096 scaled down to 32, max_position_embeddings = factor * that),
    # no MTP layer, plus the fields it carries that change nothing at inference.
    kimi = _deepseek_v3(default_rope, model_type="kimi_k2")
    del kimi["rope_parameters"]
    kimi.update({
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.827,
        "max_position_embeddings": 1024,
        "rope_theta": 50000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "moe_layer_freq": 1,
        "seq_aux": True,
        "aux_loss_alpha": 0.001,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
    })
    # q_lora_rank null (a direct q_proj) with YaRN spelled without mscale, mscale_all_dim, beta_fast and beta_slow:
    # HF's cos/sin factor is then 0.1 ln(factor) + 1 and the softmax scale stays qk_head_dim^-0.5.
    no_q_lora = _deepseek_v3(default_rope)
    del no_q_lora["rope_parameters"]
    no_q_lora.update({
        "q_lora_rank": None,
        "max_position_embeddings": 256,  # = factor * original_max_position_embeddings
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32},
    })
    # GlmMoeDsaForCausalLM: V3.2's tensors with RoPE interleaved in the indexer, one expert group, rms eps 1e-5.
    glm5 = _glm(default_rope)
    del glm5["rope_parameters"]
    glm5["rope_theta"] = 1e6  # GLM-5's, spelled at the top level
    glm52 = _glm(default_rope)
    glm52.update({
        "num_hidden_layers": 5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 8e6},
        "index_topk_freq": 2,
        "index_skip_topk_offset": 1,
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse", "sparse"],
    })
    return {
        "default_rope": default_rope,
        "yarn": yarn,
        "yarn_mscale": yarn_mscale,
        "v3_default_rope": _deepseek_v3(default_rope),
        "v3_yarn_mscale": _deepseek_v3(yarn_mscale),
        "v3_kimi": kimi,
        "v3_no_q_lora": no_q_lora,
        "glm5": glm5,
        "glm52_index_share": glm52,
        "glm52_mxfp4": copy.deepcopy(glm52) | {"moe_intermediate_size": 64,
                                               "quantization_config": copy.deepcopy(QUARK_MXFP4)},
    }


def _glm(cfg: dict) -> dict:
    """`cfg` as a `GlmMoeDsaForCausalLM` config.json: one expert group, rms eps 1e-5, without the DeepSeek-only
    `scoring_func` / `topk_method` (GLM's config class has neither; its values are the same)."""
    glm = {k: copy.deepcopy(v) for k, v in cfg.items() if k not in ("scoring_func", "topk_method")}
    glm.update(architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", n_group=1, topk_group=1,
               rms_norm_eps=1e-5)
    return glm


def indexer_types(cfg: dict) -> list[str]:
    """Each layer's indexer kind as HF's GlmMoeDsaConfig derives it ("full" / "shared": `indexer_types`, else
    `index_topk_pattern`, else the `index_topk_freq` / `index_skip_topk_offset` schedule); every layer "full" for a
    DeepSeek-V3.2 config."""
    n = cfg["num_hidden_layers"]
    if cfg.get("indexer_types") is not None:
        return list(cfg["indexer_types"])
    pattern = cfg.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq, offset = max(cfg.get("index_topk_freq", 1), 1), cfg.get("index_skip_topk_offset", 2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]


def _deepseek_v3(cfg: dict, model_type: str = "deepseek_v3") -> dict:
    """`cfg` as a `DeepseekV3ForCausalLM` config.json: no `index_*` fields, and `num_nextn_predict_layers` 0 (HF's
    V3 default is 1; the tiny checkpoints have no MTP layer). `rope_interleave` is left out, as in the released
    V3 / R1 / Kimi-K2 configs: HF's default (true) applies."""
    v3 = {k: copy.deepcopy(v) for k, v in cfg.items() if not k.startswith("index_")}
    v3.update(architectures=["DeepseekV3ForCausalLM"], model_type=model_type, num_nextn_predict_layers=0)
    return v3


def has_indexer(cfg: dict) -> bool:
    """Whether `cfg` is a DSA model (`DeepseekV32ForCausalLM`: lightning indexer tensors and `index_*` fields)."""
    return "index_topk" in cfg


def _linear(out_dim: int, in_dim: int) -> tuple[tuple[int, int], str]:
    return (out_dim, in_dim), "linear"


def is_mxfp4_module(cfg: dict, module: str) -> bool:
    """Whether a linear module (HF name without ".weight") of `cfg` is stored in MXFP4: the config is Quark's and no
    `exclude` entry (an exact name or an fnmatch pattern) names it."""
    quantization = cfg.get("quantization_config") or {}
    if quantization.get("quant_method") != "quark":
        return False
    return not any(fnmatch.fnmatchcase(module, entry) for entry in quantization.get("exclude") or ())


def _stored(cfg: dict, specs: Iterator[tuple[str, tuple[int, ...], str]]) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """Each plain tensor spec as stored: an MXFP4 module's linear weight as packed codes and scales."""
    for name, shape, kind in specs:
        if kind == "linear" and is_mxfp4_module(cfg, name[: -len(".weight")]):
            out, depth = shape
            yield name, (out, depth // 2), "e2m1"
            yield name + "_scale", (out, depth // MX_BLOCK), "e8m0"
        else:
            yield name, shape, kind


def tensor_specs(cfg: dict) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """Yield `(name, shape, kind)` for every tensor of the HF on-disk checkpoint, in a fixed order.

    `kind` is one of `linear` (normal * fan_in^-0.5), `embed` (normal), `norm` (1 + 0.2 * normal),
    `bias` (0.1 * normal: the indexer k_norm bias) and `router_bias` (0.1 * normal: e_score_correction_bias); in an
    MXFP4 config (`is_mxfp4_module`) a quantized linear weight is `e2m1` (packed codes [out, in / 2]) followed by its
    `X.weight_scale`, `e8m0` ([out, in / 32]).
    Expert weights are one tensor per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`), as on disk. The
    indexer's tensors exist only for a config with one (`has_indexer`); `q_lora_rank` null gives `self_attn.q_proj`
    in place of `q_a_proj`, `q_a_layernorm` and `q_b_proj`.
    """
    return _stored(cfg, _plain_specs(cfg))


def _plain_specs(cfg: dict) -> Iterator[tuple[str, tuple[int, ...], str]]:
    h = cfg["hidden_size"]
    n_heads = cfg["num_attention_heads"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    q_lora, kv_lora = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    n_exp, moe_i = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    shared_i = moe_i * cfg["n_shared_experts"]

    yield "model.embed_tokens.weight", (cfg["vocab_size"], h), "embed"
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,), "norm"
        yield p + "post_attention_layernorm.weight", (h,), "norm"
        a = p + "self_attn."
        if q_lora is None:  # no low-rank query: HF's direct q_proj
            yield (a + "q_proj.weight", *_linear(n_heads * (nope + rope), h))
        else:
            yield (a + "q_a_proj.weight", *_linear(q_lora, h))
            yield a + "q_a_layernorm.weight", (q_lora,), "norm"
            yield (a + "q_b_proj.weight", *_linear(n_heads * (nope + rope), q_lora))
        yield (a + "kv_a_proj_with_mqa.weight", *_linear(kv_lora + rope, h))
        yield a + "kv_a_layernorm.weight", (kv_lora,), "norm"
        yield (a + "kv_b_proj.weight", *_linear(n_heads * (nope + v), kv_lora))
        yield (a + "o_proj.weight", *_linear(h, n_heads * v))
        if has_indexer(cfg) and indexer_types(cfg)[i] == "full":
            hi, di = cfg["index_n_heads"], cfg["index_head_dim"]
            yield (a + "indexer.wq_b.weight", *_linear(hi * di, q_lora))
            yield (a + "indexer.wk.weight", *_linear(di, h))
            yield a + "indexer.k_norm.weight", (di,), "norm"
            yield a + "indexer.k_norm.bias", (di,), "bias"
            yield (a + "indexer.weights_proj.weight", *_linear(hi, h))
        m = p + "mlp."
        if i < cfg["first_k_dense_replace"]:
            inter = cfg["intermediate_size"]
            yield (m + "gate_proj.weight", *_linear(inter, h))
            yield (m + "up_proj.weight", *_linear(inter, h))
            yield (m + "down_proj.weight", *_linear(h, inter))
        else:
            yield (m + "gate.weight", *_linear(n_exp, h))
            yield m + "gate.e_score_correction_bias", (n_exp,), "router_bias"
            for e in range(n_exp):
                x = f"{m}experts.{e}."
                yield (x + "gate_proj.weight", *_linear(moe_i, h))
                yield (x + "up_proj.weight", *_linear(moe_i, h))
                yield (x + "down_proj.weight", *_linear(h, moe_i))
            yield (m + "shared_experts.gate_proj.weight", *_linear(shared_i, h))
            yield (m + "shared_experts.up_proj.weight", *_linear(shared_i, h))
            yield (m + "shared_experts.down_proj.weight", *_linear(h, shared_i))
    yield "model.norm.weight", (h,), "norm"
    yield ("lm_head.weight", *_linear(cfg["vocab_size"], h))


def _draw(seed: int, name: str, shape: tuple[int, ...], kind: str) -> np.ndarray:
    rng = np.random.Generator(np.random.PCG64([seed, zlib.crc32(name.encode())]))
    if kind == "e2m1":  # uniform codes 0..15, two a byte, input 2i in the low nibble
        codes = rng.integers(0, 16, size=(*shape[:-1], 2 * shape[-1]), dtype=np.uint8)
        return codes[..., 0::2] | (codes[..., 1::2] << 4)
    if kind == "e8m0":
        # Uniform codes have an RMS of sqrt(mean(E2M1_VALUES^2)) = 2.93: scales around fan_in^-0.5 / 2.93, one
        # power of two either way, keep activations O(1) as the `linear` draw does.
        rms = float(np.sqrt(np.mean(np.square(E2M1_VALUES))))
        center = 127 + round(np.log2((shape[-1] * MX_BLOCK) ** -0.5 / rms))
        return rng.integers(center - 1, center + 2, size=shape, dtype=np.uint8)
    z = rng.standard_normal(shape, dtype=np.float64)
    if kind == "linear":
        x = z * shape[-1] ** -0.5  # keeps activations O(1) through every projection
    elif kind == "embed":
        x = z
    elif kind == "norm":
        x = 1.0 + 0.2 * z  # far enough from 1 that a loader ignoring the weight fails
    elif kind in ("bias", "router_bias"):
        x = 0.1 * z
    else:
        raise ValueError(f"unknown tensor kind {kind!r} for {name}")
    return x.astype(np.float32)


def random_tensors(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    """Every checkpoint tensor (HF on-disk name -> float32 array, uint8 for MXFP4 codes and scales) for `cfg` and
    `seed`."""
    return {name: _draw(seed, name, shape, kind) for name, shape, kind in tensor_specs(cfg)}


def dequantize_mxfp4(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """packed uint8 [..., in / 2] and e8m0 scales uint8 [..., in / 32] -> float32 [..., in]: e2m1(code) *
    2^(scale - 127) (OCP MX v1.0; exact in float32 for the scales drawn here)."""
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])
    values = np.where(codes >= 8, -1.0, 1.0) * np.asarray(E2M1_VALUES)[codes & 7]
    blocks = values.reshape(*scales.shape, MX_BLOCK) * np.exp2(scales.astype(np.float64) - 127)[..., None]
    return blocks.reshape(codes.shape).astype(np.float32)


def dequantized(cfg: dict, tensors: dict[str, np.ndarray]) -> tuple[dict, dict[str, np.ndarray]]:
    """The float32 checkpoint HF reads for an MXFP4 config: its config.json without `quantization_config`, each
    MXFP4 weight decoded from its codes and scales (the same config and tensors for another config)."""
    if "quantization_config" not in cfg:
        return cfg, tensors
    plain = {k: v for k, v in cfg.items() if k != "quantization_config"}
    out = {}
    for name, t in tensors.items():
        if name.endswith(".weight_scale"):
            continue
        out[name] = dequantize_mxfp4(t, tensors[name + "_scale"]) if name + "_scale" in tensors else t
    return plain, out


# The safetensors dtypes written and read here.
_DTYPES = {"F32": np.dtype("<f4"), "U8": np.dtype("u1")}


def _safetensors_bytes(tensors: dict[str, np.ndarray]) -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    names = sorted(tensors)
    for name in names:
        arr = tensors[name]
        kind = next((k for k, d in _DTYPES.items() if arr.dtype == d), None)
        if kind is None:
            raise TypeError(f"{name}: {arr.dtype=} (only float32 and uint8 are written)")
        header[name] = {"dtype": kind, "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    blob = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    blob += b" " * (-len(blob) % 8)  # the format recommends an 8-byte aligned data section
    data = b"".join(np.ascontiguousarray(tensors[n], dtype=tensors[n].dtype.newbyteorder("<")).tobytes()
                    for n in names)
    return struct.pack("<Q", len(blob)) + blob + data


def write_random_checkpoint(cfg: dict, seed: int, out_dir: str | os.PathLike) -> str:
    """Write `config.json` and `model.safetensors` (float32, HF names; an MXFP4 config's quantized weights as uint8
    codes and scales) into `out_dir`.

    Returns the sha256 hex digest of `model.safetensors`; the fixtures record it as `checkpoint_sha256`.
    """
    return write_checkpoint(cfg, random_tensors(cfg, seed), out_dir)


def write_checkpoint(cfg: dict, tensors: dict[str, np.ndarray], out_dir: str | os.PathLike) -> str:
    """Write `config.json` (`cfg` verbatim) and `model.safetensors` (`tensors`); return the file's sha256."""
    os.makedirs(out_dir, exist_ok=True)
    payload = _safetensors_bytes(tensors)
    with open(os.path.join(out_dir, "model.safetensors"), "wb") as f:
        f.write(payload)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    return hashlib.sha256(payload).hexdigest()


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Read a float32 / uint8 safetensors file (as written above) into numpy arrays."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    data = raw[8 + n :]
    out = {}
    for name, meta in header.items():
        if meta["dtype"] not in _DTYPES:
            raise TypeError(f"{name}: dtype {meta['dtype']} (only {sorted(_DTYPES)} are read)")
        lo, hi = meta["data_offsets"]
        out[name] = np.frombuffer(data[lo:hi], dtype=_DTYPES[meta["dtype"]]).reshape(meta["shape"])
    return out
