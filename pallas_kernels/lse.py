"""Log-sum-exp merge of partial attention results (split-K parts of a kernel, or DCP ranks)."""

import jax.numpy as jnp


def lse_merge_weights(lses, axis: int):
    """Weights of each part in the merged softmax, and the merged lse.

    lses: natural-log partial sums, parts along `axis` (-inf = empty part). Returns (weights, same shape as
    lses: exp(lse_i - lse), 0 for empty parts; lse, `axis` removed: -inf when every part is empty). The merged
    output is sum_i weights_i * out_i.
    """
    lse_max = jnp.max(lses, axis=axis, keepdims=True)
    lse_max = jnp.where(jnp.isfinite(lse_max), lse_max, 0.0)  # all parts empty: avoid -inf - -inf = NaN
    scaled = jnp.exp(lses - lse_max)
    total = jnp.sum(scaled, axis=axis, keepdims=True)
    weights = scaled / jnp.where(total > 0, total, 1.0)
    return weights, jnp.squeeze(jnp.log(total) + lse_max, axis=axis)
