"""HF safetensors in and out for `DeepseekV32`: one layer converted at a time, strict, placed sharded.

HF stores linear weights `[out, in]` under its on-disk names (experts one tensor each); the model holds them
`[in, out...]` (w_uk / w_uv per head; see `model.py`), each in the dtype of the model's leaf (the load dtype, but
f32 for the router, its bias and the indexer's weights_proj, which HF keeps in fp32). `hf_tensor_shapes(cfg)`
lists every expected tensor; loading checks the files hold exactly those (a missing or unexpected tensor, or a
shape mismatch, is a ValueError naming them), converts one layer at a time and places each parameter on the mesh
with the step's sharding (`model.param_specs`: heads, MLP widths and routed experts split, the rest replicated).

Block-fp8 checkpoints (DeepSeek's release format: `quantization_config` {"quant_method": "fp8", "fmt": "e4m3",
"weight_block_size": [bn, bk]}, e4m3 `X.weight` beside an f32 `X.weight_scale_inv` of one scale per bn x bk block)
load by `quantization` (vLLM's word): "auto" (and "fp8") keeps the projections DeepSeek stores in fp8
(`fp8_linear.FP8_AXES`) in fp8, as `fp8_linear.Fp8BlockWeight`s of their e4m3 values and scales; "none" dequantizes
them (weight = e4m3 value x its block's scale) into the load dtype. "fp8" quantizes an unquantized checkpoint's
projections to block fp8 (`config.ONLINE_FP8_BLOCK`) as each layer loads, on the host. Malformed scales (a wrong
grid, a missing one, a non-finite or non-positive value) and a rank's slice of a split fp8 weight that is not whole
blocks are ValueErrors naming the tensor, raised before anything is placed. `load_hf_params` does not read layers
the config does not use: the multi-token-prediction layer (`num_nextn_predict_layers`, numbered after the decoder
layers; `load_mtp_params` reads it, in fp8 alike), and decoder layers past a `num_hidden_layers` lowered to load
only the first ones.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import struct
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
import numpy as np
from jax.sharding import Mesh

from dcp_jax.config import ONLINE_FP8_BLOCK, QUANTIZATION_CHOICES, ModelConfig
from dcp_jax.model import fp8_linear
from dcp_jax.model.mesh import sharding
from dcp_jax.model.deepseek_v32 import abstract_model, layer_params, layer_stacks, param_specs, stack_of

_ATTENTION = "self_attn."
FP8 = "F8_E4M3"  # the safetensors dtype of DeepSeek's fp8 weights
# The HF tensors of the `fp8_linear.FP8_AXES` leaves (names relative to a layer, experts' and shared ones included).
_FP8_TENSORS = ("q_a_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight", "kv_b_proj.weight",
                "o_proj.weight", "indexer.wq_b.weight", "indexer.wk.weight", "gate_proj.weight", "up_proj.weight",
                "down_proj.weight")


def hf_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a HF DeepSeek-V3.2 checkpoint (without MTP layers or fp8 scales): name -> shape."""
    d = cfg.hidden_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,),
              "lm_head.weight": (cfg.vocab_size, d)}
    for layer in range(cfg.num_hidden_layers):
        shapes |= {f"model.layers.{layer}.{k}": s for k, s in layer_tensor_shapes(cfg, layer).items()}
    return shapes


def layer_tensor_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Decoder layer `layer`'s tensors (names relative to `model.layers.{layer}.`) -> shape."""
    d, q, h = cfg.hidden_size, cfg.q_lora_rank, cfg.num_attention_heads
    n, e, v, c = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    i, j = cfg.index_n_heads, cfg.index_head_dim
    layer_shapes = {
        "input_layernorm.weight": (d,),
        "post_attention_layernorm.weight": (d,),
        "self_attn.q_a_proj.weight": (q, d),
        "self_attn.q_a_layernorm.weight": (q,),
        "self_attn.q_b_proj.weight": (h * (n + e), q),
        "self_attn.kv_a_proj_with_mqa.weight": (c + e, d),
        "self_attn.kv_a_layernorm.weight": (c,),
        "self_attn.kv_b_proj.weight": (h * (n + v), c),
        "self_attn.o_proj.weight": (d, h * v),
        "self_attn.indexer.wq_b.weight": (i * j, q),
        "self_attn.indexer.wk.weight": (j, d),
        "self_attn.indexer.k_norm.weight": (j,),
        "self_attn.indexer.k_norm.bias": (j,),
        "self_attn.indexer.weights_proj.weight": (i, d),
    }
    if cfg.is_moe_layer(layer):
        f, shared = cfg.moe_intermediate_size, cfg.moe_intermediate_size * cfg.n_shared_experts
        layer_shapes["mlp.gate.weight"] = (cfg.n_routed_experts, d)
        layer_shapes["mlp.gate.e_score_correction_bias"] = (cfg.n_routed_experts,)
        for x in range(cfg.n_routed_experts):
            expert = f"mlp.experts.{x}."
            layer_shapes |= {expert + "gate_proj.weight": (f, d), expert + "up_proj.weight": (f, d),
                             expert + "down_proj.weight": (d, f)}
        layer_shapes |= {"mlp.shared_experts.gate_proj.weight": (shared, d),
                         "mlp.shared_experts.up_proj.weight": (shared, d),
                         "mlp.shared_experts.down_proj.weight": (d, shared)}
    else:
        f = cfg.intermediate_size
        layer_shapes |= {"mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d),
                         "mlp.down_proj.weight": (d, f)}
    return layer_shapes


