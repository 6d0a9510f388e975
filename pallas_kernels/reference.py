"""Pure-jnp references of the public ops (`pallas_kernels.api`): obviously right, fp32, `precision=HIGHEST`.

Each function has the signature of its op minus `backend`, `interpret` and the tuning knobs; tests feed both one
argument tuple. The cross-rank steps that are not kernels (candidate merge, owner filter, LSE merge) are plain jnp
already and live, with their own tests, in `dcp_jax/model/attention/exchange.py`.
Letters: see the legend in `dcp_jax/__init__.py`; the matmuls' widths are spelled out (rows, in, out, groups).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.formats import (Fp8IndexKeys, Fp8LatentCache, Mxfp4Weight, dequantize_latent_cache,
                                    dequantize_mxfp4, kept_e4m3)

HIGHEST = jax.lax.Precision.HIGHEST
NEG_INF = float("-inf")


def indexer_logits(q, weights, index_cache, block_tables, lens):
    """Lightning-indexer scores over a paged index-key cache.

    q [R, I, J], weights [R, I] f32 (every scale folded in), index_cache [pages, B, J] (f32, bf16 or fp8 e4m3)
    or `Fp8IndexKeys` (keys [pages, B, J] e4m3, scales [pages, B] f32 per token), block_tables [R, P] int32 page
    ids (entries past a row's length are ignored, may be -1), lens [R] int32 tokens per row.
    Returns f32 [R, P*B]: `sum_i weights[r,i] * relu(q[r,i] . k_t) * scale[t]` for t < lens[r], -inf elsewhere.
    """
    k_cache, k_scale = ((index_cache.keys, index_cache.scales) if isinstance(index_cache, Fp8IndexKeys)
                        else (index_cache, None))
    num_pages, page_size, _ = k_cache.shape
    rows, max_blocks = block_tables.shape
    pages = jnp.clip(block_tables, 0, num_pages - 1)
    keys = k_cache[pages].astype(jnp.float32).reshape(rows, max_blocks * page_size, -1)  # [R, T, J]
    if q.dtype == jnp.float8_e4m3fn:  # quantized in this program, perhaps: keep its rounding (`kept_e4m3`)
        q = kept_e4m3(q)
    dots = jnp.einsum("rhd,rtd->rht", q.astype(jnp.float32), keys, precision=HIGHEST)
    scores = jnp.einsum("rh,rht->rt", weights.astype(jnp.float32), jax.nn.relu(dots), precision=HIGHEST)
    if k_scale is not None:
        scores = scores * k_scale[pages].astype(jnp.float32).reshape(rows, max_blocks * page_size)
    cols = jnp.arange(max_blocks * page_size)
    return jnp.where(cols[None, :] < lens[:, None], scores, NEG_INF)


def topk(scores, lens, *, k, sorted=True):
    """Exact per-row top-k over the first lens[r] columns: score descending, then column ascending.

    scores [R, T] f32, lens [R] int32, clipped to [0, T] as the kernel does. Returns values f32 [R, K], indices
    int32 [R, K] (K = k); rows with min(lens[r], T) < k are padded with (-inf, -1). sorted=False: the same entries in
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


def indexer_top_k(q, weights, index_cache, block_tables, lens, *, k, sorted=True):
    """topk of indexer_logits."""
    return topk(indexer_logits(q, weights, index_cache, block_tables, lens), lens, k=k, sorted=sorted)


def sparse_mla_decode(q, kv_cache, slots, counts, sm_scale, *, value_dim=512):
    """Absorbed MLA over compacted physical slots.

    q [R, H, C+E] (latent query then rope query), kv_cache [pages, B, C+E] (latent then roped key) or an
    Fp8LatentCache (dequantized first), slots [R, K] int32 physical slots, valid first, counts [R] int32.
    value_dim = latent width C (512 in DeepSeek). Returns out f32 [R, H, value_dim] (softmax-weighted latents)
    and lse f32 [R, H] (natural log of the sum of exp(scaled scores)); a row with count 0 gives out 0 and
    lse -inf.
    """
    fp8 = isinstance(kv_cache, Fp8LatentCache)
    num_pages, page_size = (kv_cache.latent if fp8 else kv_cache).shape[:2]
    num_slots = slots.shape[1]
    is_valid = jnp.arange(num_slots)[None, :] < counts[:, None]
    slot = jnp.clip(jnp.where(is_valid, slots, 0), 0, num_pages * page_size - 1)
    # The selected tokens only, then in f32: work that follows the selection, not the pool.
    gathered = jax.tree.map(lambda pool: pool[slot // page_size, slot % page_size], kv_cache)
    kv = dequantize_latent_cache(gathered) if fp8 else gathered.astype(jnp.float32)  # [R, K, C+E]
    scores = jnp.einsum("rhd,rsd->rhs", q.astype(jnp.float32), kv, precision=HIGHEST) * sm_scale
    scores = jnp.where(is_valid[:, None, :], scores, NEG_INF)
    lse = jax.nn.logsumexp(scores, axis=-1)
    probs = jnp.where(is_valid[:, None, :], jnp.exp(scores - jnp.where(jnp.isfinite(lse), lse, 0)[..., None]), 0)
    out = jnp.einsum("rhs,rsd->rhd", probs, kv[..., :value_dim], precision=HIGHEST)
    return out, lse


def mla_decode(q, kv_cache, block_tables, lens, sm_scale, *, value_dim=512):
    """Absorbed dense MLA over a sequence's paged local tokens.

    q [M, Y, H, C+E] (latent query then rope query; Y query rows per sequence), kv_cache [pages, B, C+E] (latent
    then roped key) or an Fp8LatentCache (dequantized first), block_tables [M, P] int32 page ids (entries past
    what lens reach are ignored, may be -1), lens [M, Y] int32: row (m, s) attends tokens t < lens[m, s], token t
    at page block_tables[m, t // B], offset t % B. Returns out f32 [M, Y, H, value_dim] (softmax-weighted
    latents) and lse f32 [M, Y, H] (natural log of the sum of exp(scaled scores)); a row with lens 0 gives out 0
    and lse -inf.
    """
    fp8 = isinstance(kv_cache, Fp8LatentCache)
    num_pages, page_size = (kv_cache.latent if fp8 else kv_cache).shape[:2]
    seqs, max_pages = block_tables.shape
    num_tokens = max_pages * page_size
    pages = jnp.clip(block_tables, 0, num_pages - 1)
    gathered = jax.tree.map(lambda pool: pool[pages].reshape(seqs, num_tokens, pool.shape[-1]), kv_cache)
    kv = dequantize_latent_cache(gathered) if fp8 else gathered.astype(jnp.float32)  # [M, T, C+E]
    # Tokens no row of the sequence reaches hold anything (NaN included): zero them so that 0 * them stays 0.
    is_reached = jnp.arange(num_tokens)[None, :] < jnp.max(lens, axis=1, initial=0)[:, None]  # [M, T]
    kv = jnp.where(is_reached[..., None], kv, 0.0)
    scores = jnp.einsum("mshd,mtd->msht", q.astype(jnp.float32), kv, precision=HIGHEST) * sm_scale
    is_valid = (jnp.arange(num_tokens)[None, None, :] < lens[..., None])[:, :, None, :]  # [M, Y, 1, T]
    scores = jnp.where(is_valid, scores, NEG_INF)
    lse = jax.nn.logsumexp(scores, axis=-1)
    probs = jnp.where(is_valid, jnp.exp(scores - jnp.where(jnp.isfinite(lse), lse, 0)[..., None]), 0)
    out = jnp.einsum("msht,mtd->mshd", probs, kv[..., :value_dim], precision=HIGHEST)
    return out, lse


def grouped_matmul(x, w, group_sizes, *, rows_per_group=None):
    """Grouped matmul (an MoE's routed experts): x [rows, in] rows sorted by group, w [groups, in, out],
    group_sizes [groups] int32 (sum <= rows). Rows offset_g .. offset_g + group_sizes[g] - 1 times w[g] (f32), the
    output [rows, out] in x's dtype; rows past the last group unspecified. rows_per_group: the kernels' tile hint,
    no effect here."""
    out = jax.lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), group_sizes, precision=HIGHEST)
    return out.astype(x.dtype)


def grouped_matmul_fp8(x, x_scales, w, w_scales, group_sizes, *, block, out_dtype, rows_per_group=None):
    """`grouped_matmul` of block-fp8 operands (DeepSeek's fine-grained fp8 GEMM), scale blocks block = (bn, bk)
    (HF's weight_block_size): x e4m3 [rows, in] times its scales f32 [rows, ceil(in / bk)] (bk channels of a row
    share one), w e4m3 [groups, out, in] (K-major) times its scales f32 [groups, ceil(out / bn), ceil(in / bk)]
    (a [bn, bk] block shares one); the output [rows, out] = x . w[g]^T in out_dtype. rows_per_group: the kernels'
    tile hint, no effect here."""
    (bn, bk), (width, depth) = block, w.shape[1:]
    x32 = x.astype(jnp.float32) * jnp.repeat(x_scales, bk, axis=1)[:, :depth]
    w32 = w.astype(jnp.float32) * jnp.repeat(jnp.repeat(w_scales, bn, axis=1), bk, axis=2)[:, :width, :depth]
    return grouped_matmul(x32, jnp.swapaxes(w32, 1, 2), group_sizes).astype(out_dtype)


def grouped_matmul_mxfp4(x, w: Mxfp4Weight, group_sizes, *, out_dtype, rows_per_group=None):
    """`grouped_matmul` of MXFP4 weights (OCP microscaling fp4 in AMD Quark's layout, `formats.Mxfp4Weight`): x
    [rows, in] (bf16 or f32) rows sorted by group, w's packed uint8 [groups, out, in / 2] and scales uint8
    [groups, out, in / 32] dequantized (`formats.dequantize_mxfp4`) to f32 [groups, out, in]; the output
    [rows, out] = x . w[g]^T in out_dtype. rows_per_group: the kernels' tile hint, no effect here."""
    w32 = dequantize_mxfp4(w.packed, w.scales, jnp.float32)
    return grouped_matmul(x.astype(jnp.float32), jnp.swapaxes(w32, 1, 2), group_sizes).astype(out_dtype)


def fp8_gemm(x, x_scales, w, w_scales, *, block, out_dtype):
    """DeepSeek's fine-grained fp8 GEMM, scale blocks block = (bn, bk) (HF's weight_block_size): x e4m3 [rows, in]
    times its scales f32 [rows, ceil(in / bk)], w e4m3 [out, in] (K-major, the checkpoint's layout) times its
    scales f32 [ceil(out / bn), ceil(in / bk)]; the output [rows, out] = x . w^T in out_dtype."""
    sizes = jnp.array([x.shape[0]], jnp.int32)
    return grouped_matmul_fp8(x, x_scales, w[None], w_scales[None], sizes, block=block, out_dtype=out_dtype)
