"""Grouped matmul of MXFP4 weights (the routed experts of GLM-5.2-MXFP4, AMD Quark's layout): the Triton kernel.

Contract (`pallas_kernels.grouped_matmul_mxfp4`): x [rows, in] bf16 or f32, rows sorted by group; w an
`Mxfp4Weight`: packed uint8 [groups, out, in / 2] and scales uint8 [groups, out, in / 32] (the format and its
formula: `formats.py`); group_sizes [groups] int32 (sum <= rows). Rows offset_g .. offset_g + group_sizes[g] - 1
(offset_g the sum of the sizes before g) times w[g]^T, f32 accumulation, the output [rows, out] in out_dtype; rows
past the last group unspecified (`jax.lax.ragged_dot`'s contract).

The kernel reads the weights as stored, 0.5 + 1/32 bytes a weight, and dequantizes each [block_n, block_k] tile in
registers: the two nibbles of a byte are split with shifts and masks and joined back into input order (Triton's
join and reshape, `tl.interleave`), each e2m1 code becomes 4x its value in integer arithmetic (0 2 4 6 8 12 16 24:
`(2 + mantissa) << exponent`, twice the mantissa for the subnormal exponent 0), and the scale 2^(code - 127) / 4
is built from its exponent bits (e8m0 code 0, 2^-127, reads as 0: an f32 subnormal; 255 as NaN). The tile then
takes x's dtype, exact for bf16 (e2m1 has one mantissa bit) but for scales near the ends of bf16's range, and
meets x's tile in a tensor-core dot with f32 accumulation (Hopper has no fp4 tensor cores; f32 x: an f32 dot
at HIGHEST precision).
With unpack="split_ptx" (bf16 x, compiled) the nibbles are not joined back: inline PTX turns each 4 bytes of
codes and their 4 scale bytes into the low nibbles' and the high nibbles' bf16 values (a byte pair at a time, as
Marlin-style kernels do: the 3 magnitude bits shifted into a bf16's exponent and mantissa make the e2m1 value
times 2^-126, the subnormal code included, which one bf16x2 multiply by 2^126 makes exact; a second multiplies by
the scale, whose e8m0 byte shifted by 7 is the bf16 2^(code - 127); code 0 reads as 0, 255 as infinity), and x
comes split into its even and odd inputs, so a step is two dots: x_even . low^T + x_odd . high^T.
Work items as `_grouped_matmul_triton`'s (vLLM's fused-MoE schedule, `work_items`): grid (items, out / block_n),
one block of block_m rows of one group a program, block_k inputs a step; a group of no rows reads none of its
weights and each group's weights are read once per block of its rows.
Letters: see the legend in `dcp_jax/__init__.py`; the matmul's widths are spelled out (rows, in, out, groups).
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._grouped_matmul_triton import (MIN_DOT_DIM, PREFILL_ROWS_PER_GROUP, RowBlock, multiply_row_block,
                                                    work_items)
from pallas_kernels._knobs import with_defaults
from pallas_kernels._platform import default_interpret
from pallas_kernels.formats import E8M0_NAN, MX_BLOCK, Mxfp4Weight

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*", category=DeprecationWarning)

_BLOCKS_N = (256, 128, 64, 32, 16)  # block_n candidates, largest first
_BLOCKS_K = (256, 128, 64, 32)  # block_k candidates: whole scale blocks of 32 inputs
_F32_MANTISSA_BITS = 23


def _dequantize_tile(packed, scales, dtype):
    """packed uint8 [n, k / 2], scales uint8 [n, k / 32] -> [n, k] in `dtype`, the formula of `formats.py`."""
    width, half = packed.shape
    # Input 2i is byte i's low nibble, 2i + 1 its high one: join them on a last axis of 2, then merge it.
    codes = jnp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(width, 2 * half).astype(jnp.int32)
    magnitude = codes & 7
    exponent, mantissa = magnitude >> 1, magnitude & 1
    quadruple = jnp.where(exponent == 0, 2 * mantissa, (2 + mantissa) << exponent)  # 4 x e2m1: 0 2 4 6 8 12 16 24
    values = jnp.where(codes >= 8, -quadruple, quadruple).astype(jnp.float32)
    # 2^(code - 127) has the f32 bits code << 23 (code >= 1); the 1/4 undoes the quadrupling, exactly.
    powers = lax.bitcast_convert_type(scales.astype(jnp.int32) << _F32_MANTISSA_BITS, jnp.float32)
    quarter_scales = jnp.where(scales == E8M0_NAN, jnp.float32(jnp.nan), powers * 0.25)  # [n, k / 32]
    blocks = scales.shape[1]
    spread = jnp.broadcast_to(quarter_scales[:, :, None], (width, blocks, MX_BLOCK)).reshape(width, blocks * MX_BLOCK)
    return (values * spread).astype(dtype)


# PTX, per 4 code bytes ($2) and their 4 scale bytes ($3): the low (shift 6, 12) or the high (shift 2, 8) nibbles'
# bf16 values as two bf16x2 ($0, $1), element i from byte i. `prmt` spreads bytes 0, 1 (2, 3) to bits 0 and 16; a
# nibble's 3 magnitude bits go to bits 6-8 of its half (bf16 exponent and mantissa: the value times 2^-126), its
# sign bit to bit 15; 0x7E80 is bf16 2^126; a scale byte << 7 is bf16 2^(code - 127). (Two calls, not one of two
# results: jax 0.11.2's lowering of a multi-result inline asm returns the op, not its results.)
_UNPACK_PTX = """{{
.reg .b32 z, t0, t1, s0, s1, m, g, p, c, nz;
mov.b32 z, 0; mov.b32 c, 0x7E807E80; mov.b32 nz, 0x80008000;
prmt.b32 t0, $2, z, 0x4140; prmt.b32 t1, $2, z, 0x4342;
prmt.b32 s0, $3, z, 0x4140; prmt.b32 s1, $3, z, 0x4342;
shl.b32 s0, s0, 7; shl.b32 s1, s1, 7;
shl.b32 m, t0, {magnitude}; and.b32 m, m, 0x01C001C0; shl.b32 g, t0, {sign}; and.b32 g, g, 0x80008000;
or.b32 p, m, g; fma.rn.bf16x2 p, p, c, nz; fma.rn.bf16x2 $0, p, s0, nz;
shl.b32 m, t1, {magnitude}; and.b32 m, m, 0x01C001C0; shl.b32 g, t1, {sign}; and.b32 g, g, 0x80008000;
or.b32 p, m, g; fma.rn.bf16x2 p, p, c, nz; fma.rn.bf16x2 $1, p, s1, nz;
}}"""


def _unpack_ptx(packed, spread_scales):
    """packed uint8 [n, k / 2] and each byte's scale byte (uint8, same shape) -> (low nibbles, high nibbles) bf16
    [n, k / 2], by `_UNPACK_PTX`."""
    return tuple(plgpu.elementwise_inline_asm(
        _UNPACK_PTX.format(magnitude=magnitude, sign=sign), args=[packed, spread_scales],
        constraints="=r,=r,r,r", pack=4, result_shape_dtypes=[jax.ShapeDtypeStruct(packed.shape, jnp.bfloat16)])[0]
        for magnitude, sign in ((6, 12), (2, 8)))


def _kernel(groups_ref, starts_ref, rows_ref, x_ref, packed_ref, scales_ref, out_ref, *, block_m: int, block_n: int,
            block_k: int, precision, unpack: str):
    """x_ref [rows, in]; with unpack="split_ptx" [2, rows, in / 2] (the even inputs, then the odd ones), bf16."""
    half, blocks = block_k // 2, block_k // MX_BLOCK

    def step(k, acc, block: RowBlock):
        def rows_of(parity, width):  # [block_m, width]: the step's inputs of the block's rows, masked past them
            index = (*parity, pl.ds(block.start, block_m), pl.ds(pl.multiple_of(k * width, width), width))
            return plgpu.load(x_ref.at[index], other=jnp.zeros((), x_ref.dtype),
                              mask=jnp.broadcast_to(block.is_row[:, None], (block_m, width)))

        packed = packed_ref[block.group, block.columns, pl.ds(pl.multiple_of(k * half, half), half)]  # [n, k / 2]
        scales = scales_ref[block.group, block.columns, pl.ds(k * blocks, blocks)]  # [block_n, block_k / 32]
        dims = (((1,), (1,)), ((), ()))
        if unpack == "split_ptx":
            spread = jnp.broadcast_to(scales[:, :, None], (block_n, blocks, MX_BLOCK // 2)).reshape(block_n, half)
            low, high = _unpack_ptx(packed, spread)
            return (acc + lax.dot_general(rows_of((0,), half), low, dims, preferred_element_type=jnp.float32)
                    + lax.dot_general(rows_of((1,), half), high, dims, preferred_element_type=jnp.float32))
        weights = _dequantize_tile(packed, scales, x_ref.dtype)  # [block_n, block_k], K-major
        return acc + lax.dot_general(rows_of((), block_k), weights, dims, precision=precision,
                                     preferred_element_type=jnp.float32)

    multiply_row_block(groups_ref, starts_ref, rows_ref, out_ref, block_m=block_m, block_n=block_n,
                       steps=packed_ref.shape[2] // half, step=step)


def _largest_block(dim: int, candidates: tuple[int, ...], at_most: int) -> int | None:
    return next((b for b in candidates if b <= at_most and dim % b == 0), None)


def unsupported(x, w: Mxfp4Weight) -> list[str]:
    """Why this kernel does not take these inputs (empty: it does); the contract is checked before."""
    _, width, depth = w.shape
    reasons = []
    if depth < MX_BLOCK or _largest_block(depth, _BLOCKS_K, 256) is None:
        reasons.append(f"it needs in a positive multiple of {MX_BLOCK}; got w {w.shape} (groups, out, in)")
    if _largest_block(width, _BLOCKS_N, 256) is None:
        reasons.append(f"it needs out a multiple of {MIN_DOT_DIM}; got w {w.shape} (groups, out, in)")
    return reasons


def default_knobs(rows_per_group: float, x_dtype, w: Mxfp4Weight) -> dict:
    """The tiles the kernel runs unless told, for groups averaging `rows_per_group` rows of `x_dtype` times w: the
    bf16 kernel's measured tiles (`_grouped_matmul_triton.default_knobs`: the same dequantized tile in registers
    and in shared memory), not yet measured for MXFP4. block_n and block_k: the largest candidates of at most the
    tile's dividing out and in (None where none does: the kernel refuses those shapes)."""
    _, width, depth = w.shape
    if rows_per_group < PREFILL_ROWS_PER_GROUP["plain"]:
        tile = (16, 128, 64, 4, 3)  # (block_m, block_n at most, block_k at most, warps, stages)
    elif jnp.dtype(x_dtype).itemsize == 2:
        tile = (128, 256, 64, 8, 4)
    else:
        tile = (64, 128, 64, 4, 3)  # f32: 128 x 256 f32 stages would not fit in shared memory
    block_m, most_n, most_k, num_warps, num_stages = tile
    return dict(block_m=block_m, block_n=_largest_block(width, _BLOCKS_N, most_n),
                block_k=_largest_block(depth, _BLOCKS_K, most_k), num_warps=num_warps, num_stages=num_stages,
                unpack="interleave")


