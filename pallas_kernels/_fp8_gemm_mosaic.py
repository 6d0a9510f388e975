"""Block-fp8 GEMM for Hopper (sm_90) in Mosaic GPU: the kernel of `pallas_kernels.fp8_gemm` (DeepSeek's
fine-grained fp8 GEMM, as DeepGEMM runs it).

Contract: x e4m3 [rows, in] with f32 scales [rows, in / 128] (a row's 128 channels share one), w e4m3 [out, in]
(K-major: the checkpoint's layout, as fp8 tensor cores read both operands) with f32 scales
[ceil(out / bn), in / 128] (a block of bn rows by 128 columns shares one); the output [rows, out] = sum over the
blocks b of 128 input columns of (x_b . w_b^T) * x_scale * w_scale, in out_dtype. Scale blocks of the whole in
width (ptpc_fp8's one scale a token and a channel: x_scales [rows, 1], w_scales [ceil(out / bn), 1]) scale the
sum once, in the epilogue.

Each CTA owns a [cta_m, cta_n] output tile and runs three warpgroups: one streams the tile's x and w slices of 128
channels (and their scales) through `stages` SMEM buffers by TMA; two compute, each a [64, tile_n] half of the tile
(split along the rows, or along the columns when the tile has 64 rows): per slice one fp8 wgmma into a fresh
accumulator, whose f32 result is scaled by its rows' and columns' scales and added to the running sum in registers
(DeepGEMM's promotion: the tensor core's reduced-precision fp8 accumulation never spans more than one block). With
overlap_promotion (the default wherever a warpgroup's columns lie in one w scale block) a step's product is scaled
and added while the next step's wgmma runs, by one factor a row: the row's scale times the warpgroup's one w
scale, a scalar read from w's compact scales in GMEM. Without it the w scales travel expanded to one per column
([in / 128, out], made by the wrapper each call) and each step loads two scale vectors. Tiles run in bands of
grid_tile_width along the rows, each band walked along the columns, so the CTAs at work share both x's rows and w's
columns in L2. With persistent, one CTA a SM loops over the tiles in that order, each tile's store overlapping the
next one's loads. The tile leaves through SMEM by TMA in out_dtype; the wrapper pads the rows to the tile.
Mosaic GPU has no interpreter: this runs compiled on an sm_90 GPU; on CPU it can be lowered for CUDA (the tests do).
Letters: see the legend in `dcp_jax/__init__.py`; the GEMM's widths are spelled out (rows, in, out).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._knobs import with_defaults
from pallas_kernels._platform import on_hopper_compiled

BLOCK_K = 128  # channels a step: one scale block, one 128-byte swizzled fp8 row
WG_ROWS = 64  # rows of one compute warpgroup's wgmma
TILE_N = (128, 64)  # a compute warpgroup's columns, largest first
HOPPER_SMS = 132  # the H100's and the H200's (SXM): CTAs of one wave, one a SM (the pipeline fills its SMEM)
K_SPLITS = (8, 4, 2)  # split-K factors the default tries, largest first
GRID_TILE_WIDTH = 8  # row tiles a band of the tile order (`_kernel`)
_MEMORY_REGISTERS = 40  # the TMA warpgroup's (JAX's Hopper matmul example's value; the knobs are not yet tuned)


def _cta_tile(split_m: bool, tile_n: int) -> tuple[int, int]:
    """A CTA's output tile [rows, columns]: two warpgroups' [64, tile_n] halves, side by side along the rows or the
    columns."""
    return (2 * WG_ROWS, tile_n) if split_m else (WG_ROWS, 2 * tile_n)


def _fp8_tiled():
    return plgpu.TilingTransform((8, BLOCK_K)), plgpu.SwizzleTransform(BLOCK_K)


def _kernel(x_gmem, xs_gmem, w_gmem, ws_gmem, out_gmem, out_smem, *, tile_n: int, split_m: bool, stages: int,
            k_splits: int, overlap_promotion: bool, persistent: bool, grid_tile_width: int, scale_block_rows: int):
    wg = lax.axis_index("wg")
    steps = x_gmem.shape[1] // BLOCK_K // k_splits  # a tile's share of the input columns, in steps of 128
    # One scale a row and a column along the whole input width (per token, per channel: ptpc_fp8): applied once,
    # in the epilogue.
    per_channel = xs_gmem.shape[0] == 1
    cta_m, cta_n = _cta_tile(split_m, tile_n)
    wg_rows = pl.ds(wg * WG_ROWS, WG_ROWS) if split_m else pl.ds(0, WG_ROWS)
    wg_columns = pl.ds(0, tile_n) if split_m else pl.ds(wg * tile_n, tile_n)
    row_layout, column_layout = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)

    def wgmma(partial_ref, x_smem, w_smem):
        plgpu.wgmma(partial_ref, x_smem.at[wg_rows], w_smem.at[wg_columns].transpose((1, 0)))

    def step(_, x_smem, w_smem, xs_smem, ws_smem, acc):
        def dot(partial_ref):
            wgmma(partial_ref, x_smem, w_smem)
            return partial_ref[...]

        partial = pl.run_scoped(dot, plgpu.ACC((WG_ROWS, tile_n), jnp.float32))
        row_scales = plgpu.load(xs_smem.at[0, wg_rows], layout=row_layout)
        column_scales = plgpu.load(ws_smem.at[0, wg_columns], layout=column_layout)
        scales = (lax.broadcast_in_dim(row_scales, (WG_ROWS, tile_n), [0])
                  * lax.broadcast_in_dim(column_scales, (WG_ROWS, tile_n), [1]))
        return acc + partial * scales

    def unscaled_step(_, x_smem, w_smem, acc):
        # Per channel: each step's product joins the f32 sum as it is (the tensor core's reduced-precision
        # accumulation still spans one step); the epilogue scales the sum.
        def dot(partial_ref):
            wgmma(partial_ref, x_smem, w_smem)
            return partial_ref[...]

        return acc + pl.run_scoped(dot, plgpu.ACC((WG_ROWS, tile_n), jnp.float32))

    def promoted(acc, pending, row_factors):
        return acc + pending * lax.broadcast_in_dim(row_factors, (WG_ROWS, tile_n), [0])

    def overlapped_step(scale_block, k, x_smem, w_smem, xs_smem, carry):
        # The previous step's product is scaled and added while this step's wgmma runs. The warpgroup's columns lie
        # in one scale block (the wrapper checks): one scale, read from w's compact scales in GMEM, scales them all.
        acc, pending, row_factors = carry

        def dot(partial_ref):
            wgmma(partial_ref, x_smem, w_smem)
            return promoted(acc, pending, row_factors), partial_ref[...]

        acc, pending = pl.run_scoped(dot, plgpu.ACC((WG_ROWS, tile_n), jnp.float32))
        row_scales = plgpu.load(xs_smem.at[0, wg_rows], layout=row_layout)
        return acc, pending, row_scales * ws_gmem[scale_block, k]

    def accumulate(run_pipeline):
        zeros = plgpu.layout_cast(jnp.zeros((WG_ROWS, tile_n), jnp.float32), plgpu.Layout.WGMMA)
        if overlap_promotion:
            no_factors = plgpu.layout_cast(jnp.zeros((WG_ROWS,), jnp.float32), row_layout)
            return promoted(*run_pipeline((zeros, zeros, no_factors)))
        return run_pipeline(zeros)

    def pipeline(body, compute_context):
        in_specs = [plgpu.BlockSpec((cta_m, BLOCK_K), lambda k: (0, k), transforms=_fp8_tiled()),
                    plgpu.BlockSpec((cta_n, BLOCK_K), lambda k: (0, k), transforms=_fp8_tiled())]
        if not per_channel:  # x's scales, and the expanded column scales unless overlap_promotion, travel with
            in_specs += [plgpu.BlockSpec((1, cta_m), lambda k: (k, 0)),  # the step's operands
                         *([] if overlap_promotion else [plgpu.BlockSpec((1, cta_n), lambda k: (k, 0))])]
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(steps,),
            memory_registers=_MEMORY_REGISTERS,
            in_specs=in_specs,
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=stages,
            compute_context=compute_context,
        )

    def operands(rows, columns, depth, depth_blocks):
        """The pipeline's GMEM operands for a tile: x, w and (unless per_channel, whose scales the epilogue reads)
        x's scales, and unless overlap_promotion (which reads w's compact scales itself) the expanded column
        scales."""
        refs = [x_gmem.at[rows, depth], w_gmem.at[columns, depth]]
        if per_channel:
            return refs
        refs.append(xs_gmem.at[depth_blocks, rows])
        return refs if overlap_promotion else refs + [ws_gmem.at[depth_blocks, columns]]

    def tile(m, n, part, allocations=None):
        """Output tile (m, n) over the part-th k_splits-th of the input columns. Persistent, its store is left in
        flight (the next tile's loads overlap it) and waited for before this warpgroup writes its SMEM again."""
        rows, columns = pl.ds(m * cta_m, cta_m), pl.ds(n * cta_n, cta_n)
        depth, depth_blocks = pl.ds(part * steps * BLOCK_K, steps * BLOCK_K), pl.ds(part * steps, steps)

        def compute(run_pipeline):
            acc = accumulate(run_pipeline)
            if per_channel:  # the one scale of each row and column, once
                row_scales = plgpu.load(xs_gmem.at[0, rows].at[wg_rows], layout=row_layout,
                                        optimized=False)  # no optimized GMEM load of a reduced WGMMA layout
                column_scales = plgpu.load(ws_gmem.at[0, columns].at[wg_columns], layout=column_layout,
                                           optimized=False)
                acc = (acc * lax.broadcast_in_dim(row_scales, (WG_ROWS, tile_n), [0])
                       * lax.broadcast_in_dim(column_scales, (WG_ROWS, tile_n), [1]))
            if persistent:
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            out_smem[wg] = acc.astype(out_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[part].at[rows, columns].at[wg_rows, wg_columns])
            if not persistent:
                plgpu.wait_smem_to_gmem(0)

        def overlapped_body(indices, *refs):
            scale_block = lax.div(n * cta_n + wg_columns.start, scale_block_rows)
            return overlapped_step(scale_block, part * steps + indices[0], *refs)

        body = overlapped_body if overlap_promotion else unscaled_step if per_channel else step
        pipeline(body, compute)(
            *operands(rows, columns, depth, depth_blocks), allocations=allocations)

    tiles = (out_gmem.shape[1] // cta_m, out_gmem.shape[2] // cta_n)

    def ordered_tile(index, part, allocations=None):
        # Bands of grid_tile_width tiles along the rows, each walked along the columns: the CTAs running at once
        # share x's rows and w's columns in L2 (x read once per wave's column span, not once per column tile).
        m, n = plgpu.planar_snake(index, tiles, 0, grid_tile_width)
        tile(m, n, part, allocations)

    if not persistent:
        ordered_tile(lax.axis_index("tile"), lax.axis_index("k"))
        return
    first_tile = operands(pl.ds(0, cta_m), pl.ds(0, cta_n), pl.ds(0, steps * BLOCK_K), pl.ds(0, steps))
    allocations = pipeline(lambda *_: None, lambda *_: None).get_allocations(*first_tile)

    @functools.partial(pl.run_scoped, allocations=allocations, collective_axes="wg")
    def _(allocations):
        @plgpu.nd_loop((k_splits, tiles[0] * tiles[1]), collective_axes="sm")
        def _(loop):
            part, index = loop.index
            ordered_tile(index, part, allocations)

    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("tile_n", "split_m", "stages", "k_splits", "overlap_promotion",
                                             "persistent", "grid_tile_width", "scale_block_rows", "out_dtype"))
def fp8_gemm_tiles(x, xs_t, w, w_scales, *, tile_n: int, split_m: bool, stages: int, k_splits: int,
                   overlap_promotion: bool, persistent: bool, grid_tile_width: int, scale_block_rows: int, out_dtype):
    """The kernel on prepared inputs: x e4m3 [rows, in] (rows a multiple of the CTA's rows), xs_t f32
    [in / 128, rows] (x's scales transposed), w e4m3 [out, in] (out a multiple of the CTA's columns), w_scales f32:
    with overlap_promotion w's compact block scales [ceil(out / scale_block_rows), in / 128] (tile_n dividing
    scale_block_rows), else expanded to one per column, [in / 128, out]. Scales of one block along the whole input
    width (per token and per channel) come as one row each, xs_t [1, rows] and w_scales [1, out], applied once to
    the sum (no overlap_promotion). Returns [k_splits, rows, out] in
    out_dtype: the products over each k_splits-th of the input columns (in / 128 a multiple of k_splits), whose sum
    is x . w^T."""
    num_rows, depth = x.shape
    width = w.shape[0]
    cta_m, cta_n = _cta_tile(split_m, tile_n)
    out_swizzle = min(128, tile_n * jnp.dtype(out_dtype).itemsize)
    out_transforms = (plgpu.TilingTransform((8, out_swizzle // jnp.dtype(out_dtype).itemsize)),
                      plgpu.SwizzleTransform(out_swizzle))

    def fp8_gemm_mosaic(*refs):  # the kernel's name in profiles
        _kernel(*refs, tile_n=tile_n, split_m=split_m, stages=stages, k_splits=k_splits,
                overlap_promotion=overlap_promotion, persistent=persistent, grid_tile_width=grid_tile_width,
                scale_block_rows=scale_block_rows)

    return plgpu.kernel(
        fp8_gemm_mosaic,
        out_type=jax.ShapeDtypeStruct((k_splits, num_rows, width), out_dtype),
        scratch_types=[plgpu.SMEM((2, WG_ROWS, tile_n), out_dtype, transforms=out_transforms)],
        **(dict(grid=(HOPPER_SMS,), grid_names=("sm",)) if persistent
           else dict(grid=(num_rows // cta_m * (width // cta_n), k_splits), grid_names=("tile", "k"))),
        num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(x, xs_t, w, w_scales)


def _fitting_tile_ns(width: int, split_m: bool) -> list[int]:
    """The tile_ns of TILE_N (largest first) whose CTA tile divides the out width."""
    return [t for t in TILE_N if width % _cta_tile(split_m, t)[1] == 0]


def _tile_n(width: int, split_m: bool) -> int | None:
    return next(iter(_fitting_tile_ns(width, split_m)), None)


def _tiles(num_rows: int, width: int, split_m: bool, tile_n: int) -> int:
    cta_m, cta_n = _cta_tile(split_m, tile_n)
    return -(-num_rows // cta_m) * -(-width // cta_n)


def _k_splits(tiles: int, depth: int) -> int:
    """The largest of K_SPLITS that divides depth / 128 (depth: the in width) and keeps `tiles` x it CTAs within
    one wave, else 1."""
    return next((k for k in K_SPLITS if (depth // BLOCK_K) % k == 0 and tiles * k <= HOPPER_SMS), 1)


def _wave_fill(ctas: int) -> float:
    """The share of the SMs' CTA slots that `ctas` CTAs fill over the waves they take."""
    return ctas / (-(-ctas // HOPPER_SMS) * HOPPER_SMS)


def _decode_tile_n(num_rows: int, width: int, depth: int, k_splits: int | None) -> int | None:
    """[64, 2 tile_n] tiles (rows within one warpgroup): the tile_n of TILE_N whose CTAs (with k_splits, or
    `_k_splits` when None) fill the waves best, then the fewer k_splits, then the larger tile. A decode GEMM
    streams its weights, so a last wave of few CTAs runs at their bandwidth alone (H100, 1 and 64 rows;
    docs/performance.md, "Decode tiles by wave fill"):
    tile_n 64 took 36864 out columns in 112 us against 128's 117 (288 CTAs in 3 waves of 132 SMs against 144 in 2),
    and 2048 in 11.9 us against 12.9 (128 CTAs against 64); 128 kept 18432 (72 CTAs against 144) at 53 us
    against 69."""
    fitting = _fitting_tile_ns(width, split_m=False)
    if not fitting:
        return None

    def rank(tile_n):
        tiles = _tiles(num_rows, width, False, tile_n)
        splits = k_splits or _k_splits(tiles, depth)
        return -_wave_fill(tiles * splits), splits, -tile_n

    return min(fitting, key=rank)


def default_knobs(num_rows: int, width: int, depth: int, out_dtype, *, split_m: bool | None = None,
                  tile_n: int | None = None, k_splits: int | None = None, scale_block_rows: int | None = None) -> dict:
    """The knobs for num_rows rows, width out columns and depth in columns, each one given (not None) kept: two
    warpgroups split a [128, tile_n] tile along the rows, unless the rows fit one warpgroup (decode) and the width
    allows a [64, 2 tile_n] tile; tile_n the largest of TILE_N whose tile divides the width, or for [64, 2 tile_n]
    tiles the one that fills the SMs' waves best (`_decode_tile_n`). k_splits the largest of K_SPLITS that divides
    depth / 128 and keeps the tile's CTAs within one wave of HOPPER_SMS, else 1: a decode's few tiles then stream
    the weights from more SMs.
    4 stages, 3 for a 4-byte output (an f32 output or the f32 partial products of k_splits > 1: its epilogue tile
    takes the fourth's SMEM). overlap_promotion wherever a warpgroup's columns lie in one of w's scale blocks of
    scale_block_rows rows; persistent CTAs where the tiles' CTAs pass one wave; the tile order in bands of
    GRID_TILE_WIDTH tiles along the rows."""
    if split_m is None:
        split_m = num_rows > WG_ROWS or _tile_n(width, split_m=False) is None
    if tile_n is None:
        tile_n = _tile_n(width, split_m) if split_m else _decode_tile_n(num_rows, width, depth, k_splits)
    tiles = _tiles(num_rows, width, split_m, tile_n or TILE_N[-1])
    if k_splits is None:
        k_splits = _k_splits(tiles, depth)
    out_bytes = jnp.dtype(out_dtype).itemsize if k_splits == 1 else 4
    return dict(split_m=split_m, tile_n=tile_n, stages=4 if out_bytes <= 2 else 3, k_splits=k_splits,
                overlap_promotion=bool(scale_block_rows and tile_n and scale_block_rows % tile_n == 0),
                persistent=tiles * k_splits > HOPPER_SMS, grid_tile_width=GRID_TILE_WIDTH)


def unsupported(x, w, block, interpret: bool | None) -> list[str]:
    """Why this kernel does not take these inputs (empty: it does): e4m3 operands, the in width a multiple of 128
    and the out width of 64, scale blocks `block` = (bn, bk) of bk = 128 (its step) or the whole in width (one
    scale a row and a channel: ptpc_fp8's per-token, per-channel scales), any bn; compiled on an sm_90 GPU."""
    fp8 = jnp.dtype(jnp.float8_e4m3fn)
    reasons = []
    if x.dtype != fp8 or w.dtype != fp8:
        reasons.append(f"it needs e4m3 x and w; got {x.dtype} and {w.dtype}")
    width, depth = w.shape
    if depth % BLOCK_K or width % TILE_N[-1]:
        reasons.append(f"it needs K a multiple of {BLOCK_K} and N of {TILE_N[-1]}; got w {w.shape}")
    if block[1] not in (BLOCK_K, depth):
        reasons.append(f"it needs scale blocks of {BLOCK_K} input columns or of all {depth}; got {tuple(block)}")
    return reasons + on_hopper_compiled(interpret)


def fp8_gemm(x, x_scales, w, w_scales, *, block, out_dtype, interpret=None, **knobs):
    """The contract of the module docstring (`unsupported` lists what it takes). Knobs (left out or None:
    `default_knobs`'): split_m (the two compute warpgroups split the tile along the rows, else along the columns),
    tile_n (a compute warpgroup's columns, of TILE_N), stages (TMA buffers of 128 channels), k_splits (CTAs sharing
    a tile's input columns, each writing its f32 partial product, summed after: more CTAs when the tiles are few, as
    at decode), overlap_promotion (scale and add a step's product while the next step's wgmma runs, with one scale a
    row: tile_n must divide the scale block's bn), persistent (one CTA a SM loops over the tiles, a tile's store
    overlapping the next tile's loads), grid_tile_width (row tiles a band of the tile order, walked along the
    columns; a power of two)."""
    del interpret  # compiled only (`unsupported`)
    num_rows, width = x.shape[0], w.shape[0]
    out_dtype = jnp.dtype(out_dtype)
    if num_rows == 0:
        return jnp.zeros((0, width), out_dtype)
    depth = x.shape[1]
    per_channel = x_scales.shape[1] == 1  # one scale along all of K: the epilogue's (`_kernel`)
    tile_knobs = {name: knobs.get(name) for name in ("split_m", "tile_n", "k_splits")}
    defaults = default_knobs(num_rows, width, depth, out_dtype, **tile_knobs,
                             scale_block_rows=None if per_channel else block[0])
    chosen = with_defaults(defaults, knobs, "fp8 GEMM")
    split_m, tile_n, k_splits = chosen["split_m"], chosen["tile_n"], chosen["k_splits"]
    kernel_out = out_dtype if k_splits == 1 else jnp.dtype(jnp.float32)  # partial products summed after
    if tile_n not in TILE_N or width % _cta_tile(split_m, tile_n)[1]:
        raise ValueError(f"no column tile for N = {width}: {split_m=}, {tile_n=} (of {TILE_N})")
    if chosen["overlap_promotion"] and per_channel:
        raise ValueError("overlap_promotion scales each 128-channel step: scales along the whole K (one a channel) "
                         "apply once, after the sum")
    if chosen["overlap_promotion"] and block[0] % tile_n:
        raise ValueError(f"overlap_promotion needs tile_n to divide the scale block's {block[0]} rows; got {tile_n=}")
    width_of_band = chosen["grid_tile_width"]
    if width_of_band < 1 or width_of_band & (width_of_band - 1):
        raise ValueError(f"grid_tile_width must be a power of two; got {width_of_band}")
    if k_splits < 1 or (depth // BLOCK_K) % k_splits:
        raise ValueError(f"k_splits must divide K / {BLOCK_K} = {depth // BLOCK_K}; got {k_splits}")
    pad = -num_rows % _cta_tile(split_m, tile_n)[0]
    x = jnp.pad(x, ((0, pad), (0, 0)))
    xs_t = jnp.pad(x_scales.astype(jnp.float32), ((0, pad), (0, 0))).T
    w_scales = w_scales.astype(jnp.float32)
    if not chosen["overlap_promotion"]:  # one scale per column, a step's slice loaded with its operands
        w_scales = jnp.repeat(w_scales.T, block[0], axis=1)[:, :width]
    parts = fp8_gemm_tiles(x, xs_t, w, w_scales, **chosen, scale_block_rows=block[0], out_dtype=kernel_out)
    return (parts[0, :num_rows] if k_splits == 1 else parts[:, :num_rows].sum(axis=0)).astype(out_dtype)