def _mlp_to_ours(t: dict, prefix: str) -> dict:
    """HF's gate_proj and up_proj [F, D] as our gate_up [2, D, F]; down_proj [D, F] as down [F, D]."""
    gate_up = np.stack([t[prefix + "gate_proj.weight"], t[prefix + "up_proj.weight"]]).transpose(0, 2, 1)
    return {"gate_up": gate_up, "down": t[prefix + "down_proj.weight"].T}


def _mlp_to_hf(p: dict, prefix: str) -> dict:
    return {prefix + "gate_proj.weight": p["gate_up"][0].T, prefix + "up_proj.weight": p["gate_up"][1].T,
            prefix + "down_proj.weight": p["down"].T}


def _stacked_experts(t: dict[str, np.ndarray], kind: str, experts) -> np.ndarray:
    """The routed experts' `kind` projections, HF [out, in] each, as ours [X, in, out]: one stacked copy, viewed."""
    return np.stack([t[f"mlp.experts.{x}.{kind}_proj.weight"] for x in experts]).transpose(0, 2, 1)


def layer_to_ours(cfg: ModelConfig, layer: int, t: dict[str, np.ndarray]) -> dict:
    """One decoder layer: HF tensors (names relative to `model.layers.{layer}.`) -> our pure-dict params. The
    projections are views of the HF [out, in] tensors (wqkv_a, gate_up and the routed experts one stacked copy), so the
    block-fp8 values kept K-major (`fp8_linear.from_plain_layout`) are the checkpoint's bytes in their own order."""
    h, n, d = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.hidden_size
    q, i = cfg.q_lora_rank, cfg.index_n_heads
    a = _ATTENTION
    kv_b = t[a + "kv_b_proj.weight"].reshape(h, n + cfg.v_head_dim, cfg.kv_lora_rank)
    attention = {
        "wqkv_a": np.concatenate([t[a + "q_a_proj.weight"], t[a + "kv_a_proj_with_mqa.weight"]]).T,
        "q_a_norm": t[a + "q_a_layernorm.weight"],
        "wq_b": t[a + "q_b_proj.weight"].reshape(h, cfg.qk_head_dim, q).transpose(2, 0, 1),
        "kv_a_norm": t[a + "kv_a_layernorm.weight"],
        "w_uk": kv_b[:, :n],
        "w_uv": kv_b[:, n:],
        "wo": t[a + "o_proj.weight"].reshape(d, h, cfg.v_head_dim).transpose(1, 2, 0),
        "index_wq": t[a + "indexer.wq_b.weight"].reshape(i, cfg.index_head_dim, q).transpose(2, 0, 1),
        "index_wk": t[a + "indexer.wk.weight"].T,
        "index_k_norm": t[a + "indexer.k_norm.weight"],
        "index_k_norm_bias": t[a + "indexer.k_norm.bias"],
        "index_weights": t[a + "indexer.weights_proj.weight"].T,
    }
    if cfg.is_moe_layer(layer):
        experts = range(cfg.n_routed_experts)
        mlp = {
            "router": t["mlp.gate.weight"].T,
            "router_bias": t["mlp.gate.e_score_correction_bias"],
            **{f"experts_{kind}": _stacked_experts(t, kind, experts) for kind in ("gate", "up", "down")},
            "shared": _mlp_to_ours(t, "mlp.shared_experts."),
        }
    else:
        mlp = _mlp_to_ours(t, "mlp.")
    return {"input_norm": t["input_layernorm.weight"], "post_attention_norm": t["post_attention_layernorm.weight"],
            "attention": attention, "mlp": mlp}


