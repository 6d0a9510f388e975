"""One sparse attention layer over whole prompts, per rank (call inside shard_map over the mesh of `mesh.py`).

Tensor parallel only: every rank computes every prompt token with its own heads (split over all TP ranks, as in
decode) and writes each token's latent and index key into its owner's KV shard at the host-computed slots of the
step's `PrefillMetadata`. HF's sparse rule per query s: keys t <= s, the top-min(K, s+1) by index score (with an
fp8 index cache, the scores of the fp8 queries and the fp8 keys it stores, as decode computes them), attending over
the latents as the cache stores them (an fp8 cache's dequantized values).
Letters as in `params.py`; R prompts, T tokens of a prompt, B page size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels
from dcp_jax.config import ModelConfig
from dcp_jax.model.attention import cache_formats, projections
from dcp_jax.model.attention.decode import write_slots
from dcp_jax.model.attention.params import AttentionParams
from dcp_jax.model.mesh import HEADS

HIGHEST = jax.lax.Precision.HIGHEST
NEG_INF = float("-inf")
# Queries per attention step. Its per-head index dots take R x 64 x index_n_heads x T f32 (2 GiB at 64 heads and
# T = 128K, instead of T x T x heads), its gathered latents R x 64 x index_topk x (C + E).
QUERY_CHUNK = 64


def sparse_prefill_attention(p: AttentionParams, x, kv_cache, index_cache, rope, slots, *, cfg: ModelConfig,
                             query_chunk: int = QUERY_CHUNK):
    """Per rank: x [R, T, D] replicated (every prompt token), rope (cos, sin) [R, T, E/2], this rank's kv_cache
    [pages, B, C+E] and index_cache [pages, B, J] (or their fp8 forms, `cache_formats.py`), slots [R, T] this
    rank's write slots (-1: not owned, or a pad token: no write).

    Queries run in chunks of `query_chunk` (one `lax.map` step each), so the index scores take O(R * chunk * T)
    memory and attention gathers each query's K selected latents, O(R * chunk * K); neither is O(T^2). Pad queries
    past a prompt's end compute garbage that nobody reads; a valid query never sees a later (pad) key.
    Returns (output [R, T, D] summed over TP ranks, kv_cache, index_cache, selected ids [R, T, K]).
    """
    r, t, d = x.shape
    cos, sin = (a.reshape(r * t, -1) for a in rope)
    flat = x.reshape(r * t, d)
    # 1. Projections of every token, index queries and keys in the index cache's format; each token's latent and
    # index key are written by its owner only.
    with jax.named_scope("projections"):
        q_resid, q_nope, q_pe = projections.mla_query(p, flat, cos, sin, cfg)
        index_q, weights = cache_formats.encode_index_queries(
            projections.index_query(p, q_resid, cos, sin, cfg).reshape(r, t, cfg.index_n_heads, -1),
            projections.index_weights(p, flat, cfg).reshape(r, t, -1), index_cache)
        latent = cache_formats.encode_latents(projections.mla_latent(p, flat, cos, sin, cfg), kv_cache)
        index_k = cache_formats.encode_index_keys(projections.index_key(p, flat, cos, sin, cfg), index_cache)
        kv_cache = write_slots(kv_cache, slots.reshape(-1), latent)
        index_cache = write_slots(index_cache, slots.reshape(-1), index_k)
        q = projections.absorb_query(p, q_nope, q_pe).reshape(r, t, -1, cfg.latent_dim)
    latent = cache_formats.latent_values(latent).reshape(r, t, cfg.latent_dim)  # as the cache stores them
    index_k = jax.tree.map(lambda a: a.reshape(r, t, *a.shape[1:]), index_k)
    chunk = min(query_chunk, t)
    num_chunks = -(-t // chunk)
    padded = num_chunks * chunk

    def by_chunk(a):  # [R, T, ...] -> [num_chunks, R, chunk, ...], pad queries past T
        a = jnp.pad(a, [(0, 0), (0, padded - t)] + [(0, 0)] * (a.ndim - 2))
        return jnp.moveaxis(a.reshape(r, num_chunks, chunk, *a.shape[2:]), 1, 0)

    def attend_chunk(args):
        first, chunk_index_q, chunk_weights, chunk_q = args
        # 2. Index scores of this chunk's queries over the causal prefix, then the top-min(K, s+1) per query.
        with jax.named_scope("indexer"):
            scores = cache_formats.dense_index_scores(chunk_index_q, chunk_weights, index_k)
            causal_lens = jnp.minimum(first + jnp.arange(1, chunk + 1, dtype=jnp.int32), t)
            # XLA's top-k: the Pallas one compiles for tens of seconds per shape, and this dense prefill has a shape
            # per prompt length.
            _, selected = pallas_kernels.topk(scores.reshape(r * chunk, t), jnp.tile(causal_lens, r), k=cfg.index_topk,
                                              backend="reference")
            selected = selected.reshape(r, chunk, -1)
        # 3. Absorbed MLA over the gathered selected latents of this rank's heads.
        with jax.named_scope("sparse_mla"):
            keys = latent[jnp.arange(r)[:, None, None], jnp.maximum(selected, 0)]  # [R, chunk, K, C+E]
            # f32 logits, softmax and value accumulation in any dtype (HF: fp32 softmax; decode's kernel: f32).
            logits = jnp.einsum("rshc,rskc->rhsk", chunk_q, keys, precision=HIGHEST,
                                preferred_element_type=jnp.float32) * cfg.softmax_scale
            logits = jnp.where((selected >= 0)[:, None], logits, NEG_INF)
            probs = jax.nn.softmax(logits, axis=-1)
            out = jnp.einsum("rhsk,rskc->rshc", probs, keys[..., : cfg.kv_lora_rank].astype(jnp.float32),
                             precision=HIGHEST, preferred_element_type=jnp.float32).astype(x.dtype)
        return out, selected

    firsts = jnp.arange(num_chunks, dtype=jnp.int32) * chunk
    out, selected = jax.lax.map(attend_chunk, (firsts, by_chunk(index_q), by_chunk(weights), by_chunk(q)))
    out = jnp.moveaxis(out, 0, 1).reshape(r, padded, *out.shape[3:])[:, :t]
    selected = jnp.moveaxis(selected, 0, 1).reshape(r, padded, -1)[:, :t]
    # 4. W_UV, o_proj and the TP all-reduce.
    attn = jax.lax.psum(projections.output_projection(p, out.reshape(r * t, -1, cfg.kv_lora_rank)), HEADS)
    return attn.reshape(r, t, d), kv_cache, index_cache, selected
