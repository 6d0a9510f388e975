"""The fp8 cache formats the kernels take, plain jnp: the lightning indexer's keys and queries as DeepSeek-V3.2
builds them (spec 1.2), and the latent cache of sparse MLA (FlashMLA's). Both caches are registered dataclasses,
passed to their kernels whole in place of a plain array.

Formulas (J = index head dim, a power of two):
- `hadamard(x) = x @ Had_J * J^-0.5` with Had_J the J x J Sylvester Hadamard matrix: orthogonal and symmetric, so
  `hadamard(q) . hadamard(k) == q . k` in exact arithmetic. It spreads outlier channels before quantization.
- `quantize_e4m3_ue8m0(x)`: `scale = 2^ceil(log2(max(amax, 1e-4) / 448))` (ue8m0: a power of two, rounded up
  so `|x| / scale <= 448`, the largest e4m3 value), `x8 = e4m3(x / scale)`; dividing by a power of two is exact.
- Index keys (`Fp8IndexKeys`): one scale per token, `quantize(hadamard(k))`: 128 B fp8 + 4 B f32 = 132 B/token
  at J = 128.
- Index queries: one scale per (row, head), `q8, q_scale = quantize(hadamard(q))`, folded into the head weights.
  The weights are taken exactly as `dcp_jax.model.attention.projections.index_weights` returns them, i.e. with the
  I^-0.5 head scale and the J^-0.5 dot scale already folded in: `w[i] = weights_proj(x)[i] * I^-0.5 * J^-0.5`.
  Since relu(c * a) = c * relu(a) for c > 0,
  `sum_i w[i] * relu(q[i] . k) ~= k_scale * sum_i (w[i] * q_scale[i]) * relu(q8[i] . k8)`,
  which is what `indexer_logits(q8, folded_weights, Fp8IndexKeys(k8, k_scale), ...)` computes; the bf16 path
  passes the same `w` with the unquantized q and k.
- Latent cache (`Fp8LatentCache`, FlashMLA's fp8 sparse-decode format, 656 B/token at C = 512, E = 64): per
  token, the latent's C values in e4m3 with one ue8m0 scale per 128 columns (4 f32), and the roped key's E values
  in bf16, kept as three arrays. An e4m3 value times a power of two is exact in bf16, so dequantizing loses
  nothing.
Letters: see the legend in `dcp_jax/__init__.py`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

E4M3_MAX = 448.0  # largest finite float8_e4m3fn value
AMAX_FLOOR = 1e-4  # keeps all-zero vectors at a finite scale
LATENT_TILE = 128  # latent columns per scale in the fp8 latent cache


def hadamard(x):
    """Normalized Walsh-Hadamard transform of the last dim (a power of two), in f32; orthogonal."""
    n = x.shape[-1]
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard needs a power-of-two last dim, got {x.shape=}")
    y = x.astype(jnp.float32)
    lead = y.shape[:-1]
    half = 1
    while half < n:
        # Butterfly over pairs (i, i + half) inside blocks of 2*half: (a + b, a - b).
        pairs = y.reshape(*lead, n // (2 * half), 2, half)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = jnp.stack([a + b, a - b], axis=-2).reshape(*lead, n)
        half *= 2
    return y * n**-0.5


def kept_e4m3(quantized):
    """e4m3 arrays (any pytree of them) kept as such under jit when jnp code reads them back in the same program:
    XLA's GPU compiler drops an f32 -> e4m3 -> f32 round trip as excess precision (measured on an H100:
    docs/performance.md, "Correct on the GPU"), which would compute with the unrounded values."""
    return jax.lax.optimization_barrier(quantized)


def quantize_e4m3_ue8m0(x, axis=-1):
    """fp8 e4m3 values and power-of-two scales over `axis`.

    Returns (x8 float8_e4m3fn of x's shape, scale f32 of x's shape without `axis`), with
    `x ~= x8 * scale` and `scale = 2^ceil(log2(max(amax, 1e-4) / 448))`.
    """
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
    raw = jnp.maximum(amax, AMAX_FLOOR) / E4M3_MAX
    # raw = mantissa * 2^exponent with mantissa in [0.5, 1): a power of two exactly when mantissa == 0.5.
    mantissa, exponent = jnp.frexp(raw)
    scale = jnp.ldexp(jnp.ones_like(raw), jnp.where(mantissa == 0.5, exponent - 1, exponent))
    x8 = (x / scale).astype(jnp.float8_e4m3fn)
    return x8, jnp.squeeze(scale, axis=axis)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8IndexKeys:
    """The fp8 index-key cache: `keys` [..., J] float8_e4m3fn (the Hadamard-rotated keys divided by their scale),
    `scales` [...] f32 (each token's power-of-two scale; 0 for a slot never written, whose scores are then 0).
    The kernels take it as [pages, B, J] and [pages, B]."""
    keys: jax.Array
    scales: jax.Array


def quantize_index_keys(keys) -> Fp8IndexKeys:
    """keys [..., J] (f32/bf16) -> Fp8IndexKeys of [..., J] e4m3 and [...] f32: Hadamard, then per token."""
    return Fp8IndexKeys(*quantize_e4m3_ue8m0(hadamard(keys), axis=-1))


def dequantize_index_keys(cache: Fp8IndexKeys):
    """Fp8IndexKeys -> f32 [..., J]: the rotated keys (exact: every value is representable)."""
    return cache.keys.astype(jnp.float32) * cache.scales[..., None]


def quantize_index_queries(q, weights):
    """Per-(row, head) fp8 queries with the query scale folded into the head weights.

    q [R, I, J] (f32/bf16, `projections.index_query`), weights [R, I] f32 exactly as
    `projections.index_weights` returns them (`weights_proj(x) * I^-0.5 * J^-0.5`, may be negative; the same
    weights the bf16 indexer takes). Returns (q8 [R, I, J] float8_e4m3fn, folded_weights [R, I] f32 =
    weights * q_scale); no other scale is applied here.
    """
    if q.ndim != 3 or weights.shape != q.shape[:2]:
        raise ValueError(f"need q [R, Hi, Di] and weights [R, Hi], got {q.shape=} {weights.shape=}")
    q8, q_scale = quantize_e4m3_ue8m0(hadamard(q), axis=-1)
    return q8, weights.astype(jnp.float32) * q_scale


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8LatentCache:
    """The fp8 latent cache of sparse MLA: `latent` [..., C] float8_e4m3fn, `scales` [..., C // 128] f32 (powers
    of two), `rope` [..., E] bf16. Token t is latent[t] times its tile scales, then rope[t]. The kernels take it
    as [pages, B, ...]."""
    latent: jax.Array
    scales: jax.Array
    rope: jax.Array


def quantize_latent_cache(kv, value_dim=512) -> Fp8LatentCache:
    """kv [..., C + E] (latent then roped key, f32/bf16) -> Fp8LatentCache, C = value_dim a multiple of 128:
    e4m3 latent with one ue8m0 scale per 128 columns of each token; the roped key rounded to bf16."""
    if value_dim % LATENT_TILE or not 0 < value_dim < kv.shape[-1]:
        raise ValueError(f"value_dim must be a positive multiple of {LATENT_TILE} below the row width "
                         f"{kv.shape[-1]}; got {value_dim}")
    tiles = kv[..., :value_dim].reshape(*kv.shape[:-1], value_dim // LATENT_TILE, LATENT_TILE)
    latent, scales = quantize_e4m3_ue8m0(tiles, axis=-1)
    return Fp8LatentCache(latent.reshape(*kv.shape[:-1], value_dim), scales,
                          kv[..., value_dim:].astype(jnp.bfloat16))


def dequantize_latent_cache(cache: Fp8LatentCache):
    """Fp8LatentCache -> f32 [..., C + E] (exact: every value is representable)."""
    latent = cache.latent.astype(jnp.float32)
    tiles = latent.reshape(*latent.shape[:-1], -1, LATENT_TILE) * cache.scales[..., None]
    return jnp.concatenate([tiles.reshape(latent.shape), cache.rope.astype(jnp.float32)], axis=-1)
