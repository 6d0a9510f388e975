"""The log-sum-exp merge of split-K partial attention results as one Pallas Triton kernel: the contract of
`_lse.merge_splits` (its reference), in one launch where XLA runs three or four small kernels (at R = 1 on an H100,
3.6 us against XLA's 5.6: docs/perf_sparse_mla.md, "Small batches: the kernel reads its counts, one Pallas kernel
merges the splits").

One program merges `block_h` heads and `block_c` columns of one row over its splits: the lse maximum, the sum of
their exponentials, and each split's output times its weight added in f32. The splits are unrolled, so the compile
grows with their number (the sparse MLA kernels' default is at most 16 splits). Columns split the work so that a
single row still fills many SMs (`default_blocks`). Blocks larger than H or C shrink to it; each must be a power of
two dividing it.
Letters: see the legend in `dcp_jax/__init__.py`; C is the width of the merged outputs (the latent's, in MLA).
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


_MIN_PROGRAMS = 256  # the grid `default_blocks` shrinks its blocks to reach


def default_blocks(rows: int, heads: int, width: int) -> tuple[int, int]:
    """(block_h, block_c): 8 x 128, or the largest power of two dividing H or C where that is smaller, with the
    columns halved down to 64 and then the heads down to 4 while the grid has fewer than _MIN_PROGRAMS programs.
    Measured at H = 128, C = 512 (H100; docs/perf_sparse_mla.md, "Small batches: the kernel reads its counts, one
    Pallas kernel merges the splits"): R = 1 over 16 splits took 2.40 us with
    4 x 64 (256 programs) and 3.01 with 8 x 128 (64); R = 8 over 8 splits 2.66 with 8 x 128 (512) and 3.71 with
    4 x 64. R = 2 and 3 (8 x 64) were not timed."""
    block_h, block_c = min(8, heads & -heads or 1), min(128, width & -width or 1)

    def programs():
        return rows * (heads // block_h) * (width // block_c)

    while programs() < _MIN_PROGRAMS and block_c > 64:
        block_c //= 2
    while programs() < _MIN_PROGRAMS and block_h > 4:
        block_h //= 2
    return block_h, block_c


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_h", "block_c", "interpret"))
def merge_splits(outs, lses, *, out_dtype=jnp.float32, block_h: int | None = None, block_c: int | None = None,
                 interpret: bool | None = None):
    """outs [R, splits, H, C] f32 or bf16 (each normalized within its split), lses [R, splits, H] f32 (-inf = empty
    split) -> out [R, H, C] in out_dtype and lse [R, H] f32; all splits empty gives out 0 and lse -inf. block_h,
    block_c: heads and columns a program (None: `default_blocks`)."""
    rows, num_splits, heads, width = outs.shape
    if lses.shape != outs.shape[:3] or lses.dtype != jnp.float32:
        raise ValueError(f"want outs [R, N, H, C] and f32 lses [R, N, H]; got {outs.shape=}, {lses.shape=} "
                         f"{lses.dtype}")
    default_h, default_c = default_blocks(rows, heads, width)
    block_h = default_h if block_h is None else block_h
    block_c = default_c if block_c is None else block_c
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
