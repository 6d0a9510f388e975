"""Weights of one MLA attention layer (`MlaParams`) and of MLA with DSA's lightning indexer (`DsaParams`), in the
layouts the decode math uses, with their HF tensors and the conversions both ways.

HF stores `[out, in]`; here every projection applied as `x @ W` is `[in, out...]`, while w_uk / w_uv keep HF's
per-head `[out, in]` order ([H, N, C], [H, V, C]; w_uv is applied C -> V). index_weights (HF's weights_proj, which
HF keeps in fp32) is f32 whatever the dtype of the rest. The projections of `fp8_linear.FP8_AXES` may instead be
`fp8_linear.Fp8BlockWeight`s of the same shape (a block fp8 checkpoint kept in fp8, values stored K-major);
`projections.py` multiplies either. Heads are split over every TP rank; everything else is replicated.
Without a low-rank query (config `q_lora_rank` null, as Moonlight's) HF's q_proj is wq_b [D, H, N+E], wqkv_a holds
kv_a_proj_with_mqa alone and q_a_norm is empty.
Letters: see the legend in `dcp_jax/__init__.py`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from dcp_jax.config import ModelConfig
from dcp_jax.model.mesh import HEADS

# HF's prefix of a layer's attention tensors.
ATTENTION = "self_attn."
_INDEXER = ATTENTION + "indexer."
# The attention tensors DeepSeek's block-fp8 release stores in e4m3 (each with a weight_scale_inv).
MLA_FP8_TENSORS = tuple(ATTENTION + n for n in ("q_a_proj.weight", "q_b_proj.weight", "q_proj.weight",
                                                 "kv_a_proj_with_mqa.weight", "kv_b_proj.weight", "o_proj.weight"))
INDEXER_FP8_TENSORS = (_INDEXER + "wq_b.weight", _INDEXER + "wk.weight")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MlaParams:
    wqkv_a: jax.Array  # [D, Q+C+E]: HF's q_a_proj then kv_a_proj_with_mqa (vLLM's fused_qkv_a_proj); [D, C+E] w/o Q
    q_a_norm: jax.Array  # [Q] ([0] without a low-rank query)
    wq_b: jax.Array  # [Q, H, N+E] (HF's q_b_proj; q_proj [D, H, N+E] without Q), heads split over all TP ranks
    kv_a_norm: jax.Array  # [C]
    w_uk: jax.Array  # [H, N, C] (kv_b_proj rows of k_nope), heads split
    w_uv: jax.Array  # [H, V, C] (kv_b_proj rows of v), heads split
    wo: jax.Array  # [H, V, D], heads split


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DsaParams(MlaParams):
    index_wq: jax.Array  # [Q, I, J]
    index_wk: jax.Array  # [D, J]
    index_k_norm: jax.Array  # [J] LayerNorm weight
    index_k_norm_bias: jax.Array  # [J] LayerNorm bias
    index_weights: jax.Array  # [D, I], f32


def mla_partition_specs() -> dict[str, P]:
    """Heads split over every TP rank; the low-rank projections and norms replicated."""
    rep = P()
    return dict(wqkv_a=rep, q_a_norm=rep, wq_b=P(None, HEADS, None), kv_a_norm=rep, w_uk=P(HEADS, None, None),
                w_uv=P(HEADS, None, None), wo=P(HEADS, None, None))


def indexer_partition_specs() -> dict[str, P]:
    """The indexer is replicated: every rank scores its own shard of keys with all index heads."""
    return dict.fromkeys(("index_wq", "index_wk", "index_k_norm", "index_k_norm_bias", "index_weights"), P())


class _Draws:
    """Random weights, one key each: normal / sqrt(fan_in) projections, norms 1 + 0.1 normal (nothing an
    identity)."""

    def __init__(self, key):
        self._keys = iter(jax.random.split(key, 16))

    def dense(self, shape, fan_in, dtype):
        return (jax.random.normal(next(self._keys), shape, jnp.float32) * fan_in**-0.5).astype(dtype)

    def norm(self, size, dtype):
        return (1.0 + 0.1 * jax.random.normal(next(self._keys), (size,), jnp.float32)).astype(dtype)

    def bias(self, size, dtype):
        return (0.1 * jax.random.normal(next(self._keys), (size,), jnp.float32)).astype(dtype)


def _mla_weights(cfg: ModelConfig, draws: _Draws, dtype) -> dict:
    d, q, h = cfg.hidden_size, cfg.query_input_dim, cfg.num_attention_heads
    n, e, v, c = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    low_rank = cfg.q_lora_rank or 0
    wq_a, q_a_norm = draws.dense((d, low_rank), d, dtype), draws.norm(low_rank, dtype)
    wq_b = draws.dense((q, h, n + e), q, dtype)
    wkv_a = draws.dense((d, c + e), d, dtype)
    return dict(wqkv_a=jnp.concatenate([wq_a, wkv_a], axis=1), q_a_norm=q_a_norm, wq_b=wq_b,
                kv_a_norm=draws.norm(c, dtype), w_uk=draws.dense((h, n, c), c, dtype),
                w_uv=draws.dense((h, v, c), c, dtype), wo=draws.dense((h, v, d), h * v, dtype))


def init_mla_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32) -> MlaParams:
    """Random MLA weights in `dtype`."""
    return MlaParams(**_mla_weights(cfg, _Draws(key), dtype))


def init_dsa_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32) -> DsaParams:
    """Random MLA and indexer weights: everything in `dtype` except index_weights, f32 (as HF keeps weights_proj)."""
    draws = _Draws(key)
    mla = _mla_weights(cfg, draws, dtype)
    d, q, i, j = cfg.hidden_size, cfg.q_lora_rank, cfg.indexer.heads, cfg.indexer.head_dim
    return DsaParams(**mla, index_wq=draws.dense((q, i, j), q, dtype), index_wk=draws.dense((d, j), d, dtype),
                     index_k_norm=draws.norm(j, dtype), index_k_norm_bias=draws.bias(j, dtype),
                     index_weights=draws.dense((d, i), d, jnp.float32))


# ---- HF tensors ----------------------------------------------------------------------------------------------


def mla_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF's MLA tensors of one layer (relative to the layer) -> shape."""
    d, q, h = cfg.hidden_size, cfg.q_lora_rank, cfg.num_attention_heads
    n, e, v, c = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    a = ATTENTION
    query = ({a + "q_proj.weight": (h * (n + e), d)} if q is None else
             {a + "q_a_proj.weight": (q, d), a + "q_a_layernorm.weight": (q,), a + "q_b_proj.weight": (h * (n + e), q)})
    return query | {a + "kv_a_proj_with_mqa.weight": (c + e, d), a + "kv_a_layernorm.weight": (c,),
                    a + "kv_b_proj.weight": (h * (n + v), c), a + "o_proj.weight": (d, h * v)}


