"""Tiny DeepSeek-V3.2 and DeepSeek-V3 configs and seeded random checkpoints in HF's on-disk layout (numpy only, no
torch, no jax).

The oracle fixtures (`tests/fixtures/oracle/*.npz`) were produced by HF `DeepseekV32ForCausalLM` (configs with an
indexer) or `DeepseekV3ForCausalLM` (the `v3_*` configs) from exactly the checkpoint
`write_random_checkpoint(tiny_configs()[name], seed, dir)` writes; a test rebuilds the same checkpoint here (CI has
no torch), loads it into our model and compares against the recorded HF outputs. The fixture stores
`checkpoint_sha256` so a test can prove it rebuilt the very bytes HF read.

Determinism: every tensor has its own `numpy.random.Generator(PCG64)` seeded from `(seed, crc32(name))`, draws
`standard_normal` in float64 and is cast to float32, so the bytes do not depend on tensor order, platform or Python
version. The safetensors file is written by hand (sorted names, fixed header) so no extra package is needed.
"""

from __future__ import annotations

import copy
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
    return {
        "default_rope": default_rope,
        "yarn": yarn,
        "yarn_mscale": yarn_mscale,
        "v3_default_rope": _deepseek_v3(default_rope),
        "v3_yarn_mscale": _deepseek_v3(yarn_mscale),
        "v3_kimi": kimi,
        "v3_no_q_lora": no_q_lora,
    }


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


def tensor_specs(cfg: dict) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """Yield `(name, shape, kind)` for every tensor of the HF on-disk checkpoint, in a fixed order.

    `kind` is one of `linear` (normal * fan_in^-0.5), `embed` (normal), `norm` (1 + 0.2 * normal),
    `bias` (0.1 * normal: the indexer k_norm bias) and `router_bias` (0.1 * normal: e_score_correction_bias).
    Expert weights are one tensor per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`), as on disk. The
    indexer's tensors exist only for a config with one (`has_indexer`); `q_lora_rank` null gives `self_attn.q_proj`
    in place of `q_a_proj`, `q_a_layernorm` and `q_b_proj`.
    """
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
        if has_indexer(cfg):
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
    """Every checkpoint tensor (HF on-disk name -> float32 array) for `cfg` and `seed`."""
    return {name: _draw(seed, name, shape, kind) for name, shape, kind in tensor_specs(cfg)}


def _safetensors_bytes(tensors: dict[str, np.ndarray]) -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    names = sorted(tensors)
    for name in names:
        arr = tensors[name]
        if arr.dtype != np.float32:
            raise TypeError(f"{name}: {arr.dtype=} (only float32 is written)")
        header[name] = {"dtype": "F32", "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    blob = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    blob += b" " * (-len(blob) % 8)  # the format recommends an 8-byte aligned data section
    data = b"".join(np.ascontiguousarray(tensors[n], dtype="<f4").tobytes() for n in names)
    return struct.pack("<Q", len(blob)) + blob + data


def write_random_checkpoint(cfg: dict, seed: int, out_dir: str | os.PathLike) -> str:
    """Write `config.json` and `model.safetensors` (float32, HF names) into `out_dir`.

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
    """Read a float32 safetensors file (as written above) into numpy arrays."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    data = raw[8 + n :]
    out = {}
    for name, meta in header.items():
        if meta["dtype"] != "F32":
            raise TypeError(f"{name}: dtype {meta['dtype']} (only F32 is read)")
        lo, hi = meta["data_offsets"]
        out[name] = np.frombuffer(data[lo:hi], dtype="<f4").reshape(meta["shape"])
    return out
