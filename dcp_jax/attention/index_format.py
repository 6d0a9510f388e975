"""The two formats of the lightning indexer's key cache (`config.INDEX_CACHE_FORMATS`) and the scores each implies.

- exact: keys in the model dtype, a plain array [..., J]; queries and keys are scored as HF does.
- fp8: `Fp8IndexKeys`, the keys Hadamard-rotated and quantized to float8_e4m3fn [..., J] with one power-of-two f32
  scale per token [...] (`pallas_kernels.quant`): J + 4 bytes a token, 132 B at J = 128. Queries are quantized per
  (row, head), their scales folded into the head weights, and a score is
  `scale[t] * sum_i folded_weights[i] * relu(q8[i] . k8[t])`.
A cache's format is its pytree type, fixed when the pool is allocated, so each program traces exactly one format.
Letters as in `params.py`; B batch, S queries, T keys.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dcp_jax.config import check_index_cache
from pallas_kernels import quant

HIGHEST = jax.lax.Precision.HIGHEST
# Bytes of one token's f32 scale in the fp8 format.
FP8_SCALE_BYTES = 4


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8IndexKeys:
    # [..., J] float8_e4m3fn: the Hadamard-rotated keys divided by their scale.
    keys: jax.Array
    # [...] f32: each token's power-of-two scale (0 for a slot never written: its scores are 0).
    scales: jax.Array


def zeros(shape, index_cache: str, dtype):
    """Zero index keys of `shape` [..., J] in format `index_cache` ('exact': of `dtype`)."""
    check_index_cache(index_cache)
    if index_cache == "fp8":
        return Fp8IndexKeys(jnp.zeros(shape, jnp.float8_e4m3fn), jnp.zeros(shape[:-1], jnp.float32))
    return jnp.zeros(shape, dtype)


def bytes_per_token(index_cache: str, index_head_dim: int, itemsize: int) -> int:
    """Bytes one cached token takes in format `index_cache` (`itemsize`: the model dtype's, used by 'exact')."""
    check_index_cache(index_cache)
    return index_head_dim + FP8_SCALE_BYTES if index_cache == "fp8" else index_head_dim * itemsize


def encode_keys(keys, like):
    """Index keys [..., J] (`projections.index_key`) in the format of `like` (a cache in that format)."""
    if isinstance(like, Fp8IndexKeys):
        return Fp8IndexKeys(*quant.quantize_index_keys(keys))
    return keys


def encode_queries(q, weights, like):
    """Index queries [..., I, J] and head weights [..., I] f32 (`projections.index_weights`) as the format of
    `like` scores them: unchanged (exact) or (q8 e4m3, weights times the query scales) (fp8)."""
    if not isinstance(like, Fp8IndexKeys):
        return q, weights
    lead = q.shape[:-2]
    q8, folded = quant.quantize_index_queries(q.reshape(-1, *q.shape[-2:]), weights.reshape(-1, weights.shape[-1]))
    return q8.reshape(q.shape), folded.reshape(*lead, -1)


def keys_and_scales(cache):
    """(keys, per-token scales or None) of an index cache, as `indexer_logits` takes them (k_cache, k_scale)."""
    if isinstance(cache, Fp8IndexKeys):
        return cache.keys, cache.scales
    return cache, None


def dense_scores(q, weights, keys):
    """q [B, S, I, J] and weights [B, S, I] from `encode_queries`, keys [B, T, J] (or `Fp8IndexKeys` of
    [B, T, J] and [B, T]) -> f32 [B, S, T]: `sum_i weights[i] * relu(q[i] . k[t])`, times scale[t] for fp8 keys,
    accumulated in f32 whatever the dtype (as the decode indexer, reference and kernel, computes it)."""
    if isinstance(keys, Fp8IndexKeys):
        # e4m3 values, and products of two of them, are exact in f32.
        return dense_scores(q.astype(jnp.float32), weights, keys.keys.astype(jnp.float32)) * keys.scales[:, None, :]
    dots = jnp.einsum("bsij,btj->bsit", q, keys, precision=HIGHEST, preferred_element_type=jnp.float32)
    return jnp.einsum("bsi,bsit->bst", weights, jax.nn.relu(dots), precision=HIGHEST,
                      preferred_element_type=jnp.float32)
