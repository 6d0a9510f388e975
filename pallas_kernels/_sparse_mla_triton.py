"""Sparse MLA decode over compacted physical slots (absorbed "MQA mode", split-K flash decoding): the Triton kernel.

Contract (`pallas_kernels.sparse_mla_decode`): q [R, H, C+E] (absorbed latent query, `value_dim` = C wide, then
the rope query), kv_cache [pages, B, C+E] bf16 or f32 (latent then roped key, one row per token shared by all heads)
or a `formats.Fp8LatentCache` (656 B per token at 512 + 64: e4m3 latent, one f32 scale per 128 columns, bf16 rope;
it computes as a bf16 cache, whose values it holds exactly, and returns bf16), slots [R, K] int32
physical slot ids `page*B + offset`, compacted (valid first), counts [R] int32 valid slots per row, sm_scale a
Python float. Returns out [R, H, value_dim] in the cache's dtype (softmax-weighted sum of the latent rows; a
bf16 out is rounded from f32 accumulators, as FlashMLA's) and lse f32 [R, H] (natural log of the sum of
exp(scaled scores)). A row with count <= 0 gives out 0 and lse -inf; counts above K
act as K. Slots at or past a row's count are never read (they may hold -1 or garbage); valid slots must lie in
[0, pages*B).

Dots run in the cache's dtype (q is cast to it) with f32 accumulation; an f32 cache gets full-precision dots.
Work per row is proportional to its count: each of `num_splits` programs of a row takes an equal share of the
row's valid slots, rounded up to `block_s`, and loads nothing past the count. Partial results (f32) are merged
in f32 by `_lse.merge_splits`; a single split is written in the output dtype by the kernel. Tuning defaults were
measured by `bench/bench_sparse_mla.py` (docs/perf_sparse_mla.md, "Triton backend", "Knob sweep").
This kernel takes any supported shape with a bf16, f32 or fp8 latent cache; for a bf16 or fp8 cache of 512 + 64
columns on Hopper the warp-specialized Mosaic GPU kernel (`_sparse_mla_mosaic.py`) is faster. The fp8 latent cache
runs the bf16 defaults, not measured for it.
Letters: see the legend in `dcp_jax/__init__.py`; C = value_dim.
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import formats
from pallas_kernels._lse import merge_splits
from pallas_kernels._platform import default_interpret

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# Programs that keep the H200's 132 SMs busy; fewer rows x head blocks than this get split-K.
_MIN_PROGRAMS = 128
_MAX_SPLITS = 16
# Default (block_s, num_stages) per cache dtype, measured on the H200 at block_h=64, num_warps=8. bf16: q and two
# buffers of 64 gathered rows are 3 * 64 * 576 * 2 B = 221 KB of the 227 KB of shared memory; f32 doubles each.
_DEFAULT_BLOCKS = {jnp.dtype(jnp.bfloat16): (64, 3), jnp.dtype(jnp.float32): (16, 1)}

# The jax-pallas-triton deprecation fires when a jitted caller lowers the kernel, not at the call: filter by text.
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)


def _split_bounds(slots_ref, counts_ref, row, split, *, block_s: int, num_splits: int):
    """[start, end) of this split's share of the row's valid slots: equal chunks of [0, count) rounded up to
    whole blocks, so trailing splits may be empty."""
    num_slots = slots_ref.shape[1]
    count = jnp.clip(counts_ref[row], 0, num_slots)
    chunk = pl.cdiv(pl.cdiv(count, num_splits), block_s) * block_s
    start = split * chunk
    return start, jnp.minimum(start + chunk, count)


def _block_slots(slots_ref, row, first, end, block_s: int):
    """Which of the block's slots [first, first + block_s) are valid, and their ids [block_s, 1] (0 where not, so
    masked lanes never load the cache row a garbage slot id names)."""
    is_valid = first + jnp.arange(block_s) < end                      # [block_s]
    return is_valid, plgpu.load(slots_ref.at[row, pl.ds(first, block_s)], mask=is_valid, other=0)[:, None]


def _softmax_step(scores, scale, is_valid, m_prev, l_prev):
    """Online-softmax update for one block of raw scores [block_h, block_s], scaled to log2 units (so it uses exp2):
    (probs, correction, m_next, l_next). Every block holds at least one valid lane, so m_next is finite."""
    scores = jnp.where(is_valid[None, :], scores * scale, -jnp.inf)
    m_next = jnp.maximum(m_prev, scores.max(axis=1))
    correction = jnp.exp2(m_prev - m_next)
    probs = jnp.exp2(scores - m_next[:, None])
    return probs, correction, m_next, l_prev * correction + probs.sum(axis=1)


def _normalized(acc, m, l):
    """out = acc / l and the natural-log lse; an empty split (l == 0) gives out 0 and lse -inf, so the merge
    gives it weight 0."""
    is_empty = l == 0.0
    out = jnp.where(is_empty[:, None], 0.0, acc / jnp.where(is_empty, 1.0, l)[:, None])
    return out, jnp.where(is_empty, -jnp.inf, (m + jnp.log2(jnp.where(is_empty, 1.0, l))) * LN2)


def _sparse_mla_kernel(slots_ref, counts_ref, q_ref, kv_ref,  # inputs
                       out_ref, lse_ref,                      # outputs
                       *, sm_scale: float, value_dim: int, rope_dim: int, block_h: int, block_s: int,
                       num_splits: int, precision):
    head_block, split, row = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, end = _split_bounds(slots_ref, counts_ref, row, split, block_s=block_s, num_splits=num_splits)
    heads = pl.ds(head_block * block_h, block_h)
    dtype = kv_ref.dtype
    q_lat = q_ref[row, heads, pl.ds(0, value_dim)].astype(dtype)            # [block_h, C]
    q_rope = q_ref[row, heads, pl.ds(value_dim, rope_dim)].astype(dtype)    # [block_h, E]
    # Gathers index both cache dims with int arrays (the interpreter cannot mix an array with a slice).
    lat_cols = jnp.arange(value_dim)[None, :]
    rope_cols = value_dim + jnp.arange(rope_dim)[None, :]
    # Scores in log2 units so the softmax uses exp2.
    scale = sm_scale * LOG2E

    def body(block, carry):
        acc, m_prev, l_prev = carry
        is_valid, slot = _block_slots(slots_ref, row, start + block * block_s, end, block_s)
        k_lat = plgpu.load(kv_ref.at[slot, lat_cols], mask=is_valid[:, None], other=0)    # [block_s, C]
        k_rope = plgpu.load(kv_ref.at[slot, rope_cols], mask=is_valid[:, None], other=0)  # [block_s, E]
        scores = jnp.dot(q_lat, k_lat.T, precision=precision, preferred_element_type=jnp.float32)
        scores += jnp.dot(q_rope, k_rope.T, precision=precision, preferred_element_type=jnp.float32)
        probs, correction, m_next, l_next = _softmax_step(scores, scale, is_valid, m_prev, l_prev)
        acc = acc * correction[:, None] + jnp.dot(
            probs.astype(dtype), k_lat, precision=precision, preferred_element_type=jnp.float32)
        return acc, m_next, l_next

    acc = jnp.zeros((block_h, value_dim), jnp.float32)
    m = jnp.full((block_h,), -jnp.inf, jnp.float32)
    l = jnp.zeros((block_h,), jnp.float32)
    num_blocks = pl.cdiv(jnp.maximum(end - start, 0), block_s)
    acc, m, l = jax.lax.fori_loop(0, num_blocks, body, (acc, m, l))
    out, lse = _normalized(acc, m, l)
    out_ref[...] = out.astype(out_ref.dtype)
    lse_ref[...] = lse


def fp8_block_step(latent_ref, scales_ref, rope_ref, slot, mask, q_tiles, q_rope, accs, softmax_step):
    """One block of tokens of an fp8 latent cache (cache rows `slot` [n, 1], `mask` [n, 1] the real ones) against
    query tiles q_tiles (bf16 [r, 128] each) and q_rope [r, E]: each e4m3 tile multiplies in bf16 (exact) and its
    per-token scale multiplies the tile's scores and the probabilities of its values, so no dequantized tile is
    formed. `softmax_step(scores)` -> (probs, correction, m, l) is the kernel's online-softmax update. Returns (the
    per-tile accumulators updated, m, l)."""
    tiles = range(len(q_tiles))
    tile_cols = jnp.arange(formats.LATENT_TILE)[None, :]
    k_tiles = [plgpu.load(latent_ref.at[slot, t * formats.LATENT_TILE + tile_cols], mask=mask,
                          other=jnp.zeros((), latent_ref.dtype)).astype(jnp.bfloat16)
               for t in tiles]                                                     # [n, 128] each
    k_scales = [plgpu.load(scales_ref.at[slot, jnp.full((1, 1), t)], mask=mask, other=0.0).T
                for t in tiles]                                                    # [1, n] each
    k_rope = plgpu.load(rope_ref.at[slot, jnp.arange(q_rope.shape[1])[None, :]], mask=mask, other=0)  # [n, E]
    scores = jnp.dot(q_rope, k_rope.T, preferred_element_type=jnp.float32)
    for q_tile, k_tile, k_scale in zip(q_tiles, k_tiles, k_scales):
        scores += jnp.dot(q_tile, k_tile.T, preferred_element_type=jnp.float32) * k_scale
    probs, correction, m_next, l_next = softmax_step(scores)
    accs = tuple(acc * correction[:, None] + jnp.dot((probs * k_scale).astype(jnp.bfloat16), k_tile,
                                                     preferred_element_type=jnp.float32)
                 for acc, k_tile, k_scale in zip(accs, k_tiles, k_scales))
    return accs, m_next, l_next


def _sparse_mla_fp8_kernel(slots_ref, counts_ref, q_ref, latent_ref, scales_ref, rope_ref,  # inputs
                           out_ref, lse_ref,                                                # outputs
                           *, sm_scale: float, value_dim: int, rope_dim: int, block_h: int, block_s: int,
                           num_splits: int):
    """The kernel over an fp8 latent cache. Each 128-column latent tile t multiplies in bf16 as e4m3 values
    (exact in bf16): its per-slot scale multiplies the tile's scores, and the probabilities of its values, so
    no dequantized tile is formed. Each tile has its own output accumulator."""
    head_block, split, row = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, end = _split_bounds(slots_ref, counts_ref, row, split, block_s=block_s, num_splits=num_splits)
    heads = pl.ds(head_block * block_h, block_h)
    tiles = range(value_dim // formats.LATENT_TILE)
    q_tiles = [q_ref[row, heads, pl.ds(t * formats.LATENT_TILE, formats.LATENT_TILE)].astype(jnp.bfloat16)
               for t in tiles]                                                    # [block_h, 128] each
    q_rope = q_ref[row, heads, pl.ds(value_dim, rope_dim)].astype(jnp.bfloat16)   # [block_h, E]
    scale = sm_scale * LOG2E

    def body(block, carry):
        accs, m_prev, l_prev = carry
        is_valid, slot = _block_slots(slots_ref, row, start + block * block_s, end, block_s)
        return fp8_block_step(latent_ref, scales_ref, rope_ref, slot, is_valid[:, None], q_tiles, q_rope, accs,
                              lambda scores: _softmax_step(scores, scale, is_valid, m_prev, l_prev))

    accs = tuple(jnp.zeros((block_h, formats.LATENT_TILE), jnp.float32) for _ in tiles)
    m = jnp.full((block_h,), -jnp.inf, jnp.float32)
    l = jnp.zeros((block_h,), jnp.float32)
    num_blocks = pl.cdiv(jnp.maximum(end - start, 0), block_s)
    accs, m, l = jax.lax.fori_loop(0, num_blocks, body, (accs, m, l))
    for t, acc in zip(tiles, accs):
        out, lse = _normalized(acc, m, l)
        out_ref[:, pl.ds(t * formats.LATENT_TILE, formats.LATENT_TILE)] = out.astype(out_ref.dtype)
    lse_ref[...] = lse


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def fp8_cache_rows(cache: formats.Fp8LatentCache, value_dim: int):
    """The logical bf16 cache [pages, B, C + E] an fp8 latent cache stands for, after checking its parts."""
    latent, scales, rope = cache.latent, cache.scales, cache.rope
    if not (latent.ndim == scales.ndim == rope.ndim == 3
            and latent.shape[:2] == scales.shape[:2] == rope.shape[:2]):
        raise ValueError(f"an Fp8LatentCache needs latent [pages, B, D], scales [pages, B, D/128], rope "
                         f"[pages, B, E]; got {latent.shape=}, {scales.shape=}, {rope.shape=}")
    if latent.dtype != jnp.float8_e4m3fn or scales.dtype != jnp.float32 or rope.dtype != jnp.bfloat16:
        raise ValueError(f"an Fp8LatentCache is e4m3 latent, f32 scales, bf16 rope; got {latent.dtype=}, "
                         f"{scales.dtype=}, {rope.dtype=}")
    tiles = value_dim // formats.LATENT_TILE
    if latent.shape[2] != value_dim or value_dim % formats.LATENT_TILE or scales.shape[2] != tiles:
        raise ValueError(f"an Fp8LatentCache's latent must be value_dim={value_dim} wide (a multiple of "
                         f"{formats.LATENT_TILE}) with one scale per {formats.LATENT_TILE} columns; got "
                         f"{latent.shape=}, {scales.shape=}")
    return jax.ShapeDtypeStruct((*latent.shape[:2], value_dim + rope.shape[2]), jnp.bfloat16)


def check_inputs(q, kv_cache, slots, counts, value_dim, block_h=64, block_s=64, num_splits=None):
    """ValueError unless the Triton kernel takes these inputs and knobs (a bf16, f32 or fp8-latent cache)."""
    if q.ndim != 3 or kv_cache.ndim != 3 or slots.ndim != 2 or counts.ndim != 1:
        raise ValueError(f"want q [R, H, Dq], kv_cache [pages, B, Dq], slots [R, S], counts [R]; got "
                         f"{q.shape=}, {kv_cache.shape=}, {slots.shape=}, {counts.shape=}")
    rows, num_heads, width = q.shape
    if kv_cache.shape[2] != width or slots.shape[0] != rows or counts.shape[0] != rows:
        raise ValueError(f"mismatched shapes: {q.shape=}, {kv_cache.shape=}, {slots.shape=}, {counts.shape=}")
    if kv_cache.dtype not in (jnp.bfloat16, jnp.float32) or q.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"q and kv_cache must be bf16 or f32; got {q.dtype=}, {kv_cache.dtype=}")
    if slots.dtype != jnp.int32 or counts.dtype != jnp.int32:
        raise ValueError(f"slots and counts must be int32; got {slots.dtype=}, {counts.dtype=}")
    rope_dim = width - value_dim
    # Triton needs power-of-two tiles and dot dimensions of at least 16.
    if not (_is_power_of_two(value_dim) and _is_power_of_two(rope_dim) and value_dim >= 16 and rope_dim >= 16):
        raise ValueError(f"value_dim and Dq - value_dim must be powers of two >= 16; got {value_dim=}, Dq={width}")
    if not (_is_power_of_two(block_h) and block_h >= 16):
        raise ValueError(f"block_h must be a power of two >= 16; got {block_h=}")
    if not (_is_power_of_two(block_s) and block_s >= 16):
        raise ValueError(f"block_s must be a power of two >= 16; got {block_s=}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1; got {num_splits=}")


def default_num_splits(rows: int, head_blocks: int, num_slots: int, block_s: int) -> int:
    """Fewest power-of-two splits giving >= _MIN_PROGRAMS programs, at most one split per full block."""
    max_splits = max(1, min(_MAX_SPLITS, pl.cdiv(num_slots, block_s)))
    splits = 1
    while rows * head_blocks * splits < _MIN_PROGRAMS and splits * 2 <= max_splits:
        splits *= 2
    return splits


def sparse_mla_decode(q, kv_cache, slots, counts, sm_scale, *, value_dim=512, interpret=None, block_h=64,
                      block_s=None, num_splits=None, num_warps=8, num_stages=None):
    """Absorbed sparse MLA decode, the Triton kernel; see the module docstring for the contract.

    Knobs: block_h heads per program (at most; the largest power of two <= block_h dividing the padded H is
    used), block_s slots per step, num_splits split-K programs per row (None: `default_num_splits`), num_warps
    and num_stages for Triton. block_s and num_stages default per cache dtype. H that is not a multiple of 16 is
    padded with zero queries (Triton dots need >= 16 rows) whose outputs are dropped.
    """
    is_fp8 = isinstance(kv_cache, formats.Fp8LatentCache)
    logical_cache = fp8_cache_rows(kv_cache, value_dim) if is_fp8 else kv_cache  # shape and compute dtype
    default_block_s, default_stages = _DEFAULT_BLOCKS.get(jnp.dtype(logical_cache.dtype), (64, 3))
    block_s = default_block_s if block_s is None else block_s
    num_stages = default_stages if num_stages is None else num_stages
    check_inputs(q, logical_cache, slots, counts, value_dim, block_h, block_s, num_splits)
    interpret = default_interpret(interpret)
    num_heads = q.shape[1]
    padded_heads = pl.cdiv(num_heads, 16) * 16
    if padded_heads != num_heads:
        q = jnp.pad(q, ((0, 0), (0, padded_heads - num_heads), (0, 0)))
    block_h = min(block_h, padded_heads)
    while padded_heads % block_h:
        block_h //= 2
    rows, _, width = q.shape
    num_slots = slots.shape[1]
    head_blocks = padded_heads // block_h
    if num_splits is None:
        num_splits = default_num_splits(rows, head_blocks, num_slots, block_s)
    knobs = dict(sm_scale=float(sm_scale), value_dim=value_dim, rope_dim=width - value_dim, block_h=block_h,
                 block_s=block_s, num_splits=num_splits)
    if is_fp8:
        kernel = functools.partial(_sparse_mla_fp8_kernel, **knobs)
        flat_cache = [part.reshape(-1, part.shape[2]) for part in (kv_cache.latent, kv_cache.scales, kv_cache.rope)]
    else:
        # HIGHEST makes an f32 cache use IEEE dots instead of TF32; bf16 dots are unaffected.
        precision = jax.lax.Precision.HIGHEST if kv_cache.dtype == jnp.float32 else None
        kernel = functools.partial(_sparse_mla_kernel, precision=precision, **knobs)
        flat_cache = [kv_cache.reshape(-1, width)]
    # Head blocks vary fastest in launch order, so programs sharing a row's KV rows run together (L2 reuse).
    grid = (head_blocks, num_splits, rows)
    whole = pl.BlockSpec()
    outs, lses = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[whole] * (3 + len(flat_cache)),
        out_specs=[
            pl.BlockSpec((None, None, block_h, value_dim), lambda h, n, r: (r, n, h, 0)),
            pl.BlockSpec((None, None, block_h), lambda h, n, r: (r, n, h)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((rows, num_splits, padded_heads, value_dim),
                                 logical_cache.dtype if num_splits == 1 else jnp.float32),
            jax.ShapeDtypeStruct((rows, num_splits, padded_heads), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"sparse_mla_decode_{'fp8_' if is_fp8 else ''}{block_h=}_{block_s=}_{num_splits=}",
    )(slots, counts, q, *flat_cache)
    out, lse = (outs[:, 0], lses[:, 0]) if num_splits == 1 else merge_splits(outs, lses)
    return out[:, :num_heads].astype(logical_cache.dtype), lse[:, :num_heads]