def layer_to_hf(cfg: ModelConfig, layer: int, p: dict) -> dict[str, np.ndarray]:
    """Inverse of `layer_to_ours` (numpy arrays in, HF names relative to `model.layers.{layer}.` out)."""
    a, att = _ATTENTION, p["attention"]
    h, q = cfg.num_attention_heads, cfg.q_lora_rank
    kv_b = np.concatenate([att["w_uk"], att["w_uv"]], axis=1).reshape(-1, cfg.kv_lora_rank)
    out = {
        "input_layernorm.weight": p["input_norm"],
        "post_attention_layernorm.weight": p["post_attention_norm"],
        a + "q_a_proj.weight": att["wqkv_a"][:, :q].T,
        a + "q_a_layernorm.weight": att["q_a_norm"],
        a + "q_b_proj.weight": att["wq_b"].reshape(q, -1).T,
        a + "kv_a_proj_with_mqa.weight": att["wqkv_a"][:, q:].T,
        a + "kv_a_layernorm.weight": att["kv_a_norm"],
        a + "kv_b_proj.weight": kv_b,
        a + "o_proj.weight": att["wo"].reshape(h * cfg.v_head_dim, -1).T,
        a + "indexer.wq_b.weight": att["index_wq"].reshape(q, -1).T,
        a + "indexer.wk.weight": att["index_wk"].T,
        a + "indexer.k_norm.weight": att["index_k_norm"],
        a + "indexer.k_norm.bias": att["index_k_norm_bias"],
        a + "indexer.weights_proj.weight": att["index_weights"].T,
    }
    mlp = p["mlp"]
    if cfg.is_moe_layer(layer):
        out["mlp.gate.weight"] = mlp["router"].T
        out["mlp.gate.e_score_correction_bias"] = mlp["router_bias"]
        for x in range(cfg.n_routed_experts):
            out[f"mlp.experts.{x}.gate_proj.weight"] = mlp["experts_gate"][x].T
            out[f"mlp.experts.{x}.up_proj.weight"] = mlp["experts_up"][x].T
            out[f"mlp.experts.{x}.down_proj.weight"] = mlp["experts_down"][x].T
        out |= _mlp_to_hf(mlp["shared"], "mlp.shared_experts.")
    else:
        out |= _mlp_to_hf(mlp, "mlp.")
    return out


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return sorted({os.path.join(path, name) for name in json.load(f)["weight_map"].values()})
    files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {path}")
    return files


class _Reader:
    """Lazy access to tensors spread over several safetensors files (one tensor read at a time)."""

    def __init__(self, files: list[str]):
        from safetensors import safe_open

        self._handles = [safe_open(f, framework="numpy") for f in files]
        self.location: dict[str, object] = {}
        self._file: dict[str, str] = {}
        for path, handle in zip(files, self._handles):
            for name in handle.keys():
                self.location[name] = handle
                self._file[name] = path

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.location[name].get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The safetensors dtype string ("F32", "BF16", "F8_E4M3", ...)."""
        return self.location[name].get_slice(name).get_dtype()

    def get(self, name: str) -> np.ndarray:
        if self.dtype(name) == FP8:
            return self._get_fp8(name)
        return self.location[name].get_tensor(name)

    def _get_fp8(self, name: str) -> np.ndarray:
        """numpy has no float8 type, so safetensors' numpy reader refuses e4m3: read the tensor's bytes from the
        file (offsets from its header) and view them as ml_dtypes' float8_e4m3fn."""
        import ml_dtypes

        path = self._file[name]
        with open(path, "rb") as f:
            (header_size,) = struct.unpack("<Q", f.read(8))
            meta = json.loads(f.read(header_size))[name]
            begin, end = meta["data_offsets"]
            f.seek(8 + header_size + begin)
            data = np.frombuffer(f.read(end - begin), np.uint8)
        return data.view(ml_dtypes.float8_e4m3fn).reshape(meta["shape"])


def fp8_block_size(path: str) -> tuple[int, int] | None:
    """(bn, bk) of a block-fp8 checkpoint directory's `quantization_config`, None when it has none; ValueError for
    any other quantization."""
    with open(os.path.join(path, "config.json")) as f:
        quantization = json.load(f).get("quantization_config")
    if not quantization:
        return None
    block = quantization.get("weight_block_size")
    if (quantization.get("quant_method") != "fp8" or quantization.get("fmt", "e4m3") != "e4m3"
            or not isinstance(block, list) or len(block) != 2 or min(block) < 1):
        raise ValueError(f"unsupported quantization_config {quantization}: only block fp8 (quant_method 'fp8', "
                         "fmt 'e4m3', weight_block_size [bn, bk]) is read")
    return int(block[0]), int(block[1])


