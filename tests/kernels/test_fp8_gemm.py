"""pallas_kernels.fp8_gemm (DeepSeek's fine-grained fp8 GEMM) against reference.fp8_gemm and against an
independent numpy sum of scaled block products: the Triton kernel (one group of the grouped kernel) interpreted on
CPU; the Mosaic GPU kernel lowered for CUDA on CPU and compiled on a GPU (`gpu` marker)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import _fp8_gemm_mosaic as fp8_gemm_mosaic
from pallas_kernels import reference

FP8 = jnp.float8_e4m3fn


def _block_fp8(rng, rows, cols, block):
    """e4m3 values [rows, cols] and f32 scales [ceil(rows / b0), ceil(cols / b1)] (amax / 448 per block, edge
    blocks partial) of a random normal matrix with blocks of different magnitudes."""
    plain = rng.standard_normal((rows, cols)) * np.exp(rng.standard_normal((rows, cols)))
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    padded = np.zeros((grid[0] * block[0], grid[1] * block[1]))
    padded[:rows, :cols] = np.abs(plain)
    scales = np.maximum(padded.reshape(grid[0], block[0], grid[1], block[1]).max(axis=(1, 3)), 1e-4) / 448
    per_element = np.repeat(np.repeat(scales, block[0], axis=0), block[1], axis=1)[:rows, :cols]
    return jnp.asarray(plain / per_element, FP8), jnp.asarray(scales, jnp.float32)


def _case(seed, rows, width, depth, block):
    rng = np.random.default_rng(seed)
    x, x_scales = _block_fp8(rng, rows, depth, (1, block[1]))
    w, w_scales = _block_fp8(rng, width, depth, block)
    return x, x_scales, w, w_scales


def _numpy_fp8_gemm(x, x_scales, w, w_scales, block):
    """sum over k blocks of (x_k . w_k^T) * x_scale[:, k] * w_scale[n block, k], in float64."""
    bn, bk = block
    x, w = np.asarray(x.astype(jnp.float32), np.float64), np.asarray(w.astype(jnp.float32), np.float64)
    xs, ws = np.asarray(x_scales, np.float64), np.asarray(w_scales, np.float64)
    out = np.zeros((x.shape[0], w.shape[0]))
    for k in range(xs.shape[1]):
        depth = slice(k * bk, (k + 1) * bk)
        column_scales = np.repeat(ws[:, k], bn)[: w.shape[0]]
        out += (x[:, depth] @ w[:, depth].T) * xs[:, k:k + 1] * column_scales[None, :]
    return out


@pytest.mark.parametrize("rows, width, depth, block", [
    (5, 48, 64, (16, 32)),  # non-square blocks
    (33, 40, 80, (16, 32)),  # N and K not multiples of their blocks: partial edge blocks (the reference)
    (1, 64, 128, (32, 64)),
    (0, 32, 32, (16, 16)),  # no rows
    (7, 40, 96, (1, 96)),  # one scale a channel and a token (ptpc_fp8)
], ids=["blocks", "partial-edges", "one-row", "no-rows", "per-channel"])
def test_reference_is_the_sum_of_scaled_block_products(rows, width, depth, block):
    args = _case(1, rows, width, depth, block)
    got = np.asarray(reference.fp8_gemm(*args, block=block, out_dtype=jnp.float32))
    want = _numpy_fp8_gemm(*args, block)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max(initial=1.0))


@pytest.mark.parametrize("rows, width, depth, block", [(5, 48, 64, (16, 32)), (37, 64, 96, (32, 32)),
                                                      (1, 32, 128, (16, 64))],
                         ids=["non-square", "rows-past-a-block", "one-row"])
def test_triton_equals_reference(rows, width, depth, block):
    args = _case(2, rows, width, depth, block)
    got = np.asarray(pallas_kernels.fp8_gemm(*args, block=block, out_dtype=jnp.float32, backend="triton"))
    want = np.asarray(reference.fp8_gemm(*args, block=block, out_dtype=jnp.float32))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("rows, width, depth", [(5, 48, 64), (37, 80, 96)], ids=["decode", "rows-past-a-block"])
def test_triton_takes_one_scale_a_channel_and_a_token(rows, width, depth):
    """ptpc_fp8's scales as scale blocks (1, in): each column scaled by its own channel's scale (N = 80 is no
    multiple of the column tile's scale block, only of the tile)."""
    block = (1, depth)
    args = _case(5, rows, width, depth, block)
    assert pallas_kernels.choose("fp8_gemm", "pallas", *args, block=block, interpret=True) == "triton"
    got = np.asarray(pallas_kernels.fp8_gemm(*args, block=block, out_dtype=jnp.float32, backend="triton"))
    want = _numpy_fp8_gemm(*args, block)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


def test_refuses_malformed_inputs_and_says_why_a_backend_does_not_apply():
    x, x_scales, w, w_scales = _case(3, 4, 32, 64, (16, 32))
    with pytest.raises(ValueError, match="x_scales"):
        pallas_kernels.fp8_gemm(x, x_scales[:, :1], w, w_scales, block=(16, 32), out_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match=r"w \[N, K\]"):
        pallas_kernels.fp8_gemm(x, x_scales, w[:, :32], w_scales, block=(16, 32), out_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="e4m3"):
        pallas_kernels.fp8_gemm(x.astype(jnp.bfloat16), x_scales, w, w_scales, block=(16, 32),
                                out_dtype=jnp.bfloat16)
    reasons = pallas_kernels.unsupported("fp8_gemm", "mosaic", x, x_scales, w, w_scales, block=(16, 32))
    assert any("multiple of 128" in r for r in reasons) and any("sm_90" in r for r in reasons)
    x, x_scales, w, w_scales = _case(3, 4, 128, 256, (1, 64))
    reasons = pallas_kernels.unsupported("fp8_gemm", "mosaic", x, x_scales, w, w_scales, block=(1, 64))
    assert any("scale blocks of 128 input columns or of all 256" in r for r in reasons)


def test_mosaic_knobs_are_checked_before_anything_is_traced():
    """k_splits must divide K / 128; overlap_promotion needs a warpgroup's columns in one scale block; bands are a
    power of two M tiles; unknown knobs are refused; an f32 output or a split K's f32 partial products take 3 stages."""
    x, x_scales, w, w_scales = _case(3, 4, 128, 768, (128, 128))  # K / 128 = 6
    with pytest.raises(ValueError, match="k_splits must divide K / 128 = 6"):
        fp8_gemm_mosaic.fp8_gemm(x, x_scales, w, w_scales, block=(128, 128), out_dtype=jnp.bfloat16, k_splits=4)
    with pytest.raises(ValueError, match="overlap_promotion needs tile_n to divide the scale block's 64 rows"):
        fp8_gemm_mosaic.fp8_gemm(x, x_scales, w, w_scales, block=(64, 128), out_dtype=jnp.bfloat16, tile_n=128,
                                 split_m=True, overlap_promotion=True)
    with pytest.raises(ValueError, match="grid_tile_width must be a power of two; got 3"):
        fp8_gemm_mosaic.fp8_gemm(x, x_scales, w, w_scales, block=(128, 128), out_dtype=jnp.bfloat16,
                                 grid_tile_width=3)
    with pytest.raises(TypeError, match="unknown fp8 GEMM knobs"):
        fp8_gemm_mosaic.fp8_gemm(x, x_scales, w, w_scales, block=(128, 128), out_dtype=jnp.bfloat16, block_m=64)
    assert fp8_gemm_mosaic.default_knobs(4, 128, 768, jnp.bfloat16, k_splits=1)["stages"] == 4
    assert fp8_gemm_mosaic.default_knobs(4, 128, 768, jnp.float32, k_splits=1)["stages"] == 3
    assert fp8_gemm_mosaic.default_knobs(4, 128, 768, jnp.bfloat16, k_splits=2)["stages"] == 3


@pytest.mark.parametrize("rows, width, depth, k_splits", [
    (64, 7168, 16384, 2),  # wo at decode: 56 tiles of [64, 128], 2 x 56 CTAs fit one wave of 132 SMs
    (1, 576, 7168, 8),  # kv_a_proj_with_mqa alone: 9 tiles (N = 576 takes 128 x 64 ones), 56 K blocks
    (64, 2112, 7168, 4),  # wqkv_a (q_a_proj and kv_a_proj_with_mqa): 33 tiles of 128 x 64
    (64, 24576, 1536, 1),  # wq_b: 96 tiles, a split would pass one wave
    (4096, 7168, 16384, 1),  # prefill: 1792 tiles
    (64, 7168, 384, 1),  # 3 K blocks: no factor of K_SPLITS divides them
])
def test_mosaic_splits_k_while_the_ctas_fit_one_wave(rows, width, depth, k_splits):
    assert fp8_gemm_mosaic.default_knobs(rows, width, depth, jnp.bfloat16)["k_splits"] == k_splits


@pytest.mark.parametrize("rows, width, depth, tile_n, k_splits", [
    (1, 36864, 7168, 64, 1),  # the dense MLP's gate_up: 288 CTAs fill 3 waves 73%, 128's 144 fill 2 waves 55%
    (64, 18432, 7168, 128, 1),  # 72 CTAs, one wave, fill as 64's 144 do: the larger tile
    (64, 24576, 1536, 128, 1),  # wq_b: 96 CTAs against 192, 73% either way
    (64, 4096, 7168, 64, 4),  # the shared experts' gate_up: 128 CTAs either way, the fewer K splits
    (1, 2048, 7168, 64, 8),  # 128 CTAs against 128's 64
    (64, 7168, 16384, 64, 2),  # wo: 112 CTAs either way, the fewer K splits
])
def test_mosaic_decode_tiles_fill_the_waves_best(rows, width, depth, tile_n, k_splits):
    knobs = fp8_gemm_mosaic.default_knobs(rows, width, depth, jnp.bfloat16)
    assert (knobs["split_m"], knobs["tile_n"], knobs["k_splits"]) == (False, tile_n, k_splits)


def test_mosaic_decode_tiles_fill_the_waves_with_the_k_splits_given():
    """k_splits 2 on the dense MLP's gate_up: [64, 256] tiles make 288 CTAs (3 waves, 73%), [64, 128] 576 (5, 87%)."""
    assert fp8_gemm_mosaic.default_knobs(1, 36864, 7168, jnp.bfloat16, k_splits=2)["tile_n"] == 64
    assert fp8_gemm_mosaic.default_knobs(1, 18432, 7168, jnp.bfloat16, k_splits=1)["tile_n"] == 128


def test_mosaic_prefill_tiles_keep_the_largest_tile_n():
    """Rows past one warpgroup: [128, tile_n] tiles, the largest tile_n that divides N (many waves)."""
    assert fp8_gemm_mosaic.default_knobs(4096, 18432, 7168, jnp.bfloat16)["tile_n"] == 128


def test_mosaic_splits_k_by_the_tile_it_is_given():
    """wq_b at 64 rows: its default [64, 256] tiles are 96, one wave; [128, 64] tiles given are 384, so no split."""
    assert fp8_gemm_mosaic.default_knobs(64, 24576, 1536, jnp.bfloat16, split_m=True, tile_n=64)["k_splits"] == 1
    assert fp8_gemm_mosaic.default_knobs(64, 7168, 16384, jnp.bfloat16, split_m=True, tile_n=64) == dict(
        split_m=True, tile_n=64, stages=4, k_splits=1, overlap_promotion=False, persistent=False,
        grid_tile_width=fp8_gemm_mosaic.GRID_TILE_WIDTH)  # 112 tiles


@pytest.mark.parametrize("scale_block_rows, tile_n, overlapped", [(128, None, True), (128, 64, True),
                                                                   (64, 128, False), (None, None, False)])
def test_mosaic_overlaps_the_promotion_where_a_warpgroup_has_one_w_scale(scale_block_rows, tile_n, overlapped):
    knobs = fp8_gemm_mosaic.default_knobs(4096, 7168, 16384, jnp.bfloat16, tile_n=tile_n,
                                          scale_block_rows=scale_block_rows)
    assert knobs["overlap_promotion"] is overlapped


@pytest.mark.parametrize("rows, width, depth, persistent", [
    (4096, 7168, 16384, True),  # 1792 tiles
    (64, 7168, 16384, False),  # 28 tiles, K split over 4: 112 CTAs, one wave
    (256, 24576, 1536, True),  # 384 tiles of [128, 128]
])
def test_mosaic_is_persistent_past_one_wave(rows, width, depth, persistent):
    assert fp8_gemm_mosaic.default_knobs(rows, width, depth, jnp.bfloat16)["persistent"] is persistent


# (M, N, K) of DeepSeek-V3.2's fp8 linear layers: decode and prefill rows, N a multiple of 128 or of 64 only.
MOSAIC_SHAPES = [(64, 24576, 1536), (4096, 7168, 16384), (200, 576, 7168), (1, 2048, 7168)]


@pytest.mark.parametrize("rows, width, depth", MOSAIC_SHAPES)
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("overlap_promotion, persistent, grid_tile_width", [
    (False, False, 8), (True, False, 2), (True, True, 8), (False, True, 2)],
    ids=["promote-after", "promote-overlapped", "promote-overlapped-persistent", "persistent-bands-of-2"])
def test_mosaic_kernel_lowers_for_cuda(rows, width, depth, out_dtype, overlap_promotion, persistent, grid_tile_width):
    """No interpreter runs the Mosaic GPU kernel; lowering it for CUDA checks its layouts and SMEM plan (an f32
    output's epilogue tile included): a CTA a tile or persistent, the promotion after each wgmma or overlapping the
    next, the tile order in bands of M tiles (2: a last band partly filled at one M tile)."""
    knobs = fp8_gemm_mosaic.default_knobs(rows, width, depth, out_dtype, k_splits=1)
    knobs.update(overlap_promotion=overlap_promotion, persistent=persistent, grid_tile_width=grid_tile_width)
    cta_m = fp8_gemm_mosaic._cta_tile(knobs["split_m"], knobs["tile_n"])[0]
    padded = -(-rows // cta_m) * cta_m
    S = jax.ShapeDtypeStruct
    # w's scales: compact (HF's grid) with overlap_promotion, else one per column
    w_scales = S((-(-width // 128), depth // 128) if overlap_promotion else (depth // 128, width), jnp.float32)
    args = (S((padded, depth), FP8), S((depth // 128, padded), jnp.float32), S((width, depth), FP8), w_scales)
    fp8_gemm_mosaic.fp8_gemm_tiles.trace(*args, **knobs, scale_block_rows=128, out_dtype=jnp.dtype(out_dtype)).lower(
        lowering_platforms=("cuda",))
    if rows <= fp8_gemm_mosaic.WG_ROWS and out_dtype == jnp.bfloat16:  # decode: K split over 4 CTAs, f32 parts
        split = dict(knobs, k_splits=4, stages=3)
        fp8_gemm_mosaic.fp8_gemm_tiles.trace(*args, **split, scale_block_rows=128,
                                             out_dtype=jnp.dtype(jnp.float32)).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("rows, width, depth, block, knobs", [
    (1, 576, 7168, (128, 128), {}), (4096, 7168, 16384, (128, 128), {}),
    (1, 576, 7168, (128, 128), {"overlap_promotion": False}), (4096, 7168, 16384, (128, 128), {"persistent": True}),
    (64, 2112, 6144, (1, 6144), {}), (4096, 6144, 8192, (1, 8192), {"persistent": True}),
    (64, 6144, 4096, (128, 4096), {})],
    ids=["default", "prefill", "promote-after", "persistent", "per-channel", "per-channel-prefill",
         "whole-depth-blocks"])
def test_mosaic_wrapper_lowers_for_cuda(rows, width, depth, block, knobs):
    """The whole op (padding, the scales as each mode takes them, split K's sum) lowers for CUDA from the
    contract's inputs: compact w scales in HF's grid; one scale a channel and a token (ptpc_fp8, GLM-5.2's shapes)
    read as one scale row every step."""
    S = jax.ShapeDtypeStruct
    k_blocks = -(-depth // block[1])
    args = (S((rows, depth), FP8), S((rows, k_blocks), jnp.float32), S((width, depth), FP8),
            S((-(-width // block[0]), k_blocks), jnp.float32))
    jax.jit(functools.partial(fp8_gemm_mosaic.fp8_gemm, block=block, out_dtype=jnp.bfloat16, **knobs)).trace(
        *args).lower(lowering_platforms=("cuda",))


@pytest.mark.gpu
@pytest.mark.parametrize("rows, width, depth, knobs", [(*shape, {}) for shape in MOSAIC_SHAPES]
                         + [(300, 1536, 7168, {}), (64, 1536, 7168, {"k_splits": 2}), (64, 2112, 7168, {})]
                         + [(*shape, knobs) for shape in MOSAIC_SHAPES for knobs in (
                             {"overlap_promotion": False}, {"persistent": True}, {"grid_tile_width": 2},
                             {"overlap_promotion": False, "persistent": True, "grid_tile_width": 2})])
def test_mosaic_compiled_equals_reference(rows, width, depth, knobs):
    """Within the fp8 tensor cores' reduced-precision accumulation (one 128-channel block at a time) of the
    reference, bf16 output."""
    args = _case(4, rows, width, depth, (128, 128))
    assert pallas_kernels.choose("fp8_gemm", "pallas", *args, block=(128, 128)) == "mosaic"
    got = pallas_kernels.fp8_gemm(*args, block=(128, 128), out_dtype=jnp.bfloat16, backend="mosaic", **knobs)
    got = np.asarray(got.astype(jnp.float32))
    want = np.asarray(reference.fp8_gemm(*args, block=(128, 128), out_dtype=jnp.float32))
    assert np.linalg.norm(got - want) <= 5e-3 * np.linalg.norm(want)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, width, depth, knobs", [(64, 2112, 6144, {}), (300, 6144, 8192, {}),
                                                       (1, 576, 6144, {"k_splits": 4}),
                                                       (4096, 6144, 8192, {"persistent": True})])
def test_mosaic_compiled_per_channel_equals_reference(rows, width, depth, knobs):
    """ptpc_fp8's per-token, per-channel scales (scale blocks (1, in)), bf16 output, within the fp8 tensor cores'
    reduced-precision accumulation of one 128-channel step."""
    block = (1, depth)
    args = _case(6, rows, width, depth, block)
    assert pallas_kernels.choose("fp8_gemm", "pallas", *args, block=block) == "mosaic"
    got = pallas_kernels.fp8_gemm(*args, block=block, out_dtype=jnp.bfloat16, backend="mosaic", **knobs)
    got = np.asarray(got.astype(jnp.float32))
    want = np.asarray(reference.fp8_gemm(*args, block=block, out_dtype=jnp.float32))
    assert np.linalg.norm(got - want) <= 5e-3 * np.linalg.norm(want)
