"""Grouped matmul (the routed experts of an MoE layer): the Triton kernel.

Contract (`pallas_kernels.grouped_matmul`): x [rows, in] rows sorted by group, w [groups, in, out] (one matrix a
group, the same dtype as x: bf16 or f32), group_sizes [groups] int32 (sum <= rows): rows offset_g .. offset_g +
group_sizes[g] - 1 (offset_g the sum of the sizes before g) are multiplied by w[g], f32 accumulation, the output
[rows, out] in x's dtype. Rows past the last group are left unspecified (as `jax.lax.ragged_dot` leaves them).
Block fp8 (`pallas_kernels.grouped_matmul_fp8`, DeepSeek's fine-grained fp8 GEMM, scale blocks (bn, bk)): x e4m3
with f32 scales [rows, ceil(in / bk)] (a row's bk channels share one), w e4m3 [groups, out, in] (K-major, as
fp8 tensor cores read both operands) with f32 scales [groups, ceil(out / bn), ceil(in / bk)] (a [bn, bk] block
shares one); each block_k slice (block_k divides bk, block_n divides bn) is one fp8 tensor-core dot whose f32
result is scaled by the row's and the block's scales before it joins the accumulator, as DeepGEMM does. Scale
blocks of bn = 1 (one scale a channel, with bk = in: ptpc_fp8's per-channel weights and per-token activations)
scale each column by its own.

Work items (vLLM's fused-MoE schedule): each group's rows are cut into blocks of block_m; the wrapper lists the
blocks of every group in order (`work_items`, computed in the program from group_sizes: the item's group, first
row and row count), at most ceil(rows / block_m) + groups of them. Grid (items, out / block_n): a program
multiplies its block's rows [block_m, in] by its group's [in, block_n] slice (fp8: [block_n, in]), block_k at a
time, and stores its rows; programs past the last item exit at once. So a group with no rows costs nothing and
each group's weights are read once per block of its rows: at decode (a few rows an expert) the layer reads only the
chosen experts' weights.
Letters: see the legend in `dcp_jax/__init__.py`; the matmul's widths are spelled out (rows, in, out, groups).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._fp8_dot import MIN_IMPRECISE_ACC, fp8_dot_nt
from pallas_kernels._knobs import with_defaults
from pallas_kernels._platform import default_interpret

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*", category=DeprecationWarning)

MIN_DOT_DIM = 16  # smallest dimension (rows, columns or depth) of a Triton tensor-core dot
_BLOCKS = (256, 128, 64, 32, 16)  # block_n / block_k candidates, largest first
# Groups averaging at least this many rows take the prefill tiles (`default_knobs`). On an H100 at DeepSeek-V3.2's
# experts (docs/performance.md, "One MoE layer: the grouped matmul kernels"), bf16: 128 x 256 tiles, 8 warps, 4 stages
# ran prefill 4K / 16K in 0.74x / 0.69x the time of 64 x 128 tiles with 4 warps and 3 stages, and decode R = 256 (8 rows
# a group) in 0.90x that of 16 x 128 tiles, which stayed faster at R = 64 (2 rows a group). Block fp8 (block_n at most
# its scale block, 128; measured with the weights [in, out], before they were stored K-major): 128 x 128, 8 warps,
# 4 stages ran prefill (128 and 512 rows a group) in 0.78x-0.89x but decode R = 256 in 3.5x, so fp8 keeps the old
# boundary, past 16 rows a group. f32 keeps the old 64 x 128 tiles (128 x 256 f32 stages would not fit in shared
# memory).
PREFILL_ROWS_PER_GROUP = {"plain": 8, "fp8": 17}


def work_items(group_sizes, num_rows: int, block_m: int):
    """(group [items], first row [items], rows [items]) int32 of each block of block_m rows of each group, in group
    order, items = ceil(num_rows / block_m) + groups (the most there can be); items past the last block have 0
    rows."""
    num_groups = group_sizes.shape[0]
    max_items = pl.cdiv(num_rows, block_m) + num_groups
    sizes = group_sizes.astype(jnp.int32)
    blocks = (sizes + block_m - 1) // block_m  # [groups]
    last_block = jnp.cumsum(blocks)  # [groups]: items before group g + its own
    item = jnp.arange(max_items, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(last_block, item, side="right"), num_groups - 1).astype(jnp.int32)
    within = item - (last_block[group] - blocks[group])  # the item's block index within its group
    offsets = jnp.cumsum(sizes) - sizes
    rows = jnp.clip(sizes[group] - within * block_m, 0, block_m)
    rows = jnp.where(item < last_block[-1], rows, 0)
    return group, offsets[group] + within * block_m, rows


@dataclasses.dataclass(frozen=True)
class RowBlock:
    """A program's work item (`work_items`): its group, its first row, which of its block_m rows it has, and its
    block_n output columns."""

    group: jax.Array
    start: jax.Array
    is_row: jax.Array
    columns: pl.Slice


def multiply_row_block(groups_ref, starts_ref, rows_ref, out_ref, *, block_m: int, block_n: int, steps: int, step):
    """The body every grouped kernel shares: program (item, n_block) of the grid (items, out / block_n) with rows
    to multiply sums `step(k, acc [block_m, block_n] f32, block: RowBlock)` over k < steps and stores its rows;
    one without rows does nothing."""
    item, n_block = pl.program_id(0), pl.program_id(1)
    num_rows = rows_ref[item]

    @pl.when(num_rows > 0)
    def _multiply():
        block = RowBlock(groups_ref[item], starts_ref[item], lax.iota(jnp.int32, block_m) < num_rows,
                         pl.ds(n_block * block_n, block_n))
        acc = lax.fori_loop(0, steps, lambda k, acc: step(k, acc, block), jnp.zeros((block_m, block_n), jnp.float32))
        plgpu.store(out_ref.at[pl.ds(block.start, block_m), block.columns], acc.astype(out_ref.dtype),
                    mask=jnp.broadcast_to(block.is_row[:, None], (block_m, block_n)))


def _kernel(groups_ref, starts_ref, rows_ref, x_ref, w_ref, x_scales_ref, w_scales_ref, out_ref, *, block_m: int,
            block_n: int, block_k: int, scale_block: tuple[int, int] | None, precision, fp8_imprecise_acc: int):
    def step(k, acc, block: RowBlock):
        group, start, is_row, columns = block.group, block.start, block.is_row, block.columns
        depth = pl.ds(pl.multiple_of(k * block_k, block_k), block_k)
        rows = plgpu.load(x_ref.at[pl.ds(start, block_m), depth], other=jnp.zeros((), x_ref.dtype),
                          mask=jnp.broadcast_to(is_row[:, None], (block_m, block_k)))
        if scale_block is None:
            weights = w_ref[group, depth, columns]
            return acc + lax.dot(rows, weights, precision=precision, preferred_element_type=jnp.float32)
        weights = w_ref[group, columns, depth]  # [block_n, block_k], K-major
        products = fp8_dot_nt(rows, weights, max_num_imprecise_acc=fp8_imprecise_acc)  # [block_m, block_n]
        k_block = k * block_k // scale_block[1]
        row_scales = plgpu.load(x_scales_ref.at[pl.ds(start, block_m), k_block], mask=is_row, other=0.0)
        if scale_block[0] == 1:  # one scale a channel (ptpc_fp8)
            column_scales = w_scales_ref[group, columns, k_block]
            return acc + products * (row_scales[:, None] * column_scales[None, :])
        block_scale = w_scales_ref[group, columns.start // scale_block[0], k_block]
        return acc + products * (row_scales[:, None] * block_scale)

    multiply_row_block(groups_ref, starts_ref, rows_ref, out_ref, block_m=block_m, block_n=block_n,
                       steps=x_ref.shape[1] // block_k, step=step)


def _largest_block(dim: int, at_most: int) -> int | None:
    return next((b for b in _BLOCKS if b <= at_most and dim % b == 0), None)


def unsupported(x, w) -> list[str]:
    """Why this kernel does not take these inputs (empty: it does)."""
    reasons = []
    if x.dtype != w.dtype or jnp.dtype(x.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        reasons.append(f"it needs x and w of one dtype, bf16 or f32; got {x.dtype} and {w.dtype}")
    if _largest_block(w.shape[1], 128) is None or _largest_block(w.shape[2], 128) is None:
        reasons.append(f"it needs K and N multiples of {MIN_DOT_DIM}; got w {w.shape}")
    return reasons


def unsupported_fp8(w, block) -> list[str]:
    """Why this kernel does not take block-fp8 weights w [groups, out, in] of scale blocks `block` = (bn, bk) (empty:
    it does)."""
    width, depth = w.shape[1:]
    if _largest_block(math.gcd(depth, block[1]), 128) is None or \
            _largest_block(_scale_block_width(width, block[0]), 128) is None:
        return [f"it needs K, N and the scale block {tuple(block)} multiples of {MIN_DOT_DIM} (or bn 1: a scale a "
                f"channel); got w {w.shape}"]
    return []


def _scale_block_width(width: int, scale_block_rows: int) -> int:
    """The largest width a block_n may divide: a scale block's rows, or any (the width) with one scale a channel."""
    return width if scale_block_rows == 1 else math.gcd(width, scale_block_rows)


