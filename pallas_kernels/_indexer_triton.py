"""Lightning-indexer logits over a paged index-K cache: the Triton kernel.

Contract (`pallas_kernels.indexer_logits`, which hands this kernel the cache as keys and optional per-token
scales): q [R, Hi, Di] (f32, bf16 or float8_e4m3fn), weights [R, Hi] f32 with every scale folded in,
k_cache [num_pages, page, Di] (f32, bf16 or float8_e4m3fn), block_tables [R, max_blocks] int32 page ids (or
[S, max_blocks] per sequence with query_seqs [R] int32: row r reads those of sequence query_seqs[r]),
lens [R] int32 local lengths (0 <= lens[r] <= max_blocks * page, computed on the host), optional
k_scale [num_pages, page] f32 per token. Returns f32 [R, max_blocks * page]:
`sum_h weights[r,h] * relu(q[r,h] . k_t) * k_scale[t]` for t < lens[r], -inf elsewhere.
Block-table entries past a row's length (-1 on pad rows) are never read, nor are keys past it. q and keys
are multiplied in the wider of their dtypes with f32 accumulation; f32 inputs use full-precision f32 dots. fp8 q
and fp8 keys run on fp8 tensor cores (wgmma) by default, accumulating `fp8_imprecise_acc` products at a time in
the tensor core's reduced-precision (truncated f32) accumulator as DeepGEMM's indexer does;
`fp8_imprecise_acc=None` multiplies them exactly as f16 instead (mma.sync, about half the rate). The wrapper pads
Hi to a power of two >= 16 with zero-weight heads; Di must be a power of two >= 16 and tokens need no alignment
(any page size works). For fp8 keys with scales in pages of 64 tokens and Di = 128 on Hopper, the TMA-pipelined
Mosaic GPU kernel (`_indexer_mosaic.py`) does the same fp8 tensor-core arithmetic as `fp8_imprecise_acc=128`.

Grid (R, ceil(max_blocks*page / block_t)): a program owns block_t tokens of one row and walks them in chunks
of chunk_t tokens; each chunk gathers its keys once ([chunk_t, Di], one row per token through the block
table) and scores all heads with one dot [chunk_t, Di] x [Di, Hi]; relu, weights and the head sum stay in
registers. Chunks at or past the row's length only store -inf.

With query_seqs (prefill: a chunk's tokens are consecutive rows of one sequence, each with its own causal length)
the grid is (ceil(R / rows_per_tile), splits) and a program owns a tile of consecutive rows: when every row of a
positive length is of one sequence, it gathers each key chunk once up to the tile's longest row and scores it for
every row ([chunk_t, Di] x [Di, Hi] per row, the keys loaded once for the tile, as DeepGEMM's prefill
`fp8_mqa_logits` shares a key tile among queries); otherwise (decode rows of different sequences, a tile across
two prompts) it scores its rows one after the other as the row kernel does.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._fp8_dot import MIN_IMPRECISE_ACC, fp8_dot_nt
from pallas_kernels._platform import default_interpret

# Pallas' Triton backend is what runs on the GPU today; its deprecation notice fires on every lowering.
warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*", category=DeprecationWarning)

MIN_DOT_DIM = 16  # smallest M, N, K of a Triton tensor-core dot
# Automatic block_t: long programs amortize the q load and pipeline their chunks, but at least about four
# programs per SM (132 on an H200) keep every SM streaming at small batch sizes.
_MAX_BLOCK_T, _MIN_PROGRAMS = 512, 512


def _gather_keys(k_ref, k_scale_ref, tables_ref, table_start, t, is_valid, *, page_size: int):
    """The keys [chunk_t, Di] of token positions t [chunk_t] of the block table at tables_ref[table_start:], and
    their scales [chunk_t] (None without). Masked loads: entries past the length (-1 page ids, tail keys) cost no
    memory traffic."""
    page = plgpu.load(tables_ref.at[table_start + t // page_size], mask=is_valid, other=0)
    slot = page * page_size + t % page_size
    num_cols = k_ref.shape[1]
    cols = lax.broadcasted_iota(jnp.int32, (1, num_cols), 1)  # [1, Di]
    # A mask constant along Di (a broadcast) keeps the row loads 16 bytes wide.
    row_mask = jnp.broadcast_to(is_valid[:, None], (t.shape[0], num_cols))
    keys = plgpu.load(k_ref.at[slot[:, None], cols], mask=row_mask, other=jnp.zeros((), k_ref.dtype))
    scales = None if k_scale_ref is None else plgpu.load(k_scale_ref.at[slot], mask=is_valid, other=0.0)
    return keys, scales


def _score(keys, scales, q, weights, *, precision, fp8_imprecise_acc):
    """sum_h weights[h] * relu(q[h] . key) * scale for each key of a chunk: [chunk_t] f32."""
    if fp8_imprecise_acc is None:
        dots = lax.dot_general(keys.astype(q.dtype), q, (((1,), (1,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)  # [chunk_t, Hi]
    else:
        dots = fp8_dot_nt(keys, q, max_num_imprecise_acc=fp8_imprecise_acc)
    logits = jnp.sum(jnp.maximum(dots, 0.0) * weights[None, :], axis=1)
    return logits if scales is None else logits * scales


def _valid_chunks(length, start, chunk_t: int, num_chunks: int):
    """Chunks of a program's span from `start` that hold tokens before `length`."""
    return jnp.clip(pl.cdiv(length - start, chunk_t), 0, num_chunks)


