"""Indexer logits for Hopper (sm_90) in Mosaic GPU: the fp8 fast path of `pallas_kernels.indexer_logits`, and of
`pallas_kernels.indexer_top_k` with the top-k's first pass fused in.

Same contract as the Triton kernel for fp8 (e4m3) queries and keys with per-token f32 key scales, pages of 64 tokens
and J = 128. Each CTA (one warpgroup) owns `pages_per_cta` consecutive block-table entries of `rows_per_cta`
consecutive rows (by default 2 in calls of at least `SHARED_ROWS_MIN` rows, a prefill chunk's, else 1):
- it copies the rows' block-table entries, queries and weights to SMEM by TMA, and reads their lengths itself;
- then it streams the valid pages (each one contiguous [64, 128] fp8 key tile and its 64 scales) through
  `stages` TMA buffers; a page is one wgmma [64 tokens, 128] x [128, I] on fp8 tensor cores (f32 accumulator,
  the tensor core's reduced-precision fp8 accumulation, as DeepGEMM's indexer and the Triton kernel's default);
  where the rows' block tables agree on the CTA's pages (a prefill chunk's rows: DeepGEMM's `fp8_mqa_logits`
  idea), each page is loaded once and its wgmma's columns hold all the rows' heads; otherwise row by row;
- relu, the weights, each row's head sum and the key scale stay in registers; the CTA's logits (-inf past each
  row's length) leave by one TMA store.
Optionally (`with_maxima`) it also stores the top-k keys of the maxima of each group of 16 tokens, which the top-k
(`_topk_triton.topk(group_maxima=)`) takes in place of its own maxima pass: a read of the whole logits row, 6 us at
64 rows of 64K tokens on an H200 (`indexer_top_k`). That needs T / 16 groups (T = the row's token width, P * B) to
be a power of two from k's next power of two (a floor from fewer groups would not bound the k-th score) up to
MAX_GROUPS (the top-k loads them all into each candidates program).
Pages past every length of a CTA's rows are never read. Mosaic GPU has no interpreter for TMA, so this kernel runs
on the GPU only; on CPU it can be lowered for CUDA (the tests do).
Letters: see the legend in `dcp_jax/__init__.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, memref, vector
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _topk_triton
from pallas_kernels._indexer_triton import MIN_DOT_DIM, pow2_at_least
from pallas_kernels._mosaic_scalars import read_ints
from pallas_kernels._platform import on_hopper_compiled

PAGE = 64  # tokens per page: one wgmma's rows
DIM = 128  # fp8 key bytes: one 128-byte swizzled row
MAX_HEADS = 256  # the most columns one wgmma takes
MAX_GROUPS = 8192  # group maxima the top-k loads into each of its candidates programs
GROUP_TOKENS = 16  # tokens per group of the fused group maxima: one warp's rows of a page's wgmma tile


def _tiled():
    return plgpu.TilingTransform((8, DIM)), plgpu.SwizzleTransform(DIM)


def _store_group_maxima(logits, maxima_ref):
    """maxima_ref[w] = the top-k key (`_topk_triton._to_key`) of the largest of logits[16w : 16w + 16], for each warp w.

    In the wgmma row layout warp w holds tokens 16w .. 16w + 15, two per thread (lane // 4 and lane // 4 + 8),
    each replicated over a quad: a max of the two and three butterfly shuffles give the warp's maximum."""

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA.reduce(1), plgpu.RefType()))
    def store(launch_ctx, logits, maxima):
        del launch_ctx
        i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
        values = [vector.extract(r, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([0]))
                  for r in logits.registers.flat]
        largest = values[0]
        for value in values[1:]:
            largest = arith.maximumf(largest, value)
        for distance in (4, 8, 16):
            largest = arith.maximumf(largest, mgpu_utils.shfl_bfly(largest, distance))
        bits = arith.bitcast(i32, largest)
        is_negative = arith.cmpi(arith.CmpIPredicate.slt, bits, mgpu_utils.c(0, i32))
        key = arith.select(is_negative, arith.xori(bits, mgpu_utils.c(0x7FFFFFFF, i32)), bits)
        tid = mgpu_utils.thread_idx()
        is_first_lane = arith.cmpi(arith.CmpIPredicate.eq, arith.andi(tid, mgpu_utils.c(31, i32)),
                                   mgpu_utils.c(0, i32))
        warp = arith.andi(arith.shrui(tid, mgpu_utils.c(5, i32)), mgpu_utils.c(3, i32))
        with mgpu_utils.when(is_first_lane):
            memref.store(key, maxima, [arith.index_cast(index, warp)])

    store(logits, maxima_ref)