def dequantize_fp8(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """f32 weight [out, in] from e4m3 values and one f32 scale per block of bn x bk (edge blocks partial)."""
    scales = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), block[0], axis=0), block[1], axis=1)
    return weight.astype(np.float32) * scales[: weight.shape[0], : weight.shape[1]]


def kept_fp8_block(path: str, quantization: str) -> tuple[int, int] | None:
    """The block of the fp8 weights `load_hf_params` keeps for `quantization` (`config.QUANTIZATION_CHOICES`): the
    checkpoint's under "auto" or "fp8" when it is block fp8; None when the weights load in the load dtype."""
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization={quantization!r} must be one of {QUANTIZATION_CHOICES}")
    return fp8_block_size(path) if quantization != "none" else None


def online_fp8_block(path: str, quantization: str) -> tuple[int, int] | None:
    """The block `quantization` "fp8" quantizes an unquantized checkpoint's `fp8_linear.FP8_AXES` leaves to on load
    (None otherwise: a block fp8 checkpoint's are kept as they are)."""
    return ONLINE_FP8_BLOCK if quantization == "fp8" and not fp8_block_size(path) else None


def loaded_fp8_block(path: str, quantization: str) -> tuple[int, int] | None:
    """The block of the fp8 weights a load under `quantization` gives: kept or quantized on load (None: plain)."""
    return kept_fp8_block(path, quantization) or online_fp8_block(path, quantization)


@functools.partial(jax.jit, static_argnums=1)
def _quantized_on_host(params: dict, block: tuple[int, int]) -> dict:
    """`fp8_linear.quantize_params` compiled (fused, so without eager full-size temporaries); the caller runs it on
    the host's CPU device, so a layer's f32 copy never lands on an accelerator."""
    return fp8_linear.quantize_params(params, block)


def _layer_scales_to_ours(cfg: ModelConfig, scales: dict[str, np.ndarray], block: tuple[int, int],
                          is_moe: bool) -> dict:
    """One layer's weight_scale_inv grids (HF [out blocks, in blocks], keyed by their weight's name relative to the
    layer) -> the scales of its fp8 leaves, [*batch, out blocks, in blocks] (`fp8_linear`), nested as our params."""
    a = _ATTENTION
    kv_b = scales[a + "kv_b_proj.weight"]
    kv_b = kv_b.reshape(cfg.num_attention_heads, -1, kv_b.shape[1])  # [H, (N+V)/bn, C/bk]
    nope_blocks = cfg.qk_nope_head_dim // block[0]
    wqkv_a = np.concatenate([scales[a + "q_a_proj.weight"], scales[a + "kv_a_proj_with_mqa.weight"]])
    attention = {"wqkv_a": wqkv_a, "wq_b": scales[a + "q_b_proj.weight"], "w_uk": kv_b[:, :nope_blocks],
                 "w_uv": kv_b[:, nope_blocks:], "wo": scales[a + "o_proj.weight"],
                 "index_wq": scales[a + "indexer.wq_b.weight"], "index_wk": scales[a + "indexer.wk.weight"]}
    def mlp_scales(prefix):  # gate_proj's and up_proj's grids stacked, as their weights
        return {"gate_up": np.stack([scales[f"{prefix}gate_proj.weight"], scales[f"{prefix}up_proj.weight"]]),
                "down": scales[f"{prefix}down_proj.weight"]}

    if is_moe:
        experts = range(cfg.n_routed_experts)
        mlp = {f"experts_{kind}": np.stack([scales[f"mlp.experts.{x}.{kind}_proj.weight"] for x in experts])
               for kind in ("gate", "up", "down")}
        mlp["shared"] = mlp_scales("mlp.shared_experts.")
    else:
        mlp = mlp_scales("mlp.")
    return {"attention": attention, "mlp": mlp}


def _with_scales(ours: dict, scales: dict, block: tuple[int, int]) -> dict:
    """`ours` with each leaf that `scales` (nested alike) names an Fp8BlockWeight of its e4m3 values (our layout,
    reordered K-major) and scales."""
    out = dict(ours)
    for key, s in scales.items():
        out[key] = (_with_scales(ours[key], s, block) if isinstance(s, dict)
                    else fp8_linear.from_plain_layout(ours[key], s, block, *fp8_linear.FP8_AXES[key]))
    return out