def grouped_matmul_mxfp4(x, w: Mxfp4Weight, group_sizes, *, out_dtype, rows_per_group=None, interpret=None,
                         **knobs):
    """The contract of the module docstring; rows_per_group picks the default tiles (None: rows / groups). Knobs
    (left out or None: `default_knobs`'): block_m rows a block (a power of two >= 16), block_n (a power of two >= 16
    dividing out), block_k (a power of two >= 32 dividing in), num_warps and num_stages for Triton, unpack
    ("interleave": the module docstring's jnp decoding, nibbles joined into input order; "split_ptx": its inline
    PTX, bf16 x on a GPU only)."""
    rows_per_group = x.shape[0] / w.packed.shape[0] if rows_per_group is None else rows_per_group
    knobs = with_defaults(default_knobs(rows_per_group, x.dtype, w), knobs, "grouped matmul mxfp4")
    return _grouped(x, w, group_sizes, out_dtype, interpret=interpret, **knobs)


def _grouped(x, w: Mxfp4Weight, group_sizes, out_dtype, *, interpret, block_m, block_n, block_k, num_warps,
             num_stages, unpack):
    interpret = default_interpret(interpret)
    if unpack not in ("interleave", "split_ptx"):
        raise ValueError(f"unpack must be 'interleave' or 'split_ptx'; got {unpack!r}")
    if unpack == "split_ptx" and (interpret or x.dtype != jnp.bfloat16):
        raise ValueError(f"unpack='split_ptx' is inline PTX for bf16 x, compiled on a GPU; got {x.dtype=}, "
                         f"{interpret=}")
    num_rows = x.shape[0]
    _, width, depth = w.shape
    if any(b is None or b < MIN_DOT_DIM or b & (b - 1) for b in (block_m, block_n, block_k)) or block_k < MX_BLOCK \
            or width % block_n or depth % block_k:
        raise ValueError(f"need powers of two, block_m and block_n >= {MIN_DOT_DIM}, block_n dividing out, block_k "
                         f">= {MX_BLOCK} dividing in; got {block_m=} {block_n=} {block_k=} for {x.shape=} "
                         f"w {w.shape} (groups, out, in)")
    groups, starts, rows = work_items(group_sizes, num_rows, block_m)
    # One block of pad rows: a block's row slice never runs past the arrays (masked rows are not read or written).
    padded = jnp.pad(x, ((0, block_m), (0, 0)))
    if unpack == "split_ptx":  # [2, rows, in / 2]: the even inputs, then the odd ones
        padded = jnp.moveaxis(padded.reshape(padded.shape[0], -1, 2), -1, 0)
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else lax.Precision.DEFAULT
    kernel = functools.partial(_kernel, block_m=block_m, block_n=block_n, block_k=block_k, precision=precision,
                               unpack=unpack)
    out = pl.pallas_call(
        kernel,
        grid=(groups.shape[0], width // block_n),
        in_specs=[pl.no_block_spec] * 6,
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct((num_rows + block_m, width), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"grouped_matmul_mxfp4_{block_m=}_{block_n=}_{block_k=}{'_ptx' if unpack == 'split_ptx' else ''}",
    )(groups, starts, rows, padded, w.packed, w.scales)
    return out[:num_rows]