def _indexer_kernel(q_ref, weights_ref, k_ref, k_scale_ref, block_tables_ref, lens_ref,  # inputs
                    out_ref,  # output
                    *, page_size: int, max_blocks: int, chunk_t: int, precision, fp8_imprecise_acc):
    row, split = pl.program_id(0), pl.program_id(1)
    block_t = out_ref.shape[0]
    start = split * block_t
    length = lens_ref[0]
    num_chunks = block_t // chunk_t
    q, weights = q_ref[...], weights_ref[...]  # [Hi, Di], [Hi]

    def score_chunk(c, carry):
        t = start + c * chunk_t + lax.iota(jnp.int32, chunk_t)  # [chunk_t] token positions in the row
        is_valid = t < length
        keys, scales = _gather_keys(k_ref, k_scale_ref, block_tables_ref, row * max_blocks, t, is_valid,
                                    page_size=page_size)
        logits = _score(keys, scales, q, weights, precision=precision, fp8_imprecise_acc=fp8_imprecise_acc)
        out_ref[pl.ds(c * chunk_t, chunk_t)] = jnp.where(is_valid, logits, -jnp.inf)
        return carry

    def store_empty_chunk(c, carry):
        out_ref[pl.ds(c * chunk_t, chunk_t)] = jnp.full((chunk_t,), -jnp.inf, jnp.float32)
        return carry

    num_valid = _valid_chunks(length, start, chunk_t, num_chunks)
    lax.fori_loop(0, num_valid, score_chunk, None)
    lax.fori_loop(num_valid, num_chunks, store_empty_chunk, None)


