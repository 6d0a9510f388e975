"""Pure-jnp references of the sparse DCP decode kernels: obviously right, fp32, `precision=HIGHEST`.

Each function has the signature of its kernel minus the tuning knobs; tests feed both one argument tuple.
The cross-rank steps that are not kernels (candidate merge, owner filter, LSE merge) are plain jnp already and
live, with their own tests, in `dcp_jax/attention/exchange.py`.
Letters: R rows, H heads, D head/latent dim, T tokens (columns), K top-k, W dcp size, P blocks per row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.quant import Fp8LatentCache, dequantize_latent_cache

HIGHEST = jax.lax.Precision.HIGHEST
NEG_INF = float("-inf")


def indexer_logits(q, weights, k_cache, block_tables, lens, *, k_scale=None):
    """Lightning-indexer scores over a paged index-K cache.

    q [R, H, D], weights [R, H] f32 (every scale folded in), k_cache [pages, B, D] (f32, bf16 or fp8 e4m3),
    block_tables [R, P] int32 page ids (entries past a row's length are ignored, may be -1),
    lens [R] int32 tokens per row, k_scale [pages, B] f32 per-token scale or None.
    Returns f32 [R, P*B]: `sum_h weights[r,h] * relu(q[r,h] . k_t) * k_scale[t]` for t < lens[r], -inf elsewhere.
    """
    num_pages, page_size, _ = k_cache.shape
    rows, max_blocks = block_tables.shape
    pages = jnp.clip(block_tables, 0, num_pages - 1)
    keys = k_cache[pages].astype(jnp.float32).reshape(rows, max_blocks * page_size, -1)  # [R, T, D]
    dots = jnp.einsum("rhd,rtd->rht", q.astype(jnp.float32), keys, precision=HIGHEST)
    scores = jnp.einsum("rh,rht->rt", weights.astype(jnp.float32), jax.nn.relu(dots), precision=HIGHEST)
    if k_scale is not None:
        scores = scores * k_scale[pages].astype(jnp.float32).reshape(rows, max_blocks * page_size)
    cols = jnp.arange(max_blocks * page_size)
    return jnp.where(cols[None, :] < lens[:, None], scores, NEG_INF)


def topk(scores, lens, *, k, sorted=True):
    """Exact per-row top-k over the first lens[r] columns: score descending, then column ascending.

    scores [R, T] f32, lens [R] int32, clipped to [0, T] as the kernel does. Returns values f32 [R, k], indices
    int32 [R, k]; rows with min(lens[r], T) < k are padded with (-inf, -1). sorted=False: the same entries in
    column order, pads last.
    """
    rows, cols = scores.shape
    lens = jnp.clip(lens, 0, cols)
    if k > cols:
        scores = jnp.pad(scores, ((0, 0), (0, k - cols)), constant_values=NEG_INF)
    col = jnp.arange(scores.shape[1])
    is_valid = col[None, :] < lens[:, None]
    masked = jnp.where(is_valid, scores.astype(jnp.float32), NEG_INF)
    # lax.top_k puts the lower index first among equal values.
    values, indices = jax.lax.top_k(masked, k)
    is_kept = indices < lens[:, None]
    values, indices = jnp.where(is_kept, values, NEG_INF), jnp.where(is_kept, indices, -1).astype(jnp.int32)
    if not sorted:
        column = jnp.where(is_kept, indices, jnp.iinfo(jnp.int32).max)
        _, values, indices = jax.lax.sort((column, values, indices), dimension=1, num_keys=1)
    return values, indices


def indexer_top_k(q, weights, k_cache, block_tables, lens, *, k, k_scale=None, sorted=True):
    """topk of indexer_logits: the reference of the fused pair (pallas_kernels/indexer_topk.py)."""
    return topk(indexer_logits(q, weights, k_cache, block_tables, lens, k_scale=k_scale), lens, k=k, sorted=sorted)


def sparse_mla_decode(q, kv_cache, slots, counts, sm_scale, *, value_dim=512):
    """Absorbed MLA over compacted physical slots.

    q [R, H, Dq] (latent query then rope query), kv_cache [pages, B, Dq] (latent then roped key) or an
    Fp8LatentCache (dequantized first), slots [R, S] int32 physical slots, valid first, counts [R] int32.
    value_dim = latent width (512 in DeepSeek). Returns out f32 [R, H, value_dim] (softmax-weighted latents)
    and lse f32 [R, H] (natural log of the sum of exp(scaled scores)); a row with count 0 gives out 0 and
    lse -inf.
    """
    if isinstance(kv_cache, Fp8LatentCache):
        kv_cache = dequantize_latent_cache(kv_cache)
    num_pages, page_size, width = kv_cache.shape
    flat = kv_cache.reshape(num_pages * page_size, width).astype(jnp.float32)
    num_slots = slots.shape[1]
    is_valid = jnp.arange(num_slots)[None, :] < counts[:, None]
    kv = flat[jnp.clip(jnp.where(is_valid, slots, 0), 0, num_pages * page_size - 1)]  # [R, S, Dq]
    scores = jnp.einsum("rhd,rsd->rhs", q.astype(jnp.float32), kv, precision=HIGHEST) * sm_scale
    scores = jnp.where(is_valid[:, None, :], scores, NEG_INF)
    lse = jax.nn.logsumexp(scores, axis=-1)
    probs = jnp.where(is_valid[:, None, :], jnp.exp(scores - jnp.where(jnp.isfinite(lse), lse, 0)[..., None]), 0)
    out = jnp.einsum("rhs,rsd->rhd", probs, kv[..., :value_dim], precision=HIGHEST)
    return out, lse


def local_context_lens_on_device(context_lens, rank, *, dcp, interleave):
    """The device-side "fallback" derivation of a rank's local lengths from global ones.

    Kept only as a reference for tests and for the fallback-vs-host benchmark: the decode step must never
    contain this arithmetic (the host computes `dcp_jax.layout.local_context_lens` instead).
    """
    base = (context_lens // (interleave * dcp)) * interleave
    rem = jnp.clip(context_lens - base * dcp - rank * interleave, 0, interleave)
    return base + rem
