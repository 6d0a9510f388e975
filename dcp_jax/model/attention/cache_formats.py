"""The formats of the two KV caches of one attention layer, and the math each format implies.

Index-key cache (`config.INDEX_CACHE_FORMATS`):
- exact: keys in the model dtype, a plain array [..., J]; queries and keys are scored as HF does.
- fp8: `Fp8IndexKeys`, the keys Hadamard-rotated and quantized to float8_e4m3fn [..., J] with one power-of-two f32
  scale per token [...] (`pallas_kernels.formats`): J + 4 bytes a token, 132 B at J = 128. Queries are quantized per
  (row, head), their scales folded into the head weights, and a score is
  `scale[t] * sum_i folded_weights[i] * relu(q8[i] . k8[t])`.
Latent cache (`config.LATENT_CACHE_FORMATS`):
- exact: each token's normed latent c then its roped k_pe, [..., C+E] in the pool's dtype (the engine's: f32).
- fp8: `Fp8LatentCache`, FlashMLA's sparse-decode format: c in float8_e4m3fn with one power-of-two f32 scale per
  `formats.LATENT_TILE` (128) columns, k_pe in bf16; C + 4 * C / 128 + 2 * E bytes a token, 656 B for DeepSeek's
  C = 512, E = 64. C must be a multiple of 128. Attention reads it as its dequantized values (exact): the
  reference kernel and prefill compute with them in f32; the GPU kernel rounds the queries and the probabilities to
  bf16 and returns bf16.
A cache's format is its pytree type, fixed when the pool is allocated, so each program traces exactly one format.
Both fp8 caches are passed to the kernels whole, in place of the plain array.
Letters: see the legend in `dcp_jax/__init__.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dcp_jax.config import ModelConfig, check_index_cache, check_latent_cache
from pallas_kernels import formats
from pallas_kernels.formats import Fp8IndexKeys, Fp8LatentCache

HIGHEST = jax.lax.Precision.HIGHEST
# Bytes of one f32 scale (a token's in the index format, a tile's in the latent format) and of one bf16 rope value.
FP8_SCALE_BYTES, FP8_ROPE_BYTES = 4, 2


# ---- the index-key cache ---------------------------------------------------------------------------------------


def zero_index_keys(shape, index_cache: str, dtype):
    """Zero index keys of `shape` [..., J] in format `index_cache` ('exact': of `dtype`)."""
    check_index_cache(index_cache)
    if index_cache == "fp8":
        return Fp8IndexKeys(jnp.zeros(shape, jnp.float8_e4m3fn), jnp.zeros(shape[:-1], jnp.float32))
    return jnp.zeros(shape, dtype)


def index_key_bytes(index_cache: str, index_head_dim: int, itemsize: int) -> int:
    """Bytes one cached token takes in format `index_cache` (`itemsize`: the model dtype's, used by 'exact')."""
    check_index_cache(index_cache)
    return index_head_dim + FP8_SCALE_BYTES if index_cache == "fp8" else index_head_dim * itemsize


def encode_index_keys(keys, like):
    """Index keys [..., J] (`projections.index_key`) in the format of `like` (a cache in that format)."""
    if isinstance(like, Fp8IndexKeys):
        return formats.quantize_index_keys(keys)
    return keys


def encode_index_queries(q, weights, like):
    """Index queries [..., I, J] and head weights [..., I] f32 (`projections.index_weights`) as the format of
    `like` scores them: unchanged (exact) or (q8 e4m3, weights times the query scales) (fp8)."""
    if not isinstance(like, Fp8IndexKeys):
        return q, weights
    lead = q.shape[:-2]
    q8, folded = formats.quantize_index_queries(q.reshape(-1, *q.shape[-2:]), weights.reshape(-1, weights.shape[-1]))
    return q8.reshape(q.shape), folded.reshape(*lead, -1)


def dense_index_scores(q, weights, keys):
    """q [batch, R, I, J] and weights [batch, R, I] from `encode_index_queries`, keys [batch, T, J] (or
    `Fp8IndexKeys` of [batch, T, J] and [batch, T]) -> f32 [batch, R, T]: `sum_i weights[i] * relu(q[i] . k[t])`,
    times scale[t] for fp8 keys, accumulated in f32 whatever the dtype (as the decode indexer, reference and kernel,
    computes it)."""
    if isinstance(keys, Fp8IndexKeys):
        # e4m3 values, and products of two of them, are exact in f32.
        scores = dense_index_scores(q.astype(jnp.float32), weights, keys.keys.astype(jnp.float32))
        return scores * keys.scales[:, None, :]
    dots = jnp.einsum("bsij,btj->bsit", q, keys, precision=HIGHEST, preferred_element_type=jnp.float32)
    return jnp.einsum("bsi,bsit->bst", weights, jax.nn.relu(dots), precision=HIGHEST,
                      preferred_element_type=jnp.float32)


# ---- the latent cache ------------------------------------------------------------------------------------------


def check_latent_format(latent_cache: str, cfg: ModelConfig) -> None:
    """Refuse an unknown format, or the fp8 format for a latent width it cannot tile."""
    check_latent_cache(latent_cache)
    if latent_cache == "fp8" and cfg.kv_lora_rank % formats.LATENT_TILE:
        raise ValueError(f"latent_cache='fp8' needs kv_lora_rank a multiple of {formats.LATENT_TILE}; this model's "
                         f"is {cfg.kv_lora_rank}")


def zero_latents(leading_shape, cfg: ModelConfig, latent_cache: str, dtype):
    """Zero latents [*leading_shape, C+E] in format `latent_cache` ('exact': of `dtype`)."""
    check_latent_format(latent_cache, cfg)
    if latent_cache == "fp8":
        return Fp8LatentCache(jnp.zeros((*leading_shape, cfg.kv_lora_rank), jnp.float8_e4m3fn),
                              jnp.zeros((*leading_shape, cfg.kv_lora_rank // formats.LATENT_TILE), jnp.float32),
                              jnp.zeros((*leading_shape, cfg.qk_rope_head_dim), jnp.bfloat16))
    return jnp.zeros((*leading_shape, cfg.latent_dim), dtype)


def latent_bytes(latent_cache: str, cfg: ModelConfig, itemsize: int) -> int:
    """Bytes one cached token takes in format `latent_cache` (`itemsize`: the model dtype's, used by 'exact')."""
    check_latent_cache(latent_cache)
    if latent_cache == "fp8":
        scales = cfg.kv_lora_rank // formats.LATENT_TILE
        return cfg.kv_lora_rank + FP8_SCALE_BYTES * scales + FP8_ROPE_BYTES * cfg.qk_rope_head_dim
    return cfg.latent_dim * itemsize


def encode_latents(latents, like):
    """Latents [..., C+E] (`projections.mla_latent`) as a cache like `like` stores them: in its format, or in its
    dtype."""
    if isinstance(like, Fp8LatentCache):
        return formats.quantize_latent_cache(latents, value_dim=like.latent.shape[-1])
    return latents.astype(like.dtype)


def latent_values(cache):
    """The latents [..., C+E] a cache holds, as attention reads them: dequantized to f32 for an fp8 cache
    (exact)."""
    if isinstance(cache, Fp8LatentCache):
        return formats.dequantize_latent_cache(cache)
    return cache


def cast_query(q, cache):
    """Absorbed queries as sparse MLA takes them for this cache: in its dtype, or unchanged for an fp8 cache
    (whose kernel rounds them to bf16 where it multiplies; the reference keeps them)."""
    return q if isinstance(cache, Fp8LatentCache) else q.astype(cache.dtype)


def leading_shape(cache) -> tuple[int, ...]:
    """The shape of a cache (either one, in either format) without its last (column) axis."""
    return jax.tree.leaves(cache)[0].shape[:-1]