def indexer_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF's indexer tensors of one layer -> shape."""
    d, q, i, j = cfg.hidden_size, cfg.q_lora_rank, cfg.indexer.heads, cfg.indexer.head_dim
    x = _INDEXER
    return {x + "wq_b.weight": (i * j, q), x + "wk.weight": (j, d), x + "k_norm.weight": (j,),
            x + "k_norm.bias": (j,), x + "weights_proj.weight": (i, d)}


def mla_to_ours(cfg: ModelConfig, t: dict[str, np.ndarray]) -> dict:
    """HF's MLA tensors -> our MLA weights (views of the [out, in] tensors; wqkv_a one stacked copy), so block-fp8
    values kept K-major (`fp8_linear.from_plain_layout`) are the checkpoint's bytes in their own order."""
    h, n, d, q = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.hidden_size, cfg.query_input_dim
    a = ATTENTION
    kv_a = t[a + "kv_a_proj_with_mqa.weight"]
    kv_b = t[a + "kv_b_proj.weight"].reshape(h, n + cfg.v_head_dim, cfg.kv_lora_rank)
    if cfg.q_lora_rank is None:
        query = dict(wqkv_a=kv_a.T, q_a_norm=np.zeros((0,), t[a + "kv_a_layernorm.weight"].dtype),
                     wq_b=t[a + "q_proj.weight"].reshape(h, cfg.qk_head_dim, q).transpose(2, 0, 1))
    else:
        query = dict(wqkv_a=np.concatenate([t[a + "q_a_proj.weight"], kv_a]).T, q_a_norm=t[a + "q_a_layernorm.weight"],
                     wq_b=t[a + "q_b_proj.weight"].reshape(h, cfg.qk_head_dim, q).transpose(2, 0, 1))
    return query | dict(kv_a_norm=t[a + "kv_a_layernorm.weight"], w_uk=kv_b[:, :n], w_uv=kv_b[:, n:],
                        wo=t[a + "o_proj.weight"].reshape(d, h, cfg.v_head_dim).transpose(1, 2, 0))


