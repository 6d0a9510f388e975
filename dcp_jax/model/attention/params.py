"""Weights of one MLA + lightning-indexer attention layer, in the layouts the decode math uses.

Letters: D hidden, Q q_lora rank, H heads, N nope dim, E rope dim, V v dim, C kv_lora rank (latent),
I index heads, J index head dim. HF stores `[out, in]`; here every projection applied as `x @ W` is `[in, out...]`,
while w_uk / w_uv keep HF's per-head `[out, in]` order ([H, N, C], [H, V, C]; w_uv is applied C -> V).
index_weights (HF's weights_proj, which HF keeps in fp32) is f32 whatever the dtype of the rest.
The projections of `fp8_linear.FP8_AXES` may instead be `fp8_linear.Fp8BlockWeight`s of the same shape (a block
fp8 checkpoint kept in fp8, values stored K-major); `projections.py` multiplies either.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dcp_jax.config import ModelConfig
from dcp_jax.model.mesh import HEADS


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionParams:
    wqkv_a: jax.Array  # [D, Q+C+E]: HF's q_a_proj then kv_a_proj_with_mqa (vLLM's fused_qkv_a_proj)
    q_a_norm: jax.Array  # [Q]
    wq_b: jax.Array  # [Q, H, N+E], heads split over all TP ranks
    kv_a_norm: jax.Array  # [C]
    w_uk: jax.Array  # [H, N, C] (kv_b_proj rows of k_nope), heads split
    w_uv: jax.Array  # [H, V, C] (kv_b_proj rows of v), heads split
    wo: jax.Array  # [H, V, D], heads split
    index_wq: jax.Array  # [Q, I, J]
    index_wk: jax.Array  # [D, J]
    index_k_norm: jax.Array  # [J] LayerNorm weight
    index_k_norm_bias: jax.Array  # [J] LayerNorm bias
    index_weights: jax.Array  # [D, I], f32


def partition_specs() -> AttentionParams:
    """Heads are split over every TP rank; everything else is replicated."""
    rep = P()
    return AttentionParams(
        wqkv_a=rep,
        q_a_norm=rep,
        wq_b=P(None, HEADS, None),
        kv_a_norm=rep,
        w_uk=P(HEADS, None, None),
        w_uv=P(HEADS, None, None),
        wo=P(HEADS, None, None),
        index_wq=rep,
        index_wk=rep,
        index_k_norm=rep,
        index_k_norm_bias=rep,
        index_weights=rep,
    )


def init_attention_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32) -> AttentionParams:
    """Random weights (normal / sqrt(fan_in)); norms and biases random too so nothing is an identity.
    Everything in `dtype` except index_weights, which is f32 (as HF keeps weights_proj). `model.Attention` uses
    this too."""
    d, q, h = cfg.hidden_size, cfg.q_lora_rank, cfg.num_attention_heads
    n, e, v, c = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    i, j = cfg.index_n_heads, cfg.index_head_dim
    keys = iter(jax.random.split(key, 16))

    def dense(shape, fan_in, dtype=dtype):
        return (jax.random.normal(next(keys), shape, jnp.float32) * fan_in**-0.5).astype(dtype)

    def norm(size):
        return (1.0 + 0.1 * jax.random.normal(next(keys), (size,), jnp.float32)).astype(dtype)

    wq_a, q_a_norm, wq_b, wkv_a = dense((d, q), d), norm(q), dense((q, h, n + e), q), dense((d, c + e), d)
    return AttentionParams(
        wqkv_a=jnp.concatenate([wq_a, wkv_a], axis=1),
        q_a_norm=q_a_norm,
        wq_b=wq_b,
        kv_a_norm=norm(c),
        w_uk=dense((h, n, c), c),
        w_uv=dense((h, v, c), c),
        wo=dense((h, v, d), h * v),
        index_wq=dense((q, i, j), q),
        index_wk=dense((d, j), d),
        index_k_norm=norm(j),
        index_k_norm_bias=(0.1 * jax.random.normal(next(keys), (j,), jnp.float32)).astype(dtype),
        index_weights=dense((d, i), d, jnp.float32),
    )