def _checked_fp8_scales(path: str, cfg: ModelConfig, reader: _Reader, expected: dict[str, tuple[int, ...]],
                        block: tuple[int, int] | None, is_kept: bool) -> dict[str, np.ndarray]:
    """The weight_scale_inv grid of each tensor of `expected` (name -> shape) stored in block fp8 (none without a
    block). ValueError, before anything is converted, for a scale of the wrong shape, an e4m3 tensor without a
    scale or a scale beside a tensor of another dtype, and what `_fp8_problems` finds."""
    scales = {n: n + "_scale_inv" for n, shape in expected.items()
              if block and len(shape) == 2 and n + "_scale_inv" in reader.location}
    wrong = []
    for name, scale in scales.items():
        rows, cols = expected[name]
        want = (-(-rows // block[0]), -(-cols // block[1]))
        if reader.shape(scale) != want:
            wrong.append(f"{scale}: file {reader.shape(scale)} != expected {want} (blocks of {block})")
    wrong += [f"{n}: {reader.dtype(n)} " + ("without a weight_scale_inv" if n not in scales else "with a scale")
              for n in expected if (reader.dtype(n) == FP8) != (n in scales)]
    if wrong:
        raise ValueError(f"checkpoint {path} has tensors of the wrong shape or type: {wrong[:20]}")
    scale_values = {n: reader.get(s) for n, s in scales.items()}
    wrong = _fp8_problems(cfg, reader, expected, scales, scale_values, block, is_kept)
    if wrong:
        raise ValueError(f"checkpoint {path} has malformed fp8 weights: {wrong[:20]}")
    return scale_values


def _fp8_problems(cfg: ModelConfig, reader: _Reader, expected: dict[str, tuple[int, ...]], scales: dict[str, str],
                  scale_values: dict[str, np.ndarray], block: tuple[int, int], is_kept: bool) -> list[str]:
    """What stops a block fp8 checkpoint from loading: scales that are not finite and positive (the weight would
    be NaN or zero), and when kept in fp8, an fp8 leaf's tensor stored without a scale, kv_b_proj blocks that
    straddle the k_nope / v rows of a head, or q_a_proj rows that end mid-block."""
    problems = [f"{scales[n]}: a non-finite or non-positive scale" for n, s in scale_values.items()
                if not np.all(np.isfinite(s) & (s > 0))]
    if is_kept:
        problems += [f"{n}: {reader.dtype(n)} without a weight_scale_inv; load with quantization='none'"
                     for n in expected if n.endswith(_FP8_TENSORS) and n not in scales]
        if cfg.qk_nope_head_dim % block[0] or cfg.v_head_dim % block[0]:
            problems.append(f"kv_b_proj: blocks of {block[0]} rows straddle a head's {cfg.qk_nope_head_dim} k_nope "
                            f"and {cfg.v_head_dim} v rows; load with quantization='none'")
        if cfg.q_lora_rank % block[0]:  # wqkv_a stacks the two scale grids
            problems.append(f"q_a_proj: its {cfg.q_lora_rank} rows do not fill blocks of {block[0]}, so its scales "
                            "cannot be stacked with kv_a_proj_with_mqa's in wqkv_a; load with quantization='none'")
    return problems


def _unused_layer_names(path: str, cfg: ModelConfig, names) -> set[str]:
    """Tensors of the checkpoint's layers that `cfg` does not use: decoder layers past a truncated
    `cfg.num_hidden_layers`, and the multi-token-prediction layers numbered after the decoder's."""
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    end = int(raw.get("num_hidden_layers", cfg.num_hidden_layers)) + int(raw.get("num_nextn_predict_layers") or 0)
    prefixes = tuple(f"model.layers.{layer}." for layer in range(cfg.num_hidden_layers, end))
    return {n for n in names if prefixes and n.startswith(prefixes)}


def _place(tree, specs, abstract, mesh: Mesh | None):
    """Each tensor cast to the dtype of its leaf in `abstract` (the model's: f32 router / router_bias /
    index_weights whatever the load dtype) and placed with its spec."""

    def put(x, spec, want):
        x = np.asarray(x, dtype=want.dtype)
        return jax.device_put(x, sharding(mesh, spec)) if mesh is not None else jnp.asarray(x)

    return jax.tree.map(put, tree, specs, abstract)


def _zero_stack(abstract: dict, specs: dict, mesh: Mesh | None) -> dict:
    """A layer stack's zero weights, created in their placement (each layer is written in by `_write_layer`)."""
    def zeros():
        return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract)

    if mesh is None:
        return zeros()
    return jax.jit(zeros, out_shardings=jax.tree.map(lambda spec: sharding(mesh, spec), specs))()


@functools.partial(jax.jit, donate_argnums=0)
def _write_layer(stack: dict, layer: dict, index: int) -> dict:
    """The stack with `layer` (its weights, each with a leading axis of 1) written at `index`, in place."""
    return jax.tree.map(lambda s, x: jax.lax.dynamic_update_slice_in_dim(s, x, index, 0), stack, layer)


def load_hf_params(cfg: ModelConfig, path: str | os.PathLike, mesh: Mesh | None = None, dtype=jnp.float32,
                   progress: Callable | None = None, *, expert_parallel: bool = False,
                   quantization: str = "auto") -> dict:
    """Read a HF checkpoint directory into our pure-dict params, placed on `mesh` with `model.param_specs` (routed
    experts split along X when `expert_parallel`, else along F; default device when `mesh` is None). A block fp8
    checkpoint's fp8 weights stay fp8 under `quantization` "auto" (or "fp8") and load in `dtype` under "none"; an
    unquantized checkpoint's `fp8_linear.FP8_AXES` leaves are quantized to `config.ONLINE_FP8_BLOCK` under "fp8". Raises
    ValueError listing missing / unexpected tensors, shape mismatches or malformed fp8 scales before any
    conversion. `progress(iterable)` may wrap the per-layer loop (e.g. tqdm)."""
    path = os.fspath(path)
    reader = _Reader(_safetensors_files(path))
    expected = hf_tensor_shapes(cfg)
    block = fp8_block_size(path)
    scale_names = {n + "_scale_inv" for n, shape in expected.items() if len(shape) == 2} if block else set()
    ignored = _unused_layer_names(path, cfg, reader.location)
    missing = sorted(set(expected) - set(reader.location))
    unexpected = sorted(set(reader.location) - set(expected) - scale_names - ignored)
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match the config: missing tensors {missing[:20]}"
                         f"{' ...' if len(missing) > 20 else ''}, unexpected tensors {unexpected[:20]}"
                         f"{' ...' if len(unexpected) > 20 else ''}")
    wrong = [f"{n}: file {reader.shape(n)} != expected {s}" for n, s in expected.items() if reader.shape(n) != s]
    if wrong:
        raise ValueError(f"checkpoint {path} has tensors of the wrong shape or type: {wrong[:20]}")
    read, read_layer = _readers(path, cfg, reader, expected, quantization)

    _, abstract = abstract_model(cfg, dtype, loaded_fp8_block(path, quantization))
    abstract = nnx.to_pure_dict(abstract)
    specs = param_specs(abstract, expert_parallel=expert_parallel)
    if mesh is not None:
        check_fp8_shardable(abstract, specs, mesh)
    stacks = {stack.name: _zero_stack(abstract[stack.name], specs[stack.name], mesh) for stack in layer_stacks(cfg)}
    layers = range(cfg.num_hidden_layers)
    for layer in progress(layers) if progress else layers:
        ours = read_layer(layer)
        stack = stack_of(cfg, layer)
        placed = _place(jax.tree.map(lambda x: x[None], ours), specs[stack.name], abstract[stack.name], mesh)
        stacks[stack.name] = _write_layer(stacks[stack.name], placed, layer - stack.first)
    top = {"embed": read("model.embed_tokens.weight"), "final_norm": read("model.norm.weight"),
           "lm_head": read("lm_head.weight").T}
    params = stacks | {k: _place(v, specs[k], abstract[k], mesh) for k, v in top.items()}
    _check_filled(abstract, params)
    return params


