"""Per-token projections of one attention layer (HF DeepSeek-V3.2 math), shared by every code path.

Letters: see the legend in `dcp_jax/__init__.py`. Any leading batch dims work where R is written.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dcp_jax.model.attention.params import DsaParams, MlaParams
from dcp_jax.config import ModelConfig
from dcp_jax.model import fp8_linear
from dcp_jax.model.fp8_linear import einsum
from dcp_jax.model.rope import apply_rope

HIGHEST = jax.lax.Precision.HIGHEST
# HF's indexer LayerNorm epsilon.
INDEX_NORM_EPS = 1e-6
# HF's q_a_layernorm and kv_a_layernorm are built with eps 1e-6 whatever config.rms_norm_eps says.
LATENT_NORM_EPS = 1e-6


def rms_norm(x, weight, eps):
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * weight.astype(jnp.float32)).astype(x.dtype)


def layer_norm(x, weight, bias, eps):
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    normed = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (normed * weight.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def low_rank_projections(p: MlaParams, x, cfg: ModelConfig, *, backend: str):
    """x [R, D] -> (q_a [R, Q], ckv [R, C+E]): q_a_proj and kv_a_proj_with_mqa as one product (`wqkv_a`); without a
    low-rank query, q_a is x itself (what q_proj reads)."""
    qkv_a = einsum("rd,dn->rn", x, p.wqkv_a, backend=backend)
    if cfg.q_lora_rank is None:
        return x, qkv_a
    return qkv_a[..., : cfg.q_lora_rank], qkv_a[..., cfg.q_lora_rank :]


def mla_query(p: MlaParams, q_a, cos, sin, cfg: ModelConfig, *, backend: str):
    """q_a [R, Q] (`low_rank_projections`) -> (q_resid [R, Q], q_nope [R, H, N], roped q_pe [R, H, E]) for the
    heads in `p` (without a low-rank query q_a is x, not normed: HF's q_proj)."""
    q_resid = q_a if cfg.q_lora_rank is None else rms_norm(q_a, p.q_a_norm, LATENT_NORM_EPS)
    q = einsum("rq,qhk->rhk", q_resid, p.wq_b, backend=backend)
    q_nope, q_pe = q[..., : cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim :]
    return q_resid, q_nope, apply_rope(q_pe, cos, sin, interleaved=True)


def mla_latent(p: MlaParams, ckv, cos, sin, cfg: ModelConfig):
    """ckv [R, C+E] (`low_rank_projections`) -> the cached MLA entry [R, C+E]: normed latent c, then the roped
    shared key k_pe."""
    c = rms_norm(ckv[..., : cfg.kv_lora_rank], p.kv_a_norm, LATENT_NORM_EPS)
    k_pe = apply_rope(ckv[..., None, cfg.kv_lora_rank :], cos, sin, interleaved=True)[..., 0, :]
    return jnp.concatenate([c, k_pe], axis=-1)


def per_head_keys_values(p: MlaParams, c):
    """Latents c [..., C] -> (k_nope [..., H, N], values [..., H, V]): kv_b_proj as a linear layer, as HF writes it
    (a block fp8 W_UK / W_UV dequantized, as in `absorb_query`)."""
    k_nope = jnp.einsum("...c,hnc->...hn", c, fp8_linear.weight_values(p.w_uk, c.dtype), precision=HIGHEST)
    values = jnp.einsum("...c,hvc->...hv", c, fp8_linear.weight_values(p.w_uv, c.dtype), precision=HIGHEST)
    return k_nope, values


def absorb_query(p: MlaParams, q_nope, q_pe):
    """MQA form of the query: [q_nope @ W_UK | q_pe] -> [R, H, C+E], scored against cached [c | k_pe]. A block
    fp8 W_UK is dequantized (it contracts its output axis N), as DeepSeek's inference dequantizes kv_b_proj for
    the absorbed products."""
    w_uk = fp8_linear.weight_values(p.w_uk, q_nope.dtype)
    q_latent = jnp.einsum("rhn,hnc->rhc", q_nope, w_uk, precision=HIGHEST)
    return jnp.concatenate([q_latent, q_pe.astype(q_latent.dtype)], axis=-1)


def output_projection(p: MlaParams, latent_out, *, backend: str):
    """Attention output in latent space [R, H, C] -> partial hidden [R, D] of the heads in `p`. A block fp8
    W_UV is dequantized, as W_UK (`absorb_query`)."""
    w_uv = fp8_linear.weight_values(p.w_uv, latent_out.dtype)
    per_head = jnp.einsum("rhc,hvc->rhv", latent_out, w_uv, precision=HIGHEST)
    return einsum("rhv,hvd->rd", per_head, p.wo, backend=backend)


def index_query(p: DsaParams, q_resid, cos, sin, cfg: ModelConfig, *, backend: str):
    """q_resid [R, Q] -> indexer queries [R, I, J]; layout [rope | nope], half-split RoPE (interleaved where the
    config's indexer says so: GLM)."""
    q = einsum("rq,qij->rij", q_resid, p.index_wq, backend=backend)
    e = cfg.qk_rope_head_dim
    roped = apply_rope(q[..., :e], cos, sin, interleaved=cfg.indexer.rope_interleave)
    return jnp.concatenate([roped, q[..., e:]], axis=-1)


def index_key(p: DsaParams, x, cos, sin, cfg: ModelConfig, *, backend: str):
    """x [R, D] -> indexer key [R, J]: LayerNorm (with bias), [rope | nope], RoPE as `index_query`'s."""
    k = einsum("rd,dj->rj", x, p.index_wk, backend=backend)
    k = layer_norm(k, p.index_k_norm, p.index_k_norm_bias, INDEX_NORM_EPS)
    e = cfg.qk_rope_head_dim
    k_pe = apply_rope(k[..., None, :e], cos, sin, interleaved=cfg.indexer.rope_interleave)[..., 0, :]
    return jnp.concatenate([k_pe, k[..., e:]], axis=-1)


def index_weights(p: DsaParams, x, cfg: ModelConfig):
    """Per-head weights [R, I] f32 with I^-0.5 and the J^-0.5 score scale folded in (relu commutes with it).
    A GEMM in x's dtype accumulated in f32: exact in an f32 model (HF runs weights_proj in fp32 on fp32 weights); in
    a bf16 one it runs on the tensor cores (in f32, cuBLAS ran it on the CUDA cores: 250 us a layer at B = 64)."""
    w = jnp.einsum("rd,di->ri", x, p.index_weights.astype(x.dtype), preferred_element_type=jnp.float32,
                   precision=HIGHEST)
    return w * (cfg.indexer.heads**-0.5 * cfg.indexer.head_dim**-0.5)