def default_knobs(rows_per_group: float, w, scale_block: tuple[int, int] | None = None) -> dict:
    """The tiles the kernel runs unless told, for groups averaging `rows_per_group` rows times w ([groups, in, out];
    block fp8 [groups, out, in] of scale blocks `scale_block` (bn, bk)), by PREFILL_ROWS_PER_GROUP. block_n and
    block_k: the largest powers of two of at most the table's dividing the out and in widths (and the scale block);
    None where none >= 16 does (the kernel refuses those shapes)."""
    fp8 = scale_block is not None
    width, depth = (w.shape[1], w.shape[2]) if fp8 else (w.shape[2], w.shape[1])
    prefill = rows_per_group >= PREFILL_ROWS_PER_GROUP["fp8" if fp8 else "plain"]
    if fp8:  # (block_m, block_n at most, block_k at most, warps, stages)
        tile = (128, 128, 128, 8, 4) if prefill else (16, 128, 128, 4, 3)
        width, depth = _scale_block_width(width, scale_block[0]), math.gcd(depth, scale_block[1])
    elif not prefill:
        tile = (16, 128, 64, 4, 3)
    else:
        tile = (128, 256, 64, 8, 4) if jnp.dtype(w.dtype).itemsize == 2 else (64, 128, 64, 4, 3)
    block_m, most_n, most_k, num_warps, num_stages = tile
    return dict(block_m=block_m, block_n=_largest_block(width, most_n), block_k=_largest_block(depth, most_k),
                num_warps=num_warps, num_stages=num_stages)