def _row_tile_kernel(q_ref, weights_ref, k_ref, k_scale_ref, block_tables_ref, seqs_ref, lens_ref,  # inputs
                     out_ref,  # output
                     *, page_size: int, max_blocks: int, chunk_t: int, precision, fp8_imprecise_acc):
    """A tile of consecutive rows: when every row of a positive length reads one sequence (the tokens of a prefill
    chunk), each key chunk is gathered once and scored for every row of the tile; otherwise (decode rows of
    different sequences) row by row."""
    split = pl.program_id(1)
    tile_rows, block_t = out_ref.shape
    start = split * block_t
    num_chunks = block_t // chunk_t
    lens = [lens_ref[j] for j in range(tile_rows)]
    seqs = [seqs_ref[j] for j in range(tile_rows)]
    longest = functools.reduce(jnp.maximum, lens)
    tile_seq = functools.reduce(jnp.maximum, [jnp.where(n > 0, s, -1) for n, s in zip(lens, seqs)])
    is_shared = functools.reduce(jnp.logical_and, [(n == 0) | (s == tile_seq) for n, s in zip(lens, seqs)])
    num_shared = jnp.where(is_shared, _valid_chunks(longest, start, chunk_t, num_chunks), 0)
    score = functools.partial(_score, precision=precision, fp8_imprecise_acc=fp8_imprecise_acc)
    qs, weights = [q_ref[j] for j in range(tile_rows)], [weights_ref[j] for j in range(tile_rows)]  # loaded once

    def positions(c):
        return start + c * chunk_t + lax.iota(jnp.int32, chunk_t)

    def score_shared_chunk(c, carry):
        t = positions(c)
        keys, scales = _gather_keys(k_ref, k_scale_ref, block_tables_ref, tile_seq * max_blocks, t, t < longest,
                                    page_size=page_size)
        for j in range(tile_rows):
            out_ref[j, pl.ds(c * chunk_t, chunk_t)] = jnp.where(t < lens[j], score(keys, scales, qs[j], weights[j]),
                                                                -jnp.inf)
        return carry

    lax.fori_loop(0, num_shared, score_shared_chunk, None)
    for j in range(tile_rows):

        def score_own_chunk(c, carry, j=j):
            t = positions(c)
            is_valid = t < lens[j]
            keys, scales = _gather_keys(k_ref, k_scale_ref, block_tables_ref, seqs[j] * max_blocks, t, is_valid,
                                        page_size=page_size)
            out_ref[j, pl.ds(c * chunk_t, chunk_t)] = jnp.where(is_valid, score(keys, scales, qs[j], weights[j]),
                                                                -jnp.inf)
            return carry

        def store_empty_chunk(c, carry, j=j):
            out_ref[j, pl.ds(c * chunk_t, chunk_t)] = jnp.full((chunk_t,), -jnp.inf, jnp.float32)
            return carry

        num_own = jnp.where(is_shared, 0, _valid_chunks(lens[j], start, chunk_t, num_chunks))
        lax.fori_loop(0, num_own, score_own_chunk, None)
        lax.fori_loop(jnp.where(is_shared, num_shared, num_own), num_chunks, store_empty_chunk, None)


def unsupported(q) -> list[str]:
    """Why this kernel does not take these inputs (empty: it does)."""
    dim = q.shape[-1]
    if dim < MIN_DOT_DIM or dim & (dim - 1):
        return [f"Di must be a power of two >= {MIN_DOT_DIM} (a Triton dot), got {q.shape=}"]
    return []


def pow2_at_least(n):
    return 1 << max(n - 1, 0).bit_length()