def indexer_to_ours(cfg: ModelConfig, t: dict[str, np.ndarray]) -> dict:
    x = _INDEXER
    return dict(index_wq=t[x + "wq_b.weight"].reshape(cfg.indexer.heads, cfg.indexer.head_dim,
                                                      cfg.q_lora_rank).transpose(2, 0, 1),
                index_wk=t[x + "wk.weight"].T, index_k_norm=t[x + "k_norm.weight"],
                index_k_norm_bias=t[x + "k_norm.bias"], index_weights=t[x + "weights_proj.weight"].T)


def mla_to_hf(cfg: ModelConfig, p: dict) -> dict[str, np.ndarray]:
    """Inverse of `mla_to_ours`."""
    h, q, a = cfg.num_attention_heads, cfg.q_lora_rank, ATTENTION
    query = ({a + "q_proj.weight": p["wq_b"].reshape(cfg.hidden_size, -1).T} if q is None else
             {a + "q_a_proj.weight": p["wqkv_a"][:, :q].T, a + "q_a_layernorm.weight": p["q_a_norm"],
              a + "q_b_proj.weight": p["wq_b"].reshape(q, -1).T})
    return query | {
        a + "kv_a_proj_with_mqa.weight": p["wqkv_a"][:, q or 0:].T, a + "kv_a_layernorm.weight": p["kv_a_norm"],
        a + "kv_b_proj.weight": np.concatenate([p["w_uk"], p["w_uv"]], axis=1).reshape(-1, cfg.kv_lora_rank),
        a + "o_proj.weight": p["wo"].reshape(h * cfg.v_head_dim, -1).T}


def indexer_to_hf(cfg: ModelConfig, p: dict) -> dict[str, np.ndarray]:
    """Inverse of `indexer_to_ours`."""
    x = _INDEXER
    return {x + "wq_b.weight": p["index_wq"].reshape(cfg.q_lora_rank, -1).T, x + "wk.weight": p["index_wk"].T,
            x + "k_norm.weight": p["index_k_norm"], x + "k_norm.bias": p["index_k_norm_bias"],
            x + "weights_proj.weight": p["index_weights"].T}


def mla_fp8_scales_to_ours(cfg: ModelConfig, scales: dict, block: tuple[int, int]) -> dict:
    """The MLA tensors' weight_scale_inv grids (HF [out blocks, in blocks]) -> our fp8 leaves' scales: kv_b_proj's
    split per head into w_uk's and w_uv's blocks, q_a_proj's and kv_a_proj_with_mqa's stacked as wqkv_a."""
    a = ATTENTION
    kv_b = scales[a + "kv_b_proj.weight"]
    kv_b = kv_b.reshape(cfg.num_attention_heads, -1, kv_b.shape[1])  # [H, (N+V)/bn, C/bk]
    nope_blocks = cfg.qk_nope_head_dim // block[0]
    kv_a = scales[a + "kv_a_proj_with_mqa.weight"]
    query = (dict(wqkv_a=kv_a, wq_b=scales[a + "q_proj.weight"]) if cfg.q_lora_rank is None else
             dict(wqkv_a=np.concatenate([scales[a + "q_a_proj.weight"], kv_a]), wq_b=scales[a + "q_b_proj.weight"]))
    return query | dict(w_uk=kv_b[:, :nope_blocks], w_uv=kv_b[:, nope_blocks:], wo=scales[a + "o_proj.weight"])


def indexer_fp8_scales_to_ours(scales: dict) -> dict:
    return dict(index_wq=scales[_INDEXER + "wq_b.weight"], index_wk=scales[_INDEXER + "wk.weight"])


def mla_fp8_problems(cfg: ModelConfig, block: tuple[int, int]) -> list[str]:
    """Why MLA weights cannot stay in block fp8 of `block`: kv_b_proj blocks that straddle the k_nope / v rows of a
    head, q_a_proj rows that end mid-block (its scales could not stack with kv_a_proj_with_mqa's in wqkv_a)."""
    problems = []
    if cfg.qk_nope_head_dim % block[0] or cfg.v_head_dim % block[0]:
        problems.append(f"kv_b_proj: blocks of {block[0]} rows straddle a head's {cfg.qk_nope_head_dim} k_nope and "
                        f"{cfg.v_head_dim} v rows; load with quantization='none'")
    if cfg.q_lora_rank is not None and cfg.q_lora_rank % block[0]:
        problems.append(f"q_a_proj: its {cfg.q_lora_rank} rows do not fill blocks of {block[0]}, so its scales "
                        "cannot be stacked with kv_a_proj_with_mqa's in wqkv_a; load with quantization='none'")
    return problems