def _readers(path: str, cfg: ModelConfig, reader: _Reader, expected: dict[str, tuple[int, ...]],
             quantization: str) -> tuple[Callable[[str], np.ndarray], Callable[[int], dict]]:
    """(read(name), read_layer(layer)) of the checkpoint under `quantization` (`_fp8_reader`, `_read_layer`), once
    its fp8 scales pass `_checked_fp8_scales`."""
    block, kept_block = fp8_block_size(path), kept_fp8_block(path, quantization)
    scale_values = _checked_fp8_scales(path, cfg, reader, expected, block, kept_block is not None)
    read = _fp8_reader(reader, scale_values, block, kept_block)
    return read, functools.partial(_read_layer, cfg, read=read, scale_values=scale_values, kept_block=kept_block,
                                   online_block=online_fp8_block(path, quantization))


def _kept(name: str, kept_block: tuple[int, int] | None) -> bool:
    """Whether the tensor `name` of a block fp8 checkpoint stays fp8: one of the leaves DeepSeek stores in fp8, with
    kept_block set."""
    return kept_block is not None and name.endswith(_FP8_TENSORS)


def _fp8_reader(reader: _Reader, scale_values: dict[str, np.ndarray], block: tuple[int, int] | None,
                kept_block: tuple[int, int] | None) -> Callable[[str], np.ndarray]:
    """read(name): the tensor as stored, dequantized from fp8 unless it is kept (`_kept`)."""

    def read(name: str) -> np.ndarray:
        if name in scale_values and not _kept(name, kept_block):
            return dequantize_fp8(reader.get(name), scale_values[name], block)
        return reader.get(name)

    return read


