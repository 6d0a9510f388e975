"""The log-sum-exp merge of split-K partial attention results as one Pallas Triton kernel: the contract of
`_lse.merge_splits` (its reference), in one launch where XLA runs three or four small kernels (at small batches
their launch gaps nearly doubled a sparse MLA call: docs/performance.md).

One program merges `block_h` heads of one row in three passes over the N splits: the lse maximum, the sum of
their exponentials, and each split's output times its weight added into f32 registers. Any N; H a multiple of
block_h (a power of two), C a power of two.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._platform import default_interpret

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)


def _merge_kernel(outs_ref, lses_ref, out_ref, lse_ref, *, num_splits: int, block_h: int):
    row, heads = pl.program_id(0), pl.ds(pl.program_id(1) * block_h, block_h)

    def split_lse(n):
        return lses_ref[row, n, heads]

    lse_max = lax.fori_loop(1, num_splits, lambda n, m: jnp.maximum(m, split_lse(n)), split_lse(0))
    lse_max = jnp.where(lse_max > -jnp.inf, lse_max, 0.0)  # every split empty: avoid -inf - -inf = NaN
    total = lax.fori_loop(0, num_splits, lambda n, t: t + jnp.exp(split_lse(n) - lse_max),
                          jnp.zeros((block_h,), jnp.float32))
    inv_total = 1.0 / jnp.where(total > 0, total, 1.0)

    def accumulate(n, acc):
        weight = jnp.exp(split_lse(n) - lse_max) * inv_total
        return acc + weight[:, None] * outs_ref[row, n, heads, :].astype(jnp.float32)

    out = lax.fori_loop(0, num_splits, accumulate, jnp.zeros((block_h, outs_ref.shape[-1]), jnp.float32))
    out_ref[...] = out.astype(out_ref.dtype)
    lse_ref[...] = jnp.log(total) + lse_max


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_h", "interpret"))
def merge_splits(outs, lses, *, out_dtype=jnp.float32, block_h: int = 16, interpret: bool | None = None):
    """outs [R, N, H, C] f32 or bf16 (each normalized within its split), lses [R, N, H] f32 (-inf = empty split)
    -> out [R, H, C] in out_dtype and lse [R, H] f32; all splits empty gives out 0 and lse -inf."""
    rows, num_splits, heads, width = outs.shape
    if lses.shape != outs.shape[:3] or lses.dtype != jnp.float32:
        raise ValueError(f"want outs [R, N, H, C] and f32 lses [R, N, H]; got {outs.shape=}, {lses.shape=} "
                         f"{lses.dtype}")
    if block_h < 1 or block_h & (block_h - 1) or heads % block_h or width & (width - 1):
        raise ValueError(f"need H a multiple of block_h, a power of two, and C a power of two; got {heads=}, "
                         f"{block_h=}, C={width}")
    whole = pl.BlockSpec()
    return pl.pallas_call(
        functools.partial(_merge_kernel, num_splits=num_splits, block_h=block_h),
        grid=(rows, heads // block_h),
        in_specs=[whole, whole],
        out_specs=[pl.BlockSpec((None, block_h, width), lambda r, h: (r, h, 0)),
                   pl.BlockSpec((None, block_h), lambda r, h: (r, h))],
        out_shape=[jax.ShapeDtypeStruct((rows, heads, width), out_dtype),
                   jax.ShapeDtypeStruct((rows, heads), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=default_interpret(interpret),
        name=f"merge_splits_{num_splits=}_{block_h=}",
    )(outs, lses)