def grouped_matmul(x, w, group_sizes, *, rows_per_group=None, interpret=None, **knobs):
    """The contract of the module docstring; rows_per_group picks the default tiles (`pallas_kernels.
    grouped_matmul`; None: rows / groups). Knobs (left out or None: `default_knobs`'): block_m rows a block, block_n
    and block_k (powers of two >= 16 dividing the out and in widths), num_warps and num_stages for Triton."""
    rows_per_group = x.shape[0] / w.shape[0] if rows_per_group is None else rows_per_group
    return _grouped(x, w, group_sizes, None, None, None, x.dtype, interpret=interpret,
                    fp8_imprecise_acc=MIN_IMPRECISE_ACC,
                    **with_defaults(default_knobs(rows_per_group, w), knobs, "grouped matmul"))


def grouped_matmul_fp8(x, x_scales, w, w_scales, group_sizes, *, block, out_dtype, rows_per_group=None,
                       interpret=None, fp8_imprecise_acc=128, **knobs):
    """The block-fp8 contract of the module docstring, scale blocks `block` = (bn, bk) (edge blocks partial).
    rows_per_group and knobs as `grouped_matmul`'s (block_k must divide bk and in, block_n bn and out), and
    fp8_imprecise_acc (>= 32: products accumulated in the tensor core's reduced-precision accumulator,
    `_fp8_dot`)."""
    block = tuple(block)
    rows_per_group = x.shape[0] / w.shape[0] if rows_per_group is None else rows_per_group
    return _grouped(x, w, group_sizes, x_scales, w_scales, block, out_dtype, interpret=interpret,
                    fp8_imprecise_acc=fp8_imprecise_acc,
                    **with_defaults(default_knobs(rows_per_group, w, block), knobs, "grouped matmul"))


def _grouped(x, w, group_sizes, x_scales, w_scales, scale_block, out_dtype, *, interpret, block_m, block_n,
             block_k, num_warps, num_stages, fp8_imprecise_acc):
    interpret = default_interpret(interpret)
    num_rows, depth = x.shape
    width = w.shape[2] if scale_block is None else w.shape[1]
    if any(b is None or b < MIN_DOT_DIM or b & (b - 1) for b in (block_m, block_n, block_k)) or width % block_n or \
            depth % block_k:
        raise ValueError(f"need powers of two >= {MIN_DOT_DIM}, block_n dividing N and block_k dividing K; got "
                         f"{block_m=} {block_n=} {block_k=} for {x.shape=} {w.shape=}")
    if scale_block is not None and (scale_block[1] % block_k or scale_block[0] % block_n and scale_block[0] != 1):
        raise ValueError(f"the blocks must divide the scale blocks {scale_block}; got {block_k=} {block_n=}")
    groups, starts, rows = work_items(group_sizes, num_rows, block_m)
    # One block of pad rows: a block's row slice never runs past the arrays (masked rows are not read or written).
    padded = jnp.pad(x, ((0, block_m), (0, 0)))
    padded_scales = None if x_scales is None else jnp.pad(x_scales, ((0, block_m), (0, 0)))
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else lax.Precision.DEFAULT
    kernel = functools.partial(_kernel, block_m=block_m, block_n=block_n, block_k=block_k, scale_block=scale_block,
                               precision=precision, fp8_imprecise_acc=fp8_imprecise_acc)
    fp8 = "" if scale_block is None else "_fp8"
    out = pl.pallas_call(
        kernel,
        grid=(groups.shape[0], width // block_n),
        in_specs=[pl.no_block_spec] * 5 + [None if x_scales is None else pl.no_block_spec] * 2,
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct((num_rows + block_m, width), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"grouped_matmul{fp8}_{block_m=}_{block_n=}_{block_k=}",
    )(groups, starts, rows, padded, w, padded_scales, w_scales)
    return out[:num_rows]
