"""The two formats of the MLA latent cache (`config.LATENT_CACHE_FORMATS`).

- exact: each token's normed latent c then its roped k_pe, [..., C+E] in the pool's dtype (the engine's: f32).
- fp8: `quant.Fp8LatentCache`, FlashMLA's sparse-decode format: c in float8_e4m3fn with one power-of-two f32
  scale per `quant.LATENT_TILE` (128) columns, k_pe in bf16; C + 4 * C / 128 + 2 * E bytes a token, 656 B for
  DeepSeek's C = 512, E = 64. C must be a multiple of 128.
A cache's format is its pytree type, fixed when the pool is allocated, so each program traces exactly one format.
Attention reads an fp8 cache as its dequantized values (exact). The reference kernel and prefill compute with them
in f32; the GPU kernel for the format (`pallas_kernels.sparse_mla`) rounds the queries and the probabilities to
bf16 and returns bf16.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dcp_jax.config import ModelConfig, check_latent_cache
from pallas_kernels import quant
from pallas_kernels.quant import Fp8LatentCache

# Bytes of one f32 tile scale and of one bf16 rope value in the fp8 format.
FP8_SCALE_BYTES, FP8_ROPE_BYTES = 4, 2


def check_model(latent_cache: str, cfg: ModelConfig) -> None:
    """Refuse an unknown format, or the fp8 format for a latent width it cannot tile."""
    check_latent_cache(latent_cache)
    if latent_cache == "fp8" and cfg.kv_lora_rank % quant.LATENT_TILE:
        raise ValueError(f"latent_cache='fp8' needs kv_lora_rank a multiple of {quant.LATENT_TILE}; this model's is "
                         f"{cfg.kv_lora_rank}")


def zeros(leading_shape, cfg: ModelConfig, latent_cache: str, dtype):
    """Zero latents [*leading_shape, C+E] in format `latent_cache` ('exact': of `dtype`)."""
    check_model(latent_cache, cfg)
    if latent_cache == "fp8":
        return Fp8LatentCache(jnp.zeros((*leading_shape, cfg.kv_lora_rank), jnp.float8_e4m3fn),
                              jnp.zeros((*leading_shape, cfg.kv_lora_rank // quant.LATENT_TILE), jnp.float32),
                              jnp.zeros((*leading_shape, cfg.qk_rope_head_dim), jnp.bfloat16))
    return jnp.zeros((*leading_shape, cfg.latent_dim), dtype)


def bytes_per_token(latent_cache: str, cfg: ModelConfig, itemsize: int) -> int:
    """Bytes one cached token takes in format `latent_cache` (`itemsize`: the model dtype's, used by 'exact')."""
    check_latent_cache(latent_cache)
    if latent_cache == "fp8":
        scales = cfg.kv_lora_rank // quant.LATENT_TILE
        return cfg.kv_lora_rank + FP8_SCALE_BYTES * scales + FP8_ROPE_BYTES * cfg.qk_rope_head_dim
    return cfg.latent_dim * itemsize


def encode(latents, like):
    """Latents [..., C+E] (`projections.mla_latent`) as a cache like `like` stores them: in its format, or in its
    dtype."""
    if isinstance(like, Fp8LatentCache):
        return quant.quantize_latent_cache(latents, value_dim=like.latent.shape[-1])
    return latents.astype(like.dtype)


def values(cache):
    """The latents [..., C+E] a cache holds, as attention reads them: dequantized to f32 for an fp8 cache
    (exact)."""
    if isinstance(cache, Fp8LatentCache):
        return quant.dequantize_latent_cache(cache)
    return cache


def cast_query(q, cache):
    """Absorbed queries as sparse MLA takes them for this cache: in its dtype, or unchanged for an fp8 cache
    (whose kernel rounds them to bf16 where it multiplies; the reference keeps them)."""
    return q if isinstance(cache, Fp8LatentCache) else q.astype(cache.dtype)


def leading_shape(cache) -> tuple[int, ...]:
    """The shape of a cache without its last (column) axis, in either format."""
    return jax.tree.leaves(cache)[0].shape[:-1]
