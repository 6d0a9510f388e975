"""Lightning-indexer logits over a paged index-key cache: the Triton kernel.

Contract (`pallas_kernels.indexer_logits`, which hands this kernel the cache as keys and optional per-token
scales): q [R, I, J] (f32, bf16 or float8_e4m3fn), weights [R, I] f32 with every scale folded in,
k_cache [pages, B, J] (f32, bf16 or float8_e4m3fn), block_tables [R, P] int32 page ids,
lens [R] int32 local lengths (0 <= lens[r] <= P * B, computed on the host), optional
k_scale [pages, B] f32 per token. Returns f32 [R, P * B]:
`sum_i weights[r,i] * relu(q[r,i] . k_t) * k_scale[t]` for t < lens[r], -inf elsewhere.
Block-table entries past a row's length (-1 on pad rows) are never read, nor are keys past it. q and keys
are multiplied in the wider of their dtypes with f32 accumulation; f32 inputs use full-precision f32 dots. fp8 q
and fp8 keys run on fp8 tensor cores (wgmma) by default, accumulating `fp8_imprecise_acc` products at a time in
the tensor core's reduced-precision (truncated f32) accumulator as DeepGEMM's indexer does;
`fp8_imprecise_acc=None` multiplies them exactly as f16 instead (mma.sync, about half the rate). The wrapper pads
I to a power of two >= 16 with zero-weight heads; J must be a power of two >= 16 and tokens need no alignment
(any page size works). For fp8 keys with scales in pages of 64 tokens and J = 128 on Hopper, the TMA-pipelined
Mosaic GPU kernel (`_indexer_mosaic.py`) does the same fp8 tensor-core arithmetic as `fp8_imprecise_acc=128`.

Grid (R, ceil(P*B / block_t)): a program owns block_t tokens of one row and walks them in chunks
of chunk_t tokens; each chunk gathers its keys once ([chunk_t, J], one row per token through the block
table) and scores all heads with one dot [chunk_t, J] x [J, I]; relu, weights and the head sum stay in
registers. Chunks at or past the row's length only store -inf.
Letters: see the legend in `dcp_jax/__init__.py`.
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

MIN_DOT_DIM = 16  # smallest dimension (rows, columns or depth) of a Triton tensor-core dot
# Automatic block_t: long programs amortize the q load and pipeline their chunks, but at least about four
# programs per SM (132 on an H200) keep every SM streaming at small batch sizes.
_MAX_BLOCK_T, _MIN_PROGRAMS = 512, 512


def _indexer_kernel(q_ref, weights_ref, k_ref, k_scale_ref, block_tables_ref, lens_ref,  # inputs
                    out_ref,  # output
                    *, page_size: int, max_blocks: int, chunk_t: int, precision, fp8_imprecise_acc):
    row, split = pl.program_id(0), pl.program_id(1)
    block_t = out_ref.shape[0]
    start = split * block_t
    length = lens_ref[0]
    num_chunks = block_t // chunk_t
    num_valid = jnp.clip(pl.cdiv(length - start, chunk_t), 0, num_chunks)
    q = q_ref[...]  # [I, J]
    weights = weights_ref[...]  # [I]
    num_cols = k_ref.shape[1]
    cols = lax.broadcasted_iota(jnp.int32, (1, num_cols), 1)  # [1, J]

    def score_chunk(c, carry):
        t = start + c * chunk_t + lax.iota(jnp.int32, chunk_t)  # [chunk_t] token positions in the row
        is_valid = t < length
        # Masked loads: entries past the length (-1 page ids, tail keys) cost no memory traffic.
        page = plgpu.load(block_tables_ref.at[row * max_blocks + t // page_size], mask=is_valid, other=0)
        slot = page * page_size + t % page_size
        # A mask constant along J (a broadcast) keeps the row loads 16 bytes wide.
        row_mask = jnp.broadcast_to(is_valid[:, None], (chunk_t, num_cols))
        keys = plgpu.load(k_ref.at[slot[:, None], cols], mask=row_mask, other=jnp.zeros((), k_ref.dtype))
        if fp8_imprecise_acc is None:
            dots = lax.dot_general(keys.astype(q.dtype), q, (((1,), (1,)), ((), ())), precision=precision,
                                   preferred_element_type=jnp.float32)  # [chunk_t, I]
        else:
            dots = fp8_dot_nt(keys, q, max_num_imprecise_acc=fp8_imprecise_acc)
        logits = jnp.sum(jnp.maximum(dots, 0.0) * weights[None, :], axis=1)
        if k_scale_ref is not None:
            logits = logits * plgpu.load(k_scale_ref.at[slot], mask=is_valid, other=0.0)
        out_ref[pl.ds(c * chunk_t, chunk_t)] = jnp.where(is_valid, logits, -jnp.inf)
        return carry

    def store_empty_chunk(c, carry):
        out_ref[pl.ds(c * chunk_t, chunk_t)] = jnp.full((chunk_t,), -jnp.inf, jnp.float32)
        return carry

    lax.fori_loop(0, num_valid, score_chunk, None)
    lax.fori_loop(num_valid, num_chunks, store_empty_chunk, None)


def unsupported(q) -> list[str]:
    """Why this kernel does not take these inputs (empty: it does)."""
    dim = q.shape[-1]
    if dim < MIN_DOT_DIM or dim & (dim - 1):
        return [f"Di must be a power of two >= {MIN_DOT_DIM} (a Triton dot), got {q.shape=}"]
    return []


def pow2_at_least(n):
    return 1 << max(n - 1, 0).bit_length()


def indexer_logits(q, weights, k_cache, block_tables, lens, *, k_scale=None, interpret=None, block_t=None,
                   chunk_t=64, num_warps=4, num_stages=2, fp8_imprecise_acc=128):
    """Indexer logits f32 [R, P * B]; see the module docstring for the contract.

    Knobs: block_t tokens per program (None: the largest power of two <= 512 that still gives 512
    programs, so small batches fill the GPU), chunk_t tokens per dot (powers of two, chunk_t <= block_t; both
    shrink to fit short rows), num_warps and num_stages for Triton, fp8_imprecise_acc (fp8 q and keys only: None
    or >= 32, see the module docstring). Defaults from bench/bench_indexer.py on an H200 (docs/perf_indexer.md,
    "fp8 keys on fp8 tensor cores"):
    chunk_t and num_stages the fastest at fp8, 64 rows of 64K tokens; block_t <= 512 ties 1024 there and is faster
    at 8 rows.
    """
    if fp8_imprecise_acc is not None and fp8_imprecise_acc < MIN_IMPRECISE_ACC:
        raise ValueError(f"fp8_imprecise_acc must be None or >= {MIN_IMPRECISE_ACC}; got {fp8_imprecise_acc}")
    interpret = default_interpret(interpret)
    rows, heads, dim = q.shape
    num_pages, page_size, _ = k_cache.shape
    max_blocks = block_tables.shape[1]
    num_tokens = max_blocks * page_size
    if block_t is None:
        block_t = _MAX_BLOCK_T
        while block_t > chunk_t and rows * pl.cdiv(num_tokens, block_t) < _MIN_PROGRAMS:
            block_t //= 2
    if chunk_t < MIN_DOT_DIM or chunk_t & (chunk_t - 1) or block_t % chunk_t or block_t & (block_t - 1):
        raise ValueError(f"need powers of two {MIN_DOT_DIM} <= chunk_t <= block_t, got {chunk_t=} {block_t=}")
    chunk_t = min(chunk_t, max(pow2_at_least(num_tokens), MIN_DOT_DIM))
    block_t = max(min(block_t, pow2_at_least(num_tokens)), chunk_t)
    num_splits = pl.cdiv(num_tokens, block_t)

    # The wider of the two (f32 > bf16 > fp8): jnp refuses to promote 8-bit floats implicitly. An fp8 x fp8 dot
    # stays fp8 in the kernel (16-byte key loads): `fp8_dot_nt` gets it fp8 wgmma, a plain dot f16 mma.sync.
    # Casting to f16 here got wgmma but 8-byte loads and measured 1.4x slower (H200, 64 rows of 64K tokens).
    compute_dtype = max(jnp.dtype(q.dtype), jnp.dtype(k_cache.dtype), key=lambda d: d.itemsize)
    # Zero heads with zero weight add relu(0) * 0 = 0; they lift I to a legal dot width.
    padded_heads = max(pow2_at_least(heads), MIN_DOT_DIM)
    q = jnp.pad(q.astype(compute_dtype), ((0, 0), (0, padded_heads - heads), (0, 0)))
    weights = jnp.pad(weights.astype(jnp.float32), ((0, 0), (0, padded_heads - heads)))
    precision = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else lax.Precision.DEFAULT

    kernel = functools.partial(_indexer_kernel, page_size=page_size, max_blocks=max_blocks, chunk_t=chunk_t,
                               precision=precision,
                               fp8_imprecise_acc=fp8_imprecise_acc if compute_dtype.itemsize == 1 else None)
    out = pl.pallas_call(
        kernel,
        grid=(rows, num_splits),
        in_specs=[
            pl.BlockSpec((None, padded_heads, dim), lambda r, s: (r, 0, 0)),  # q
            pl.BlockSpec((None, padded_heads), lambda r, s: (r, 0)),  # weights
            pl.no_block_spec,  # k_cache as [pages * B, J]: gathered by slot
            None if k_scale is None else pl.no_block_spec,  # k_scale as [pages * B]
            pl.no_block_spec,  # block_tables as [R * P]
            pl.BlockSpec((1,), lambda r, s: (r,)),  # lens
        ],
        out_specs=pl.BlockSpec((None, block_t), lambda r, s: (r, s)),
        out_shape=jax.ShapeDtypeStruct((rows, num_splits * block_t), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"indexer_logits_{block_t=}_{chunk_t=}",
    )(
        q,
        weights,
        k_cache.reshape(num_pages * page_size, dim),
        None if k_scale is None else k_scale.reshape(num_pages * page_size),
        block_tables.reshape(rows * max_blocks),
        lens,
    )
    # Only when the row width is not a multiple of block_t (never for a power-of-two P * B).
    return out if out.shape[1] == num_tokens else out[:, :num_tokens]
