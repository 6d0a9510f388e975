"""The model over whole sequences, differentiable, for training: causal MLA with the lightning indexer, attending
densely (every earlier token) or sparsely (the indexer's top-k, selected exactly as the serving step selects), and
the indexer's KL loss toward the main attention (DeepSeek-V3.2's dense warm-up and sparse stages).

Same weights and projections (`attention/projections.py`) as the serving programs, so a sparse forward's logits are
the serving prefill's (tested). The indexer reads its inputs detached from the main model's graph: the LM loss
never trains the indexer and the KL loss trains nothing else (the paper's separate optimization). Letters as in
`attention/params.py`; S query positions, T key positions (S = T: one sequence).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dcp_jax.config import ModelConfig
from dcp_jax.model import fp8_linear
from dcp_jax.model.attention import cache_formats, projections
from dcp_jax.model.attention.params import AttentionParams
from dcp_jax.model.rope import cos_sin, rope_tables
from pallas_kernels import reference

HIGHEST = jax.lax.Precision.HIGHEST
DENSE, SPARSE = "dense", "sparse"


def index_scores(p: AttentionParams, x, q_resid, cos, sin, cfg: ModelConfig):
    """The indexer's scores [S, T] f32 of every position against every position (causality not applied), from
    inputs detached from the main model's graph."""
    x, q_resid = jax.lax.stop_gradient(x), jax.lax.stop_gradient(q_resid)
    queries = projections.index_query(p, q_resid, cos, sin, cfg)
    keys = projections.index_key(p, x, cos, sin, cfg)
    weights = projections.index_weights(p, x, cfg)
    return cache_formats.dense_index_scores(queries[None], weights[None], keys[None])[0]


def attended(scores, *, cfg: ModelConfig, mode: str):
    """[S, T] bool: the keys each query attends. DENSE: every earlier key and itself; SPARSE: the indexer's top
    index_topk of those (all of them while fewer), ties to the lower position (`reference.topk`, as served)."""
    s, t = scores.shape
    causal = jnp.arange(t)[None, :] <= jnp.arange(s)[:, None]
    if mode == DENSE:
        return causal
    if mode != SPARSE:
        raise ValueError(f"mode must be {DENSE!r} or {SPARSE!r}, got {mode!r}")
    _, selected = reference.topk(jax.lax.stop_gradient(scores), jnp.arange(1, s + 1, dtype=jnp.int32),
                                 k=cfg.index_topk)
    columns = jnp.where(selected < 0, t, selected)  # pads land in a dropped extra column
    picked = jnp.zeros((s, t + 1), bool).at[jnp.arange(s)[:, None], columns].set(True)
    return picked[:, :t]


def indexer_kl(scores, probs, keep):
    """KL(target || indexer) summed over the kept keys, averaged over queries: the target is the main attention's
    probabilities summed over heads and renormalized over `keep` (no gradient), the indexer's distribution the
    softmax of its scores over `keep`."""
    target = jnp.where(keep, jax.lax.stop_gradient(probs.sum(axis=0)), 0.0)
    target = target / jnp.maximum(target.sum(axis=-1, keepdims=True), 1e-30)
    log_indexer = jax.nn.log_softmax(jnp.where(keep, scores, -jnp.inf), axis=-1)
    terms = jnp.where(keep & (target > 0), target * (jnp.log(jnp.where(target > 0, target, 1.0)) - log_indexer), 0.0)
    return terms.sum() / scores.shape[0]


def causal_attention(p: AttentionParams, x, cos, sin, *, cfg: ModelConfig, mode: str):
    """x [T, D] one sequence's normed hidden states -> (attention output [T, D], the indexer's KL loss, the keys
    each position attended [T, T])."""
    q_resid, q_nope, q_pe = projections.mla_query(p, x, cos, sin, cfg)
    latent = projections.mla_latent(p, x, cos, sin, cfg)
    c, k_pe = latent[:, : cfg.kv_lora_rank], latent[:, cfg.kv_lora_rank:]
    k_nope, values = projections.per_head_keys_values(p, c)
    logits = (jnp.einsum("shn,thn->hst", q_nope, k_nope, precision=HIGHEST)
              + jnp.einsum("she,te->hst", q_pe, k_pe, precision=HIGHEST)) * cfg.softmax_scale
    scores = index_scores(p, x, q_resid, cos, sin, cfg)
    keep = attended(scores, cfg=cfg, mode=mode)
    probs = jax.nn.softmax(jnp.where(keep[None], logits.astype(jnp.float32), -jnp.inf), axis=-1)
    per_head = jnp.einsum("hst,thv->shv", probs.astype(values.dtype), values, precision=HIGHEST)
    return fp8_linear.einsum("shv,hvd->sd", per_head, p.wo), indexer_kl(scores, probs, keep), keep


def feed_forward(layer, hidden):
    """`DecoderLayer.feed_forward` on one device: the MLP or MoE whole (its output not summed over ranks)."""
    return hidden + layer.mlp.partial(layer.mlp_input(hidden))


class SequenceOutput(NamedTuple):
    logits: jax.Array  # [T, A] f32, at every position
    hidden: jax.Array  # [T, D]: the last layer's output, before the final norm
    indexer_kl: jax.Array  # f32: the indexer's KL loss, averaged over layers
    attended: jax.Array  # [layers, T, T] bool: the keys each position attended in each layer


def sequence_forward(model, tokens, *, mode: str) -> SequenceOutput:
    """tokens [T] int32 through `model` (a `DeepseekV32`, unsharded, outside shard_map), attending as `mode`."""
    cfg = model.cfg
    cos, sin = cos_sin(jnp.arange(tokens.shape[0]), *rope_tables(cfg))
    hidden, kl, attended_sets = model.embed_tokens(tokens), 0.0, []
    for index in range(cfg.num_hidden_layers):
        layer = model.decoder_layer(index)
        out, layer_kl, keep = causal_attention(layer.attention.params(), layer.attention_input(hidden), cos, sin,
                                               cfg=cfg, mode=mode)
        hidden = feed_forward(layer, hidden + out)
        kl = kl + layer_kl
        attended_sets.append(keep)
    return SequenceOutput(model.logits(hidden), hidden, kl / cfg.num_hidden_layers, jnp.stack(attended_sets))
