"""Rotary position embeddings: default and YaRN frequencies, interleaved (MLA) and half-split (indexer)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from dcp_jax.config import ModelConfig


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def rope_tables(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """(inv_freq f64 [rope_dim/2], attention_factor) for the config's rope type."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    rope = cfg.rope
    if rope.get("rope_type", "default") == "default":
        return 1.0 / pos_freqs, 1.0
    factor = float(rope["factor"])
    original = float(rope.get("original_max_position_embeddings", cfg.max_position_embeddings))
    beta_fast, beta_slow = float(rope.get("beta_fast", 32)), float(rope.get("beta_slow", 1))

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoids a division by zero in the ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1.0 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    else:
        attention_factor = _yarn_mscale(factor)
    return inv_freq, attention_factor


def cos_sin(positions, inv_freq: np.ndarray, attention_factor: float):
    """cos, sin f32 [..., rope_dim/2] at integer positions."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    return jnp.cos(angles) * attention_factor, jnp.sin(angles) * attention_factor


def apply_rope(x, cos, sin, *, interleaved: bool):
    """Rotate x [..., T?, H, E] (cos/sin [..., E/2] broadcast over heads).

    interleaved: pairs (x[2i], x[2i+1]) (MLA); else half-split pairs (x[i], x[i + E/2]) (indexer).
    """
    cos, sin = cos[..., None, :], sin[..., None, :]
    if interleaved:
        even, odd = x[..., 0::2], x[..., 1::2]
        rotated = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
        return rotated.reshape(x.shape).astype(x.dtype)
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1).astype(x.dtype)
