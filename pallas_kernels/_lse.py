"""Log-sum-exp merge of partial attention results (split-K parts of a kernel, or DCP ranks).

Letters: see the legend in `dcp_jax/__init__.py`.
"""

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


def merge_splits(outs, lses, *, out_dtype=jnp.float32):
    """Merge split-K partial results by log-sum-exp.

    outs [R, splits, H, C] f32 or bf16 (each normalized within its split), lses [R, splits, H] f32 (-inf = empty
    split). Returns out [R, H, C] (summed in f32, then in out_dtype) and lse [R, H] f32; all splits empty gives
    out 0 and lse -inf. `_split_merge_triton.merge_splits` is the same merge as one Pallas kernel.
    """
    weights, lse = lse_merge_weights(lses, axis=1)  # [R, splits, H], 0 for empty splits
    # An elementwise product and sum fuse into one reduction (no matmul call, exact f32).
    return (weights[..., None] * outs).sum(axis=1).astype(out_dtype), lse