def _read_layer(cfg: ModelConfig, layer: int, read: Callable[[str], np.ndarray], scale_values: dict[str, np.ndarray],
                kept_block: tuple[int, int] | None, online_block: tuple[int, int] | None) -> dict:
    """Decoder layer `layer` (a main one or the MTP layer) as our params: its kept fp8 leaves `Fp8BlockWeight`s, or
    with `online_block` its fp8 leaves quantized to that block here."""
    prefix = f"model.layers.{layer}."
    names = [prefix + name for name in layer_tensor_shapes(cfg, layer)]
    ours = layer_to_ours(cfg, layer, {n[len(prefix):]: read(n) for n in names})
    if online_block:
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            return jax.tree.map(np.asarray, _quantized_on_host(ours, online_block))
    if not kept_block:
        return ours
    layer_scales = {n[len(prefix):]: scale_values[n] for n in names if n in scale_values and _kept(n, kept_block)}
    return _with_scales(ours, _layer_scales_to_ours(cfg, layer_scales, kept_block, cfg.is_moe_layer(layer)),
                        kept_block)


def check_fp8_shardable(abstract: dict, specs: dict, mesh: Mesh) -> None:
    """ValueError naming the first fp8 leaf of `abstract` whose rank slice under `specs` on `mesh` is not whole
    blocks (`fp8_linear.check_shardable`)."""
    flat = jax.tree_util.tree_flatten_with_path(abstract, is_leaf=fp8_linear.is_fp8)[0]
    for (path, leaf), spec in zip(flat, jax.tree.leaves(specs, is_leaf=fp8_linear.is_fp8)):
        if fp8_linear.is_fp8(leaf):
            fp8_linear.check_shardable(jax.tree_util.keystr(path), leaf, fp8_linear.plain_spec(leaf, spec.values),
                                       dict(mesh.shape))


def _check_filled(abstract: dict, params: dict) -> None:
    want = jax.tree_util.tree_flatten_with_path(abstract)
    got = jax.tree_util.tree_flatten_with_path(params)
    if jax.tree.structure(abstract) != jax.tree.structure(params):
        raise ValueError(f"converted params do not fill the model: {jax.tree.structure(params)}")
    for (path, a), (_, b) in zip(want[0], got[0]):
        if tuple(a.shape) != tuple(b.shape):
            raise ValueError(f"{jax.tree_util.keystr(path)}: converted shape {b.shape} != model shape {a.shape}")
        if a.dtype != b.dtype:
            raise ValueError(f"{jax.tree_util.keystr(path)}: converted dtype {b.dtype} != model dtype {a.dtype}")


def save_hf(cfg: ModelConfig, params: dict, path: str | os.PathLike, *, mtp: dict | None = None) -> None:
    """Write `config.json` (`cfg`'s) and `model.safetensors` (HF names; bfloat16 when cfg.torch_dtype says so,
    else float32) that `load_hf_params` and HF read; with `mtp` (an `MtpLayer`'s pure dict) its layer too
    (`mtp_to_hf`). The written config's num_nextn_predict_layers counts the MTP layers written (1 or 0)."""
    import ml_dtypes

    from safetensors.numpy import save_file

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    host = jax.tree.map(lambda x: np.asarray(jax.device_get(x), np.float32), params)
    tensors = {"model.embed_tokens.weight": host["embed"], "model.norm.weight": host["final_norm"],
               "lm_head.weight": host["lm_head"].T}
    for layer in range(cfg.num_hidden_layers):
        tensors |= {f"model.layers.{layer}.{k}": v
                    for k, v in layer_to_hf(cfg, layer, layer_params(cfg, host, layer)).items()}
    cfg = dataclasses.replace(cfg, num_nextn_predict_layers=int(mtp is not None))  # the layers written
    if mtp is not None:
        tensors |= mtp_to_hf(cfg, jax.tree.map(lambda x: np.asarray(jax.device_get(x), np.float32), mtp), host)
    dtype = ml_dtypes.bfloat16 if cfg.torch_dtype == "bfloat16" else np.float32
    save_file({k: np.ascontiguousarray(v.astype(dtype)) for k, v in tensors.items()},
              os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_hf_dict(), f, indent=2, sort_keys=True)


