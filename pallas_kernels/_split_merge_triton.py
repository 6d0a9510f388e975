"""The log-sum-exp merge of split-K partial attention results as one Pallas Triton kernel: the contract of
`_lse.merge_splits` (its reference), in one launch where XLA runs three or four small kernels (at small batches
their launch gaps nearly doubled a sparse MLA call: docs/performance.md).

One program merges `block_h` heads and `block_c` columns of one row over the N splits: the lse maximum, the sum of
their exponentials, and each split's output times its weight added in f32. The splits are unrolled, so the compile
grows with N (the sparse MLA kernels' default N is at most 16). Columns split the work so that a single row still
fills many SMs: the defaults (8 x 128, not swept) run 64 programs at B = 1, H = 128, 3.6 us against XLA's four
kernels' 5.6 us (H100, docs/perf_sparse_mla.md, stop 49). Blocks larger than H or C shrink to it; each must be a
power of two dividing it.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._platform import default_interpret

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)


def _merge_kernel(outs_ref, lses_ref, out_ref, lse_ref, *, num_splits: int, block_h: int, block_c: int):
    row, heads = pl.program_id(0), pl.ds(pl.program_id(1) * block_h, block_h)
    columns = pl.ds(pl.program_id(2) * block_c, block_c)
    lses = [lses_ref[row, n, heads] for n in range(num_splits)]
    lse_max = functools.reduce(jnp.maximum, lses)
    lse_max = jnp.where(lse_max > -jnp.inf, lse_max, 0.0)  # every split empty: avoid -inf - -inf = NaN
    weights = [jnp.exp(lse - lse_max) for lse in lses]
    total = functools.reduce(jnp.add, weights)
    inv_total = 1.0 / jnp.where(total > 0, total, 1.0)
    out = functools.reduce(jnp.add, [(weight * inv_total)[:, None] * outs_ref[row, n, heads, columns].astype(
        jnp.float32) for n, weight in enumerate(weights)])
    out_ref[...] = out.astype(out_ref.dtype)

    @pl.when(pl.program_id(2) == 0)
    def _store_lse():
        lse_ref[...] = jnp.log(total) + lse_max


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_h", "block_c", "interpret"))
def merge_splits(outs, lses, *, out_dtype=jnp.float32, block_h: int = 8, block_c: int = 128,
                 interpret: bool | None = None):
    """outs [R, N, H, C] f32 or bf16 (each normalized within its split), lses [R, N, H] f32 (-inf = empty split)
    -> out [R, H, C] in out_dtype and lse [R, H] f32; all splits empty gives out 0 and lse -inf."""
    rows, num_splits, heads, width = outs.shape
    if lses.shape != outs.shape[:3] or lses.dtype != jnp.float32:
        raise ValueError(f"want outs [R, N, H, C] and f32 lses [R, N, H]; got {outs.shape=}, {lses.shape=} "
                         f"{lses.dtype}")
    for name, block, size in (("block_h", block_h, heads), ("block_c", block_c, width)):
        used = min(block, size)
        if used < 1 or used & (used - 1) or size % used:
            raise ValueError(f"{name} must be a power of two dividing {size} (larger shrinks to {size}); got "
                             f"{name}={block}")
    block_h, block_c = min(block_h, heads), min(block_c, width)
    whole = pl.BlockSpec()
    return pl.pallas_call(
        functools.partial(_merge_kernel, num_splits=num_splits, block_h=block_h, block_c=block_c),
        grid=(rows, heads // block_h, width // block_c),
        in_specs=[whole, whole],
        out_specs=[pl.BlockSpec((None, block_h, block_c), lambda r, h, c: (r, h, c)),
                   pl.BlockSpec((None, block_h), lambda r, h, c: (r, h))],
        out_shape=[jax.ShapeDtypeStruct((rows, heads, width), out_dtype),
                   jax.ShapeDtypeStruct((rows, heads), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=default_interpret(interpret),
        name=f"merge_splits_{num_splits=}_{block_h=}_{block_c=}",
    )(outs, lses)
