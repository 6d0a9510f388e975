"""Paged dense MLA decode over one DCP rank's local tokens (absorbed "MQA mode", split-KV flash decoding): the
Triton kernel.

Contract (`pallas_kernels.mla_decode`): q [M, Y, H, C+E] bf16 or f32 (absorbed latent query, `value_dim` = C wide,
then the rope query; Y query rows per sequence), kv_cache [pages, B, C+E] bf16 or f32 (latent then roped key, one
row per token shared by all heads) or a `formats.Fp8LatentCache` (656 B per token at 512 + 64: e4m3 latent, one
f32 scale per 128 columns, bf16 rope; it computes as the bf16 cache whose values it holds exactly), block_tables
[M, P] int32 page ids, lens [M, Y] int32: query row (m, s) attends local tokens t < lens[m, s], token t at page
block_tables[m, t // B], offset t % B (lens outside [0, P*B] act as clipped to it). sm_scale a Python float.
Returns out f32 [M, Y, H, value_dim] and lse f32 [M, Y, H] (natural log); a row with lens 0 gives out 0 and lse
-inf. Block-table entries past the longest row of a sequence are never read (-1 allowed), nor are tokens past it.

Work (FlashMLA's packing): a sequence's Y * H query rows share its KV rows, so they are packed into tiles of
`block_r` rows (the last tile padded with zero rows), each row masked by its own lens[m, s]. Grid (row tiles,
splits, M): a program takes one tile of one sequence and one split of its tokens, equal shares of [0, the tile's
longest row) rounded up to `block_t`, walks them `block_t` at a time (each token's page through the block table,
so a block may span pages and a page blocks), and keeps an online softmax in f32 (log2 units). Row tiles vary
fastest in launch order, so a sequence's tiles read its KV rows together (L2 reuse). Dots run in the cache's dtype
(q is cast to it; bf16 for an fp8 cache) with f32 accumulation; an f32 cache gets full-precision dots. One split
writes out and lse directly; several write f32 partials that `_lse.merge_splits` merges by log-sum-exp (XLA: the
Pallas merge `_split_merge_triton` unrolls its splits, and the default here runs up to hundreds of them at M = 1).
The split count is static (lens are traced): `default_splits` fills the GPU from the shapes alone.
Tuning defaults are the sparse MLA kernel's at the same tile shapes (`_sparse_mla_triton._DEFAULT_BLOCKS`), not
yet measured for this kernel (`bench/bench_mla_decode.py` measures them). A Mosaic GPU (sm_90) kernel would go
beside this one as the op's "mosaic" implementation.
Letters: see the legend in `dcp_jax/__init__.py` (Y: query rows per sequence, 1 at decode, n + 1 for MTP verify rows
or a prefill chunk's tokens); C = value_dim.
"""

from __future__ import annotations

import dataclasses
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
from pallas_kernels._sparse_mla_triton import fp8_block_step, fp8_cache_rows

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
MIN_DOT_DIM = 16  # the smallest dimension of a Triton tensor-core dot
# SMs of an H100 SXM and of an H200. Splits aim at two programs per SM (some sequences are shorter than others), but
# a grid of _FULL_WAVE programs or more is not split: at most 4 SMs idle, and splits would add their partials'
# traffic (at M = 64, H = 128, L = 4K over 3 splits: 64 * 3 * 128 * 513 * 4 B = 50 MB written and read back, a third
# of the 302 MB of cache).
_NUM_SMS = 132
_TARGET_PROGRAMS = 2 * _NUM_SMS
_FULL_WAVE = 128
# A split reads at least this many times the bytes of its partial output (block_r rows of value_dim + 1 f32,
# written here and read again by the merge).
_PARTIAL_SHARE = 4
# Default (block_t, num_stages) per cache dtype: the sparse MLA kernel's, measured there on the H200 at 64 query rows
# (its block_h) and num_warps=8 (docs/perf_sparse_mla.md, "Knob sweep"); the tiles here have the same shapes. bf16:
# q and two buffers of 64 gathered rows are 3 * 64 * 576 * 2 B = 221 KB of the 227 KB of shared memory; f32 doubles
# each.
_DEFAULT_BLOCKS = {jnp.dtype(jnp.bfloat16): (64, 3), jnp.dtype(jnp.float32): (16, 1)}

# The jax-pallas-triton deprecation fires when a jitted caller lowers the kernel, not at the call: filter by text.
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)