def indexer_logits(q, weights, k_cache, block_tables, lens, *, k_scale=None, query_seqs=None, interpret=None,
                   block_t=None, chunk_t=64, rows_per_tile=4, num_warps=4, num_stages=2, fp8_imprecise_acc=128):
    """Indexer logits f32 [R, max_blocks * page]; see the module docstring for the contract. With `query_seqs`
    [R] int32, block_tables are per sequence ([S, max_blocks]) and row r reads those of query_seqs[r]: the
    row-tile kernel then scores `rows_per_tile` consecutive rows a program, sharing each key chunk among the rows
    of one sequence.

    Knobs: block_t tokens per program (None: the largest power of two <= 512 that still gives 512
    programs, so small batches fill the GPU), chunk_t tokens per dot (powers of two, chunk_t <= block_t; both
    shrink to fit short rows), rows_per_tile (with query_seqs), num_warps and num_stages for Triton,
    fp8_imprecise_acc (fp8 q and keys only: None or >= 32, see the module docstring). Defaults from
    bench/bench_indexer.py on an H200 (docs/perf_indexer.md): chunk_t and num_stages the fastest at fp8 B=64 L=64K;
    block_t <= 512 ties 1024 there and is faster at B=8.
    """
    if fp8_imprecise_acc is not None and fp8_imprecise_acc < MIN_IMPRECISE_ACC:
        raise ValueError(f"fp8_imprecise_acc must be None or >= {MIN_IMPRECISE_ACC}; got {fp8_imprecise_acc}")
    if rows_per_tile < 1:
        raise ValueError(f"rows_per_tile must be >= 1; got {rows_per_tile}")
    interpret = default_interpret(interpret)
    rows, heads, dim = q.shape
    num_pages, page_size, _ = k_cache.shape
    max_blocks = block_tables.shape[1]
    num_tokens = max_blocks * page_size
    tile_rows = 1 if query_seqs is None else rows_per_tile
    num_tiles = pl.cdiv(rows, tile_rows)
    if block_t is None:
        block_t = _MAX_BLOCK_T
        while block_t > chunk_t and num_tiles * pl.cdiv(num_tokens, block_t) < _MIN_PROGRAMS:
            block_t //= 2
    if chunk_t < MIN_DOT_DIM or chunk_t & (chunk_t - 1) or block_t % chunk_t or block_t & (block_t - 1):
        raise ValueError(f"need powers of two {MIN_DOT_DIM} <= chunk_t <= block_t, got {chunk_t=} {block_t=}")
    chunk_t = min(chunk_t, max(pow2_at_least(num_tokens), MIN_DOT_DIM))
    block_t = max(min(block_t, pow2_at_least(num_tokens)), chunk_t)
    num_splits = pl.cdiv(num_tokens, block_t)

    # The wider of the two (f32 > bf16 > fp8): jnp refuses to promote 8-bit floats implicitly. An fp8 x fp8 dot
    # stays fp8 in the kernel (16-byte key loads): `fp8_dot_nt` gets it fp8 wgmma, a plain dot f16 mma.sync.
    # Casting to f16 here got wgmma but 8-byte loads and measured 1.4x slower (H200, B=64 L=64K).
    compute_dtype = max(jnp.dtype(q.dtype), jnp.dtype(k_cache.dtype), key=lambda d: d.itemsize)
    # Zero heads with zero weight add relu(0) * 0 = 0; they lift Hi to a legal dot width. Pad rows (to whole
    # tiles) have length 0.
    padded_heads = max(pow2_at_least(heads), MIN_DOT_DIM)
    padded_rows = num_tiles * tile_rows - rows
    q = jnp.pad(q.astype(compute_dtype), ((0, padded_rows), (0, padded_heads - heads), (0, 0)))
    weights = jnp.pad(weights.astype(jnp.float32), ((0, padded_rows), (0, padded_heads - heads)))
    lens = jnp.pad(lens, (0, padded_rows))
    precision = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else lax.Precision.DEFAULT
    options = dict(page_size=page_size, max_blocks=max_blocks, chunk_t=chunk_t, precision=precision,
                   fp8_imprecise_acc=fp8_imprecise_acc if compute_dtype.itemsize == 1 else None)
    cache_specs = [
        pl.no_block_spec,  # k_cache as [pages * page, Di]: gathered by slot
        None if k_scale is None else pl.no_block_spec,  # k_scale as [pages * page]
        pl.no_block_spec,  # block_tables as [R * P] or [S * P]
    ]
    caches = (k_cache.reshape(num_pages * page_size, dim),
              None if k_scale is None else k_scale.reshape(num_pages * page_size),
              block_tables.reshape(-1))
    row_block = None if query_seqs is None else tile_rows  # q and weights: one row, or a tile of them
    if query_seqs is None:
        kernel, name = functools.partial(_indexer_kernel, **options), "indexer_logits"
        row_specs = [pl.BlockSpec((1,), lambda r, s: (r,))]  # lens
        row_inputs = (lens,)
        out_spec = pl.BlockSpec((None, block_t), lambda r, s: (r, s))
    else:
        kernel, name = functools.partial(_row_tile_kernel, **options), f"indexer_logits_tiled_{tile_rows=}"
        row_specs = [pl.BlockSpec((tile_rows,), lambda r, s: (r,))] * 2  # query_seqs, lens
        row_inputs = (jnp.pad(query_seqs, (0, padded_rows)), lens)
        out_spec = pl.BlockSpec((tile_rows, block_t), lambda r, s: (r, s))
    out = pl.pallas_call(
        kernel,
        grid=(num_tiles, num_splits),
        in_specs=[
            pl.BlockSpec((row_block, padded_heads, dim), lambda r, s: (r, 0, 0)),  # q
            pl.BlockSpec((row_block, padded_heads), lambda r, s: (r, 0)),  # weights
            *cache_specs,
            *row_specs,
        ],
        out_specs=out_spec,
        out_shape=jax.ShapeDtypeStruct((num_tiles * tile_rows, num_splits * block_t), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"{name}_{block_t=}_{chunk_t=}",
    )(q, weights, *caches, *row_inputs)
    # Only when rows are padded to whole tiles or the row width is not a multiple of block_t (never for
    # power-of-two max_blocks * page).
    return out if out.shape == (rows, num_tokens) else out[:rows, :num_tokens]