def _mtp_prefix(cfg: ModelConfig) -> str:
    return f"model.layers.{cfg.num_hidden_layers}."


def mtp_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint's MTP layer (HF layer `num_hidden_layers`): name -> shape. Its
    embed_tokens and shared_head.head are copies of the main model's embedding and lm_head."""
    d, a, prefix = cfg.hidden_size, cfg.vocab_size, _mtp_prefix(cfg)
    layer = layer_tensor_shapes(cfg, cfg.num_hidden_layers)
    own = {"enorm.weight": (d,), "hnorm.weight": (d,), "eh_proj.weight": (d, 2 * d),
           "shared_head.norm.weight": (d,), "shared_head.head.weight": (a, d), "embed_tokens.weight": (a, d)}
    return {prefix + name: shape for name, shape in (layer | own).items()}


def mtp_to_hf(cfg: ModelConfig, mtp: dict, params: dict) -> dict[str, np.ndarray]:
    """An `MtpLayer`'s pure dict (numpy) and the main model's (for the copies of the embedding and the head) ->
    HF tensors of the MTP layer (full names)."""
    own = {"enorm.weight": mtp["enorm"], "hnorm.weight": mtp["hnorm"], "eh_proj.weight": mtp["eh_proj"].T,
           "shared_head.norm.weight": mtp["head_norm"], "shared_head.head.weight": params["lm_head"].T,
           "embed_tokens.weight": params["embed"]}
    layer = layer_to_hf(cfg, cfg.num_hidden_layers, mtp["layer"])
    return {_mtp_prefix(cfg) + name: value for name, value in (layer | own).items()}


def load_mtp_params(cfg: ModelConfig, path: str | os.PathLike, quantization: str = "auto") -> dict:
    """The MTP layer of a HF checkpoint directory as an `MtpLayer`'s pure dict of numpy arrays, f32; a block fp8
    checkpoint's as `load_hf_params` reads its layers: its decoder layer's fp8 leaves stay fp8 under quantization
    "auto" or "fp8", the rest (eh_proj among them, if stored in fp8) dequantized; an unquantized checkpoint's
    decoder-layer fp8 leaves quantized under "fp8". Strict: ValueError naming missing tensors,
    wrong shapes or malformed fp8 scales; its copies of the embedding and the head must equal the main model's."""
    path = os.fspath(path)
    reader = _Reader(_safetensors_files(path))
    expected = mtp_tensor_shapes(cfg)
    missing = sorted(set(expected) - set(reader.location))
    wrong = [f"{n}: file {reader.shape(n)} != expected {s}" for n, s in expected.items()
             if n in reader.location and reader.shape(n) != s]
    if missing or wrong:
        raise ValueError(f"checkpoint {path}: MTP layer missing tensors {missing[:20]}, wrong shapes {wrong[:20]}")
    read, read_layer = _readers(path, cfg, reader, expected, quantization)
    prefix = _mtp_prefix(cfg)

    def own(name: str) -> np.ndarray:
        return np.asarray(read(prefix + name), np.float32)

    for copy, main in (("embed_tokens.weight", "model.embed_tokens.weight"),
                       ("shared_head.head.weight", "lm_head.weight")):
        if not np.array_equal(np.asarray(reader.get(prefix + copy), np.float32),
                              np.asarray(reader.get(main), np.float32)):
            raise ValueError(f"checkpoint {path}: {prefix}{copy} differs from {main} (the MTP layer shares it)")

    def f32(x):  # an fp8 leaf keeps its e4m3 values, its scales f32 as the model's
        if fp8_linear.is_fp8(x):
            return dataclasses.replace(x, scales=np.asarray(x.scales, np.float32))
        return np.asarray(x, np.float32)

    layer = read_layer(cfg.num_hidden_layers)
    return {"enorm": own("enorm.weight"), "hnorm": own("hnorm.weight"), "eh_proj": own("eh_proj.weight").T,
            "head_norm": own("shared_head.norm.weight"), "layer": jax.tree.map(f32, layer, is_leaf=fp8_linear.is_fp8)}