def _tile_rows(lens_ref, seq, tile, *, num_queries: int, num_heads: int, block_r: int, max_tokens: int):
    """The tile's rows: which are real (not padding) [block_r], their flat q row ids [block_r, 1] (clamped, so a
    padding row's id stays in the sequence) and lengths [block_r] (0 for padding, clipped to [0, P*B])."""
    num_rows = num_queries * num_heads
    i = tile * block_r + jnp.arange(block_r)  # row s * H + h of the sequence
    is_row = i < num_rows
    length = plgpu.load(lens_ref.at[seq * num_queries + i // num_heads], mask=is_row, other=0)
    q_rows = seq * num_rows + jnp.minimum(i, num_rows - 1)
    return is_row, q_rows[:, None], jnp.clip(length, 0, max_tokens)


def _split_bounds(tile_tokens, split, *, block_t: int, splits: int):
    """[start, end) of this split's share of the tile's tokens [0, tile_tokens): equal chunks rounded up to whole
    blocks, so trailing splits may be empty."""
    chunk = pl.cdiv(pl.cdiv(tile_tokens, splits), block_t) * block_t
    start = split * chunk
    return start, jnp.minimum(start + chunk, tile_tokens)


def _block_tokens(tables_ref, seq, first, end, *, block_t: int, page_size: int, max_pages: int):
    """The block's tokens t = first .. first + block_t - 1 [block_t], which are before `end`, and their cache rows
    [block_t, 1] (row 0 for the others: their block-table entries, perhaps -1, are never loaded)."""
    t = first + jnp.arange(block_t)
    is_token = t < end
    page = plgpu.load(tables_ref.at[seq * max_pages + t // page_size], mask=is_token, other=0)
    return t, is_token, (page * page_size + t % page_size)[:, None]


def _softmax_step(scores, scale, is_valid, m_prev, l_prev):
    """Online-softmax update for one block of raw scores [block_r, block_t], scaled to log2 units (so it uses exp2):
    (probs, correction, m_next, l_next). A row with no valid token yet keeps m = -inf and gets probabilities 0 (its
    maximum is taken as 0 where it would give -inf - -inf = NaN)."""
    scores = jnp.where(is_valid, scores * scale, -jnp.inf)
    m_next = jnp.maximum(m_prev, scores.max(axis=1))
    m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
    correction = jnp.exp2(m_prev - m_safe)
    probs = jnp.exp2(scores - m_safe[:, None])
    return probs, correction, m_next, l_prev * correction + probs.sum(axis=1)


def _normalized(acc, m, l):
    """out = acc / l and the natural-log lse; a row without tokens here (l == 0) gives out 0 and lse -inf, so the
    merge gives it weight 0."""
    is_empty = l == 0.0
    out = jnp.where(is_empty[:, None], 0.0, acc / jnp.where(is_empty, 1.0, l)[:, None])
    return out, jnp.where(is_empty, -jnp.inf, (m + jnp.log2(jnp.where(is_empty, 1.0, l))) * LN2)


def _mla_decode_kernel(tables_ref, lens_ref, q_ref, kv_ref,  # inputs
                       out_ref, lse_ref,                      # outputs
                       *, sm_scale: float, value_dim: int, rope_dim: int, num_queries: int, num_heads: int,
                       page_size: int, max_pages: int, block_r: int, block_t: int, splits: int, precision):
    tile, split, seq = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    is_row, q_rows, length = _tile_rows(lens_ref, seq, tile, num_queries=num_queries, num_heads=num_heads,
                                        block_r=block_r, max_tokens=max_pages * page_size)
    start, end = _split_bounds(length.max(), split, block_t=block_t, splits=splits)
    dtype = kv_ref.dtype
    # Gathers index both dims with int arrays (the interpreter cannot mix an array with a slice).
    lat_cols = jnp.arange(value_dim)[None, :]
    rope_cols = value_dim + jnp.arange(rope_dim)[None, :]
    q_lat = plgpu.load(q_ref.at[q_rows, lat_cols], mask=is_row[:, None], other=0).astype(dtype)    # [block_r, C]
    q_rope = plgpu.load(q_ref.at[q_rows, rope_cols], mask=is_row[:, None], other=0).astype(dtype)  # [block_r, E]
    scale = sm_scale * LOG2E  # scores in log2 units: the softmax uses exp2

    def body(block, carry):
        acc, m_prev, l_prev = carry
        t, is_token, slot = _block_tokens(tables_ref, seq, start + block * block_t, end, block_t=block_t,
                                          page_size=page_size, max_pages=max_pages)
        k_lat = plgpu.load(kv_ref.at[slot, lat_cols], mask=is_token[:, None], other=0)    # [block_t, C]
        k_rope = plgpu.load(kv_ref.at[slot, rope_cols], mask=is_token[:, None], other=0)  # [block_t, E]
        scores = jnp.dot(q_lat, k_lat.T, precision=precision, preferred_element_type=jnp.float32)
        scores += jnp.dot(q_rope, k_rope.T, precision=precision, preferred_element_type=jnp.float32)
        is_valid = is_token[None, :] & (t[None, :] < length[:, None])  # [block_r, block_t]
        probs, correction, m_next, l_next = _softmax_step(scores, scale, is_valid, m_prev, l_prev)
        acc = acc * correction[:, None] + jnp.dot(
            probs.astype(dtype), k_lat, precision=precision, preferred_element_type=jnp.float32)
        return acc, m_next, l_next

    acc = jnp.zeros((block_r, value_dim), jnp.float32)
    m = jnp.full((block_r,), -jnp.inf, jnp.float32)
    l = jnp.zeros((block_r,), jnp.float32)
    num_blocks = pl.cdiv(jnp.maximum(end - start, 0), block_t)
    acc, m, l = jax.lax.fori_loop(0, num_blocks, body, (acc, m, l))
    out, lse = _normalized(acc, m, l)
    out_ref[...] = out
    lse_ref[...] = lse


def _mla_decode_fp8_kernel(tables_ref, lens_ref, q_ref, latent_ref, scales_ref, rope_ref,  # inputs
                           out_ref, lse_ref,                                                # outputs
                           *, sm_scale: float, value_dim: int, rope_dim: int, num_queries: int, num_heads: int,
                           page_size: int, max_pages: int, block_r: int, block_t: int, splits: int):
    """The kernel over an fp8 latent cache, dequantized per 128-column tile as `_sparse_mla_triton`'s: each latent
    tile multiplies in bf16 as e4m3 values (exact in bf16); its per-token scale multiplies the tile's scores, and
    the probabilities of its values, so no dequantized tile is formed. Each tile has its own output accumulator."""
    tile, split, seq = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    is_row, q_rows, length = _tile_rows(lens_ref, seq, tile, num_queries=num_queries, num_heads=num_heads,
                                        block_r=block_r, max_tokens=max_pages * page_size)
    start, end = _split_bounds(length.max(), split, block_t=block_t, splits=splits)
    tiles = range(value_dim // formats.LATENT_TILE)
    tile_cols = jnp.arange(formats.LATENT_TILE)[None, :]
    rope_cols = jnp.arange(rope_dim)[None, :]
    row_mask = is_row[:, None]
    q_tiles = [plgpu.load(q_ref.at[q_rows, n * formats.LATENT_TILE + tile_cols], mask=row_mask,
                          other=0).astype(jnp.bfloat16) for n in tiles]                      # [block_r, 128] each
    q_rope = plgpu.load(q_ref.at[q_rows, value_dim + rope_cols], mask=row_mask, other=0).astype(jnp.bfloat16)
    scale = sm_scale * LOG2E

    def body(block, carry):
        accs, m_prev, l_prev = carry
        t, is_token, slot = _block_tokens(tables_ref, seq, start + block * block_t, end, block_t=block_t,
                                          page_size=page_size, max_pages=max_pages)
        is_valid = is_token[None, :] & (t[None, :] < length[:, None])
        return fp8_block_step(latent_ref, scales_ref, rope_ref, slot, is_token[:, None], q_tiles, q_rope, accs,
                              lambda scores: _softmax_step(scores, scale, is_valid, m_prev, l_prev))

    accs = tuple(jnp.zeros((block_r, formats.LATENT_TILE), jnp.float32) for _ in tiles)
    m = jnp.full((block_r,), -jnp.inf, jnp.float32)
    l = jnp.zeros((block_r,), jnp.float32)
    num_blocks = pl.cdiv(jnp.maximum(end - start, 0), block_t)
    accs, m, l = jax.lax.fori_loop(0, num_blocks, body, (accs, m, l))
    for n, acc in zip(tiles, accs):
        out, lse = _normalized(acc, m, l)
        out_ref[:, pl.ds(n * formats.LATENT_TILE, formats.LATENT_TILE)] = out
    lse_ref[...] = lse


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def check_inputs(q, kv_cache, block_tables, lens, value_dim, block_r=64, block_t=64, splits=None):
    """ValueError unless the Triton kernel takes these inputs and knobs; kv_cache is the logical cache (an fp8
    latent cache as `fp8_cache_rows` gives it)."""
    if q.ndim != 4 or kv_cache.ndim != 3 or block_tables.ndim != 2 or lens.ndim != 2:
        raise ValueError(f"want q [M, Y, H, Dq], kv_cache [pages, B, Dq], block_tables [M, P], lens [M, Y]; got "
                         f"{q.shape=}, {kv_cache.shape=}, {block_tables.shape=}, {lens.shape=}")
    seqs, num_queries, _, width = q.shape
    if kv_cache.shape[2] != width or block_tables.shape[0] != seqs or lens.shape != (seqs, num_queries):
        raise ValueError(f"mismatched shapes: {q.shape=}, {kv_cache.shape=}, {block_tables.shape=}, {lens.shape=}")
    if kv_cache.dtype not in (jnp.bfloat16, jnp.float32) or q.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"q and kv_cache must be bf16 or f32; got {q.dtype=}, {kv_cache.dtype=}")
    if block_tables.dtype != jnp.int32 or lens.dtype != jnp.int32:
        raise ValueError(f"block_tables and lens must be int32; got {block_tables.dtype=}, {lens.dtype=}")
    rope_dim = width - value_dim
    # Triton needs power-of-two tiles and dot dimensions of at least 16.
    if not (_is_power_of_two(value_dim) and _is_power_of_two(rope_dim) and min(value_dim, rope_dim) >= MIN_DOT_DIM):
        raise ValueError(f"value_dim and Dq - value_dim must be powers of two >= {MIN_DOT_DIM}; got {value_dim=}, "
                         f"Dq={width}")
    for name, block in (("block_r", block_r), ("block_t", block_t)):
        if not (_is_power_of_two(block) and block >= MIN_DOT_DIM):
            raise ValueError(f"{name} must be a power of two >= {MIN_DOT_DIM}; got {name}={block}")
    if splits is not None and (not isinstance(splits, int) or splits < 1):
        raise ValueError(f"splits must be a Python int >= 1; got {splits=}")


def unsupported(q, kv_cache, block_tables, lens, value_dim) -> list[str]:
    """Why this kernel does not take these inputs (empty: it does)."""
    try:
        logical = fp8_cache_rows(kv_cache, value_dim) if isinstance(kv_cache, formats.Fp8LatentCache) else kv_cache
        check_inputs(q, logical, block_tables, lens, value_dim)
    except ValueError as e:
        return [str(e)]
    return []


def default_splits(seqs: int, row_tiles: int, block_r: int, value_dim: int, max_tokens: int, token_bytes: int,
                   block_t: int) -> int:
    """Splits of each sequence's tokens, from shapes only (lens are traced): none when the M * row_tiles programs
    fill a wave (>= _FULL_WAVE), else enough for _TARGET_PROGRAMS programs, but no more than give each split
    (of max_tokens = P*B tokens) _PARTIAL_SHARE times its partial output's bytes of cache, rounded up to whole
    blocks. E.g. (bf16, block_t 64): M = 1, H = 16, L = 32K: 16-row tiles, >= 128 tokens a split, 256 splits;
    M = 1, H = 128: 64-row tiles, >= 512 tokens, 64 splits of 2 tiles; M = 64, H = 128: 128 programs, 1 split."""
    programs = seqs * row_tiles
    if programs >= _FULL_WAVE:
        return 1
    partial_bytes = block_r * (value_dim + 1) * 4
    min_tokens = pl.cdiv(pl.cdiv(_PARTIAL_SHARE * partial_bytes, token_bytes), block_t) * block_t
    return max(1, min(pl.cdiv(_TARGET_PROGRAMS, programs), max_tokens // min_tokens))


def _token_bytes(kv_cache) -> int:
    """Cache bytes per token: 576 values, or 656 B for an fp8 latent cache of 512 + 64."""
    return sum(jnp.dtype(part.dtype).itemsize * part.shape[-1] for part in jax.tree.leaves(kv_cache))


@dataclasses.dataclass(frozen=True)
class Tiling:
    """How the kernel runs some inputs: `mla_decode`'s knobs after their defaults."""
    # Query rows a program (a power of two >= 16; the Y * H rows of a sequence padded to row_tiles of them).
    block_r: int
    row_tiles: int
    # Tokens a step, and Triton's pipeline stages over them.
    block_t: int
    num_stages: int
    # Programs a sequence's tokens are split over (a row tile each).
    splits: int


def tiling(q, kv_cache, block_tables, lens, *, value_dim=512, block_r=64, block_t=None, splits=None,
           num_stages=None) -> Tiling:
    """The tiling `mla_decode` runs these inputs (arrays or ShapeDtypeStructs) and knobs with; ValueError when the
    kernel does not take them."""
    logical_cache = fp8_cache_rows(kv_cache, value_dim) if isinstance(kv_cache, formats.Fp8LatentCache) else kv_cache
    default_block_t, default_stages = _DEFAULT_BLOCKS[jnp.dtype(logical_cache.dtype)]
    block_t = default_block_t if block_t is None else block_t
    check_inputs(q, logical_cache, block_tables, lens, value_dim, block_r, block_t, splits)
    seqs, num_queries, num_heads, _ = q.shape
    num_rows = num_queries * num_heads
    block_r = min(block_r, max(_pow2_at_least(num_rows), MIN_DOT_DIM))
    row_tiles = pl.cdiv(num_rows, block_r)
    if splits is None:
        splits = default_splits(seqs, row_tiles, block_r, value_dim, block_tables.shape[1] * logical_cache.shape[1],
                                _token_bytes(kv_cache), block_t)
    return Tiling(block_r=block_r, row_tiles=row_tiles, block_t=block_t,
                  num_stages=default_stages if num_stages is None else num_stages, splits=splits)


def mla_decode(q, kv_cache, block_tables, lens, sm_scale, *, value_dim=512, interpret=None, block_r=64,
               block_t=None, splits=None, num_warps=8, num_stages=None):
    """Paged dense MLA decode, the Triton kernel; see the module docstring for the contract.

    Knobs: block_r query rows per program (at most: Y * H rows smaller than it take the power of two >= them,
    at least 16), block_t tokens per step, splits programs per sequence and row tile (None: `default_splits`),
    num_warps and num_stages for Triton. block_t and num_stages default per cache dtype (`_DEFAULT_BLOCKS`);
    `tiling` gives what runs.
    """
    is_fp8 = isinstance(kv_cache, formats.Fp8LatentCache)
    tiles = tiling(q, kv_cache, block_tables, lens, value_dim=value_dim, block_r=block_r, block_t=block_t,
                   splits=splits, num_stages=num_stages)
    block_r, block_t, splits = tiles.block_r, tiles.block_t, tiles.splits
    interpret = default_interpret(interpret)
    seqs, num_queries, num_heads, width = q.shape
    num_rows = num_queries * num_heads
    padded_rows = tiles.row_tiles * block_r
    page_size = (kv_cache.latent if is_fp8 else kv_cache).shape[1]
    max_pages = block_tables.shape[1]
    knobs = dict(sm_scale=float(sm_scale), value_dim=value_dim, rope_dim=width - value_dim, num_queries=num_queries,
                 num_heads=num_heads, page_size=page_size, max_pages=max_pages, block_r=block_r, block_t=block_t,
                 splits=splits)
    if is_fp8:
        kernel = functools.partial(_mla_decode_fp8_kernel, **knobs)
        flat_cache = [part.reshape(-1, part.shape[2]) for part in (kv_cache.latent, kv_cache.scales, kv_cache.rope)]
    else:
        # HIGHEST makes an f32 cache use IEEE dots instead of TF32; bf16 dots are unaffected.
        precision = jax.lax.Precision.HIGHEST if kv_cache.dtype == jnp.float32 else None
        kernel = functools.partial(_mla_decode_kernel, precision=precision, **knobs)
        flat_cache = [kv_cache.reshape(-1, width)]
    whole = pl.BlockSpec()
    outs, lses = pl.pallas_call(
        kernel,
        grid=(tiles.row_tiles, splits, seqs),
        in_specs=[whole] * (3 + len(flat_cache)),
        out_specs=[
            pl.BlockSpec((None, None, block_r, value_dim), lambda r, n, m: (m, n, r, 0)),
            pl.BlockSpec((None, None, block_r), lambda r, n, m: (m, n, r)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((seqs, splits, padded_rows, value_dim), jnp.float32),
            jax.ShapeDtypeStruct((seqs, splits, padded_rows), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name=f"mla_decode_{'fp8_' if is_fp8 else ''}{block_r=}_{block_t=}_{splits=}",
    )(block_tables.reshape(-1), lens.reshape(-1), q.reshape(seqs * num_rows, width), *flat_cache)
    out, lse = (outs[:, 0], lses[:, 0]) if splits == 1 else merge_splits(outs, lses)
    if padded_rows != num_rows:
        out, lse = out[:, :num_rows], lse[:, :num_rows]
    return out.reshape(seqs, num_queries, num_heads, value_dim), lse.reshape(seqs, num_queries, num_heads)
