"""The single-device, unsharded computation of the sparse decode layer: the yardstick for DCP.

No paging, no DCP, no absorption: each row's history is a dense [T, ...] array and attention uses explicit
per-head keys and values, exactly as HF writes it. Letters: see the legend in `dcp_jax/__init__.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dcp_jax.model.attention import cache_formats, projections
from dcp_jax.model.attention.params import DsaParams
from dcp_jax.config import ModelConfig
from dcp_jax.model import fp8_linear
from pallas_kernels import reference

HIGHEST = jax.lax.Precision.HIGHEST


def sparse_attention_unsharded(p: DsaParams, x, q_a, latents, index_keys, cos_sin, context_lens, *,
                               cfg: ModelConfig):
    """x [R, D] and its q_a [R, Q] (`projections.low_rank_projections`); latents [R, T, C+E] and index_keys
    [R, T, J] (or their fp8 forms, `cache_formats.py`) hold each row's history with the new token already written
    at context_lens-1. Returns (output [R, D], selected top-k positions [R, K], -1 padded)."""
    cos, sin = cos_sin
    q_resid, q_nope, q_pe = projections.mla_query(p, q_a, cos, sin, cfg, backend="reference")
    index_q = projections.index_query(p, q_resid, cos, sin, cfg, backend="reference")
    index_q, weights = cache_formats.encode_index_queries(index_q, projections.index_weights(p, x, cfg), index_keys)
    scores = cache_formats.dense_index_scores(index_q[:, None], weights[:, None], index_keys)[:, 0]  # one query a row
    _, selected = reference.topk(scores, context_lens, k=cfg.indexer.topk)
    t = latents.shape[1]
    is_selected = jnp.any(jnp.arange(t)[None, :, None] == selected[:, None, :], axis=-1)  # [R, T]
    c, k_pe = latents[..., : cfg.kv_lora_rank], latents[..., cfg.kv_lora_rank :]
    k_nope, values = projections.per_head_keys_values(p, c)
    logits = (
        jnp.einsum("rhn,rthn->rht", q_nope, k_nope, precision=HIGHEST)
        + jnp.einsum("rhe,rte->rht", q_pe, k_pe, precision=HIGHEST)
    ) * cfg.softmax_scale
    logits = jnp.where(is_selected[:, None, :], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    probs = jnp.where(is_selected[:, None, :], probs, 0.0)  # rows with nothing selected: NaN -> 0
    per_head = jnp.einsum("rht,rthv->rhv", probs, values, precision=HIGHEST)
    return fp8_linear.einsum("rhv,hvd->rd", per_head, p.wo, backend="reference"), selected