def _kernel(q_ref, weights_ref, keys_ref, scales_ref, tables_ref, lens_ref, out_ref, maxima_ref, scratch, *,
            pages_per_cta: int, stages: int, rows_per_cta: int, with_maxima: bool):
    (q_smem, weights_smem, keys_smem, scales_smem, tables_smem, lens_smem, out_smem, maxima_smem,
     meta_barrier, query_barrier, page_barriers) = scratch
    split, group = lax.axis_index("split"), lax.axis_index("group")
    first_page, first_row = split * pages_per_cta, group * rows_per_cta
    heads = q_smem.shape[0] // rows_per_cta  # a row's (padded) heads
    plgpu.copy_gmem_to_smem(tables_ref.at[pl.ds(first_row, rows_per_cta), pl.ds(first_page, pages_per_cta)],
                            tables_smem, meta_barrier.at[0])
    plgpu.copy_gmem_to_smem(q_ref.at[group], q_smem, query_barrier.at[0])
    plgpu.copy_gmem_to_smem(weights_ref.at[pl.ds(group, 1)], weights_smem, query_barrier.at[0])
    read_ints(lens_ref.at[pl.ds(first_row, rows_per_cta)], lens_smem)  # while the TMAs fly
    plgpu.barrier_wait(meta_barrier.at[0])
    # Tokens of each row from this CTA's first one on (lens clipped to the tables' tokens), and the pages holding
    # any of them.
    max_len = tables_ref.shape[1] * PAGE
    remaining = [jnp.minimum(lens_smem[g], max_len) - first_page * PAGE for g in range(rows_per_cta)]
    valid_pages = [jnp.clip(lax.div(r + PAGE - 1, PAGE), 0, pages_per_cta) for r in remaining]
    token_layout = plgpu.Layout.WGMMA.reduce(1)
    plgpu.barrier_wait(query_barrier.at[0])

    def score_pages(table_row: int, rows: list[int]):
        """Streams the pages of tables_smem[table_row] that hold tokens of any of `rows` (group rows whose
        block tables equal it here) and stores those rows' logits: one wgmma [64 tokens, 128] x [128, heads of
        the rows], their q stacked in q_smem."""
        num_valid = functools.reduce(jnp.maximum, [valid_pages[g] for g in rows])
        columns = pl.ds(rows[0] * heads, len(rows) * heads)  # the rows are consecutive
        weights = plgpu.load(weights_smem.at[0, columns], layout=plgpu.Layout.WGMMA.reduce(0))
        weights = lax.broadcast_in_dim(weights, (PAGE, len(rows) * heads), [1])

        def fetch(i):  # page i of the CTA into stage i % stages
            stage = lax.rem(i, stages)
            page = tables_smem[table_row, i]
            plgpu.copy_gmem_to_smem(keys_ref.at[page], keys_smem.at[stage], page_barriers.at[stage])
            plgpu.copy_gmem_to_smem(scales_ref.at[pl.ds(page, 1)], scales_smem.at[pl.ds(stage, 1)],
                                    page_barriers.at[stage])

        for i in range(stages):
            pl.when(i < num_valid)(functools.partial(fetch, i))

        @pl.loop(0, num_valid)
        def _score_page(i):
            stage = lax.rem(i, stages)
            plgpu.barrier_wait(page_barriers.at[stage])

            def dot(acc_ref):
                plgpu.wgmma(acc_ref, keys_smem.at[stage], q_smem.at[columns].transpose((1, 0)))
                return acc_ref[...]

            dots = pl.run_scoped(dot, plgpu.ACC((PAGE, len(rows) * heads), jnp.float32))  # [tokens, heads]
            weighted = jnp.maximum(dots, 0.0) * weights
            scales = plgpu.load(scales_smem.at[stage], layout=token_layout)
            tokens = plgpu.broadcasted_iota(jnp.int32, (PAGE,), 0, layout=token_layout)
            for j, g in enumerate(rows):
                logits = jnp.sum(weighted[:, j * heads:(j + 1) * heads], axis=1) * scales
                logits = jnp.where(i * PAGE + tokens < remaining[g], logits, -jnp.inf)
                out_smem[g, i] = logits
                if with_maxima:
                    _store_group_maxima(logits, maxima_smem.at[g, i])
            # Every thread has read the stage (keys by the awaited wgmma, scales above): refill it.
            plgpu.commit_smem()
            pl.when(i + stages < num_valid)(lambda: fetch(i + stages))

        @pl.loop(num_valid, pages_per_cta)
        def _empty_page(i):
            empty = plgpu.layout_cast(jnp.full((PAGE,), -jnp.inf, jnp.float32), token_layout)
            for g in rows:
                out_smem[g, i] = empty
                if with_maxima:
                    _store_group_maxima(empty, maxima_smem.at[g, i])

    # Rows whose block tables agree on this CTA's pages (a prefill chunk's rows) share each page's load and wgmma;
    # otherwise (decode rows of different sequences) each row streams its own pages.
    if rows_per_cta == 1:
        score_pages(0, [0])
    else:
        shared = functools.reduce(jnp.logical_and, [tables_smem[g, i] == tables_smem[0, i]
                                                     for g in range(1, rows_per_cta) for i in range(pages_per_cta)])
        pl.when(shared)(lambda: score_pages(0, list(range(rows_per_cta))))

        @pl.when(jnp.logical_not(shared))
        def _row_by_row():
            for g in range(rows_per_cta):
                score_pages(g, [g])

    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, out_ref.at[pl.ds(first_row, rows_per_cta), pl.ds(first_page, pages_per_cta)])
    if with_maxima:
        plgpu.copy_smem_to_gmem(maxima_smem,
                                maxima_ref.at[pl.ds(first_row, rows_per_cta), pl.ds(first_page, pages_per_cta)])
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("pages_per_cta", "stages", "rows_per_cta", "with_maxima"))
def indexer_logits_pages(q, weights, keys, scales, tables, lens, *, pages_per_cta: int, stages: int,
                         rows_per_cta: int = 1, with_maxima: bool = False):
    """The kernel on prepared inputs: q fp8 [R, I, 128], weights f32 [R, I], keys fp8 [pages, 64, 128],
    scales f32 [pages, 64], tables int32 [R, P] (P a multiple of pages_per_cta), lens int32 [R] (clipped to
    [0, P * 64] here); R a multiple of rows_per_cta, rows_per_cta * I at most MAX_HEADS.
    Returns the logits f32 [R, P, 64]; with_maxima also the top-k keys (`_topk_triton._to_key`) of the maxima of
    each row's groups of 16 consecutive tokens, int32 [R, P, 4] (the key of -inf for groups past the length)."""
    rows, heads, _ = q.shape
    num_blocks = tables.shape[1]
    logits_type = jax.ShapeDtypeStruct((rows, num_blocks, PAGE), jnp.float32)
    groups_per_page = PAGE // GROUP_TOKENS
    if with_maxima:
        out_type = (logits_type, jax.ShapeDtypeStruct((rows, num_blocks, groups_per_page), jnp.int32))
        maxima_scratch = plgpu.SMEM((rows_per_cta, pages_per_cta, groups_per_page), jnp.int32)
    else:
        out_type, maxima_scratch = logits_type, None
    group_heads = rows_per_cta * heads
    q = q.reshape(rows // rows_per_cta, group_heads, DIM)  # a group's queries stacked: one wgmma's columns
    weights = weights.reshape(rows // rows_per_cta, group_heads)

    def indexer_logits_mosaic(*refs):  # the kernel's name in profiles
        if not with_maxima:
            refs = (*refs, None)
        pl.run_scoped(
            lambda *scratch: _kernel(*refs, scratch, pages_per_cta=pages_per_cta, stages=stages,
                                     rows_per_cta=rows_per_cta, with_maxima=with_maxima),
            plgpu.SMEM((group_heads, DIM), jnp.float8_e4m3fn, transforms=_tiled()),
            plgpu.SMEM((1, group_heads), jnp.float32),
            plgpu.SMEM((stages, PAGE, DIM), jnp.float8_e4m3fn, transforms=_tiled()),
            plgpu.SMEM((stages, PAGE), jnp.float32),
            plgpu.SMEM((rows_per_cta, pages_per_cta), jnp.int32),  # block-table entries
            plgpu.SMEM((rows_per_cta,), jnp.int32),  # lens
            plgpu.SMEM((rows_per_cta, pages_per_cta, PAGE), jnp.float32),
            maxima_scratch,
            plgpu.Barrier(num_barriers=1),  # the block-table entries
            plgpu.Barrier(num_arrivals=2, num_barriers=1),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # keys and scales of a page
        )

    return plgpu.kernel(
        indexer_logits_mosaic,
        out_type=out_type,
        grid=(num_blocks // pages_per_cta, rows // rows_per_cta), grid_names=("split", "group"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(q, weights, keys, scales, tables, lens)


def unsupported(q, k_cache, k_scale, interpret: bool | None) -> list[str]:
    """Why this kernel does not take these inputs (empty: it does): fp8 q and keys with per-token scales, pages
    of 64 tokens, J = 128, at most 256 heads, compiled on an sm_90 GPU."""
    fp8 = jnp.dtype(jnp.float8_e4m3fn)
    reasons = []
    if k_scale is None or q.dtype != fp8 or k_cache.dtype != fp8:
        reasons.append(f"it needs fp8 queries and an fp8 index cache (Fp8IndexKeys), got q {q.dtype} and keys "
                       f"{k_cache.dtype}{'' if k_scale is not None else ' without scales'}")
    if k_cache.shape[1:] != (PAGE, DIM) or q.shape[1] > MAX_HEADS:
        reasons.append(f"it needs pages of {PAGE} tokens of Di = {DIM} and at most {MAX_HEADS} heads, got "
                       f"{k_cache.shape=} and {q.shape[1]} heads")
    return reasons + on_hopper_compiled(interpret)


def prepare(weights, block_tables, lens, pages_per_cta: int):
    """Pads the contract's inputs to the kernel's: block tables to a multiple of pages_per_cta entries (never
    read; lens are then clipped to P * 64, as the kernel clips them to the padded width); weights to f32."""
    num_blocks = block_tables.shape[1]
    if num_blocks % pages_per_cta:
        lens = jnp.minimum(lens, num_blocks * PAGE)
        block_tables = jnp.pad(block_tables, ((0, 0), (0, -num_blocks % pages_per_cta)))
    return weights.astype(jnp.float32), block_tables, lens


# CTAs own up to 16 pages (1024 tokens), fewer while that gives under 1024 CTAs (several per SM).
_MAX_PAGES_PER_CTA, _MIN_CTAS = 16, 1024
# Calls of at least this many rows (the engine's steps of a 2048-token prefill chunk; not its two-batch-overlap halves,
# nor steps under a smaller token budget) score rows in pairs: a 2048-token chunk causal to 32K took 1244.6 us against
# 1402.3 one row a CTA, and four rows 1283.2 (H100; docs/perf_indexer.md, "Rows of a prefill chunk in one CTA:
# `rows_per_cta`"). Decode rows were not timed in pairs (a pair of two sequences' rows runs row by row on half the
# CTAs), so smaller calls keep one row a CTA.
SHARED_ROWS_MIN = 2048


def default_rows_per_cta(rows: int, padded_heads: int) -> int:
    """2 for calls of at least SHARED_ROWS_MIN rows whose pairs' heads fit one wgmma's columns, else 1."""
    return 2 if rows >= SHARED_ROWS_MIN and 2 * padded_heads <= MAX_HEADS else 1


def _logits(q, weights, k_cache, k_scale, block_tables, lens, pages_per_cta, stages, rows_per_cta, with_maxima):
    rows, heads, _ = q.shape
    max_blocks = block_tables.shape[1]
    padded_heads = max(pow2_at_least(heads), MIN_DOT_DIM)  # zero-weight heads add nothing
    if rows_per_cta is None:
        rows_per_cta = default_rows_per_cta(rows, padded_heads)
    if rows_per_cta < 1 or rows_per_cta * padded_heads > MAX_HEADS:
        raise ValueError(f"need rows_per_cta >= 1 with rows_per_cta x {padded_heads} padded heads <= {MAX_HEADS}; "
                         f"got {rows_per_cta=}")
    groups = pl.cdiv(rows, rows_per_cta)
    if pages_per_cta is None:
        pages_per_cta = _MAX_PAGES_PER_CTA
        while pages_per_cta > 4 and groups * pl.cdiv(max_blocks, pages_per_cta) < _MIN_CTAS:
            pages_per_cta //= 2
    if pages_per_cta < 4 or pages_per_cta & (pages_per_cta - 1) or stages < 1:
        raise ValueError(f"need pages_per_cta a power of two >= 4 and stages >= 1; got {pages_per_cta=} {stages=}")
    extra_rows = groups * rows_per_cta - rows  # zero queries of length 0; the last row's table keeps it shared
    if extra_rows or padded_heads != heads:
        q = jnp.pad(q, ((0, extra_rows), (0, padded_heads - heads), (0, 0)))
        weights = jnp.pad(weights, ((0, extra_rows), (0, padded_heads - heads)))
    if extra_rows:
        block_tables = jnp.pad(block_tables, ((0, extra_rows), (0, 0)), mode="edge")
        lens = jnp.pad(lens, (0, extra_rows))
    weights, tables, lens = prepare(weights, block_tables, lens, pages_per_cta)
    outs = indexer_logits_pages(q, weights, k_cache, k_scale, tables, lens, pages_per_cta=pages_per_cta,
                                stages=stages, rows_per_cta=rows_per_cta, with_maxima=with_maxima)
    # Rows of whole pages (groups), minus the row and block-table padding.
    return tuple(out[:rows].reshape(rows, -1)[:, :max_blocks * out.shape[2]]
                 for out in (outs if with_maxima else (outs,)))


def indexer_logits(q, weights, k_cache, block_tables, lens, *, k_scale, pages_per_cta=None, stages=4,
                   rows_per_cta=None):
    """The contract of the Triton kernel on this one (`unsupported` lists what it needs). Knobs: pages_per_cta
    (None: the largest power of two <= 16 that still gives 1024 CTAs), stages (TMA page buffers per CTA),
    rows_per_cta (consecutive rows a CTA scores: where their block tables agree on its pages, as a prefill
    chunk's rows do, each page is loaded once and one wgmma scores all of them, their heads side by side in its
    columns; elsewhere row by row. None: `default_rows_per_cta`)."""
    return _logits(q, weights, k_cache, k_scale, block_tables, lens, pages_per_cta, stages, rows_per_cta,
                   with_maxima=False)[0]


def indexer_logits_and_group_maxima(q, weights, k_cache, block_tables, lens, *, k_scale, pages_per_cta=None,
                                    stages=4, rows_per_cta=None):
    """(indexer_logits(...), the top-k keys of the maxima of each row's groups of 16 consecutive tokens int32
    [R, P * 4]): the top-k's `group_maxima`; groups past a row's length hold the key of -inf."""
    return _logits(q, weights, k_cache, k_scale, block_tables, lens, pages_per_cta, stages, rows_per_cta,
                   with_maxima=True)


def fuses_group_maxima(k_cache, block_tables, k: int) -> bool:
    """Whether `indexer_top_k` hands the top-k this kernel's group maxima for these shapes."""
    groups = block_tables.shape[1] * k_cache.shape[1] // GROUP_TOKENS
    return _topk_triton.next_pow2(k) <= groups <= MAX_GROUPS and not groups & (groups - 1)


def indexer_top_k(q, weights, k_cache, block_tables, lens, *, k: int, k_scale, sorted=True, pages_per_cta=None,
                  stages=4, rows_per_cta=None):
    """Top-k of this kernel's logits: the top-k's maxima pass fused in where `fuses_group_maxima`, else this
    kernel's logits through the whole Triton top-k. Knobs as `indexer_logits` (rows_per_cta None:
    `default_rows_per_cta`)."""
    knobs = dict(k_scale=k_scale, pages_per_cta=pages_per_cta, stages=stages, rows_per_cta=rows_per_cta)
    if fuses_group_maxima(k_cache, block_tables, k):
        logits, maxima = indexer_logits_and_group_maxima(q, weights, k_cache, block_tables, lens, **knobs)
        return _topk_triton.topk(logits, lens, k, sorted=sorted, interpret=False, group_maxima=maxima)
    logits = indexer_logits(q, weights, k_cache, block_tables, lens, **knobs)
    return _topk_triton.topk(logits, lens, k, sorted=sorted, interpret=False)
