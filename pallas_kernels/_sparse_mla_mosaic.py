"""Sparse MLA decode for Hopper (sm_90) in Mosaic GPU: the fast path of `pallas_kernels.sparse_mla_decode` for bf16
and fp8 latent caches.

Same contract as the Triton kernel for a bf16 cache of 512 latent + 64 rope columns (q is cast to bf16). Per CTA,
one row, one split of its valid slots and 64 heads, with three warpgroups:
- a producer gathers each block of 64 slots' cache rows into one of two SMEM stages ([9 slabs, 64, 64],
  (8, 64)-tiled, 128B-swizzled) with cp.async, zero-filling rows past the split's end (one TMA per 128-byte
  row piece made the kernel 10x slower: docs/perf_sparse_mla.md);
- the scorer warpgroup computes the block's 64 x 64 scores (9 wgmmas of K=64) and the online softmax, writes
  the bf16 probabilities over the block's spent rope slab and the rescale factors to SMEM, and multiplies the
  probabilities by the first LEFT_SLABS value slabs;
- the second warpgroup multiplies the same probabilities, from SMEM, by the other value slabs.
Each score is computed once: both warpgroups computing them was 1.5x the tensor work (docs/perf_sparse_mla.md).
The output is rounded to bf16 in the kernel (as FlashMLA does); split-K partial results are merged by
`_lse.merge_splits`. An fp8 latent cache (`formats.Fp8LatentCache`; ue8m0 scales, so its values are exact in
bf16) is first gathered at each row's slots and dequantized into bf16 rows by XLA (`dequantized_selection`),
which the kernel reads as a bf16 cache: the bf16 cache's products, for one read of the 656-byte fp8 rows and a
write and read of 1152-byte bf16 ones (FlashMLA dequantizes inside its kernel instead). Mosaic GPU has no
interpreter for this kernel, so it runs on the GPU only; on CPU it can be lowered for CUDA (the tests do).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, memref, nvvm
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import formats
from pallas_kernels._lse import merge_splits
from pallas_kernels._platform import on_hopper_compiled
from pallas_kernels._sparse_mla_triton import default_num_splits, fp8_cache_rows

VALUE_DIM, ROPE_DIM = 512, 64
WIDTH = VALUE_DIM + ROPE_DIM
SLAB = 64  # columns per 128-byte swizzled slab of bf16
NUM_SLABS = WIDTH // SLAB  # 9: 8 value slabs, then the rope slab
BLOCK_S = 64  # slots per block: the K of the value wgmmas
STAGES = 2  # Q and two stages fill the 227 KB of SMEM
BLOCK_H = 64  # heads per CTA: one wgmma M
LEFT_SLABS = 3  # value slabs of the scorer; the second warpgroup takes the other 5 (4 + 4 was slower)
ROW_BYTES = WIDTH * 2
CHUNK = 16  # bytes per cp.async
COUNT_COLUMNS = 16  # counts travel as [R, 16] int32: a TMA row must be 16-byte aligned and 64 bytes suit it
MAX_SELECTION_BYTES = 1 << 30  # an fp8 cache's dequantized selection [R * S, 576] bf16 is at most this
LOG2E = math.log2(math.e)
COMPUTE_REGISTERS, PRODUCER_REGISTERS = 232, 40  # 2 * 232 + 40 warpgroup registers per thread fill 64K


def _tiled(tile):
    return plgpu.TilingTransform(tile), plgpu.SwizzleTransform(128)


def _cp_async_gather(kv_ref, slots_ref, info_ref, kv_smem):
    """The producer warpgroup copies the cache rows named by slots_ref [64] into kv_smem ([9, 64, 64],
    (8, 64)-tiled, 128B-swizzled) with cp.async, zero-filling rows at or past info_ref[0]; then waits for its
    copies and fences them for the async proxy (wgmma). The caller arrives on the stage's barrier.

    Warp w copies rows 16w .. 16w + 15; lane l copies 16-byte chunk l % 8 of each 128-byte line of rows
    16w + 4j + l // 8 (j < 4). So one warp instruction copies four whole lines, and each thread computes four
    row addresses once: each of its 36 copies is a row address plus a constant."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType(),
                                  plgpu.RefType(transforms=_tiled((8, SLAB)))))
    def gather(launch_ctx, kv_gmem, slots, info, smem):
        del launch_ctx
        i32, i64, i8 = (ir.IntegerType.get_signless(n) for n in (32, 64, 8))
        index = ir.IndexType.get()

        def const(value, ty=i32):
            return arith.constant(ty, value)

        tid = arith.andi(mgpu_utils.thread_idx(), const(127))
        first_row = arith.addi(arith.muli(arith.divui(tid, const(32)), const(16)),
                               arith.andi(arith.divui(tid, const(8)), const(3)))
        chunk = arith.andi(tid, const(7))  # 16-byte chunk within a 128-byte line
        limit = memref.load(info, [arith.constant(index, 0)])
        gmem_base = llvm.addrspacecast(llvm.PointerType.get(address_space=1), mgpu_utils.memref_ptr(kv_gmem))
        smem_base = mgpu_utils.memref_ptr(smem)
        for j in range(BLOCK_S // 16):
            row = arith.addi(first_row, const(4 * j))
            is_valid = arith.cmpi(arith.CmpIPredicate.slt, row, limit)
            slot = arith.select(is_valid, memref.load(slots, [arith.index_cast(index, row)]), const(0))
            src_row = mgpu_utils.getelementptr(
                gmem_base, [arith.addi(arith.muli(arith.extui(i64, slot), const(ROW_BYTES, i64)),
                                       arith.extui(i64, arith.muli(chunk, const(CHUNK))))], i8)
            swizzled = arith.xori(chunk, arith.andi(row, const(7)))
            dst_row = mgpu_utils.getelementptr(
                smem_base, [arith.addi(arith.muli(row, const(SLAB * 2)), arith.muli(swizzled, const(CHUNK)))], i8)
            size = arith.select(is_valid, const(CHUNK), const(0))  # 0: zero-fill, read nothing
            for slab in range(NUM_SLABS):  # a slab row is one 128-byte line of the cache row
                nvvm.CpAsyncOp(mgpu_utils.getelementptr(dst_row, [slab * BLOCK_S * SLAB * 2], i8),
                               mgpu_utils.getelementptr(src_row, [slab * SLAB * 2], i8),
                               CHUNK, nvvm.LoadCacheModifierKind.CG, cpSize=size)
        nvvm.cp_async_commit_group()
        nvvm.cp_async_wait_group(0)
        mgpu_utils.commit_shared()  # fence the copies for the async proxy, then a warpgroup barrier

    gather(kv_ref, slots_ref, info_ref, kv_smem)


def _kernel(q_ref, kv_ref, slots_ref, counts_ref, out_ref, lse_ref, scratch, *, scale, num_splits):
    (q_smem, kv_smem, meta_smem, row_stats,
     q_barrier, count_barrier, slots_barriers, kv_barriers, probs_barriers, consumed_barriers, done_barrier) = scratch
    # meta_smem rows 0 .. STAGES-1 hold each stage's slots; row STAGES holds the count (16 ints) and then each
    # stage's gather limit. row_stats rows 0 .. STAGES-1 hold each stage's rescale factors, row STAGES the
    # reciprocal row sums, row STAGES + 1 stages the lse.
    slots_smem = meta_smem.at[pl.ds(0, STAGES)]
    head_block, split, row = lax.axis_index("head_block"), lax.axis_index("split"), lax.axis_index("row")
    heads = pl.ds(head_block * BLOCK_H, BLOCK_H)
    wg = lax.axis_index("wg")
    max_slots = slots_ref.shape[1]
    row_vector = plgpu.Layout.WGMMA.reduce(1)

    @pl.when(wg == 0)
    def _load_count_and_q():  # a TMA destination must be 128-byte aligned: one count copy, every warpgroup waits
        plgpu.copy_gmem_to_smem(counts_ref.at[pl.ds(row, 1)], meta_smem.at[pl.ds(STAGES, 1), pl.ds(0, 16)],
                                count_barrier.at[0])
        for c in range(NUM_SLABS):
            plgpu.copy_gmem_to_smem(q_ref.at[row, heads, pl.ds(c * SLAB, SLAB)], q_smem.at[c], q_barrier.at[0])

    plgpu.barrier_wait(count_barrier.at[0])
    count = jnp.clip(meta_smem[STAGES, 0], 0, max_slots)
    # This split's share of [0, count): equal chunks rounded up to whole blocks, so trailing splits may be empty.
    chunk = lax.div(lax.div(count + num_splits - 1, num_splits) + BLOCK_S - 1, BLOCK_S) * BLOCK_S
    start = split * chunk
    length = jnp.maximum(jnp.minimum(start + chunk, count) - start, 0)
    num_blocks = lax.div(length + BLOCK_S - 1, BLOCK_S)

    def accumulate(accs, alpha, probs, stage, first_slab):
        """accs * alpha + probs @ value slabs first_slab ..., with one wgmma wait; probs in registers, or None
        for the stage's rope slab."""
        def values_dot(acc_refs):
            lhs = kv_smem.at[stage, NUM_SLABS - 1] if probs is None else probs
            for j, acc_ref in enumerate(acc_refs):
                plgpu.wgmma(acc_ref, lhs, kv_smem.at[stage, first_slab + j])

        accs = tuple(acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) for acc in accs)
        return pl.run_state(values_dot)(tuple(plgpu.ACC.init(acc) for acc in accs))

    def zeros(num_slabs):
        return tuple(plgpu.layout_cast(jnp.zeros((BLOCK_H, SLAB), jnp.float32), plgpu.Layout.WGMMA)
                     for _ in range(num_slabs))

    def store_output(accs, inv_l, first_slab):
        """Normalized bf16 output slabs, staged in Q's spent slabs (after done_barrier) and copied out."""
        plgpu.barrier_arrive(done_barrier.at[0])
        plgpu.barrier_wait(done_barrier.at[0])
        if inv_l is None:
            inv_l = plgpu.load(row_stats.at[STAGES], layout=row_vector)
        for j, acc in enumerate(accs):
            q_smem[first_slab + j] = (acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])).astype(jnp.bfloat16)
        plgpu.commit_smem()
        for j in range(len(accs)):
            plgpu.copy_smem_to_gmem(q_smem.at[first_slab + j],
                                    out_ref.at[row, split, heads, pl.ds((first_slab + j) * SLAB, SLAB)])

    @pl.when(wg == 0)
    def _score():
        plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
        plgpu.barrier_wait(q_barrier.at[0])

        def block_step(block, carry):
            accs, m_i, l_i = carry
            stage = lax.rem(block, STAGES)
            plgpu.barrier_wait(kv_barriers.at[stage])

            def scores_dot(acc_ref):
                for c in range(NUM_SLABS):
                    plgpu.wgmma(acc_ref, q_smem.at[c], kv_smem.at[stage, c].transpose((1, 0)))
                return acc_ref[...]

            # Scores in log2 units so the softmax uses exp2; every block holds a valid slot, so m_next is finite.
            scores = pl.run_scoped(scores_dot, plgpu.ACC((BLOCK_H, BLOCK_S), jnp.float32)) * scale
            slot_ids = plgpu.broadcasted_iota(jnp.int32, (BLOCK_H, BLOCK_S), 1, layout=plgpu.Layout.WGMMA)
            scores = jnp.where(block * BLOCK_S + slot_ids < length, scores, -jnp.inf)
            m_next = jnp.maximum(m_i, scores.max(axis=1))
            alpha = jnp.exp2(m_i - m_next)
            probs = jnp.exp2(scores - lax.broadcast_in_dim(m_next, scores.shape, [0]))
            l_next = l_i * alpha + probs.sum(axis=1)
            probs = probs.astype(jnp.bfloat16)
            kv_smem[stage, NUM_SLABS - 1] = probs  # the rope slab is spent once the scores are
            row_stats[stage] = alpha
            plgpu.commit_smem()
            plgpu.barrier_arrive(probs_barriers.at[stage])
            accs = accumulate(accs, alpha, probs, stage, 0)
            plgpu.barrier_arrive(consumed_barriers.at[stage])
            return accs, m_next, l_next

        m_i = plgpu.layout_cast(jnp.full((BLOCK_H,), -jnp.inf, jnp.float32), row_vector)
        l_i = plgpu.layout_cast(jnp.full((BLOCK_H,), 0.0, jnp.float32), row_vector)
        accs, m_i, l_i = lax.fori_loop(0, num_blocks, block_step, (zeros(LEFT_SLABS), m_i, l_i))
        # An empty split writes 0 and lse -inf.
        has_mass = l_i > 0
        inv_l = jnp.where(has_mass, 1.0 / jnp.where(has_mass, l_i, 1.0), 0.0)
        row_stats[STAGES] = inv_l
        row_stats[STAGES + 1] = jnp.where(has_mass, (m_i + jnp.log2(jnp.where(has_mass, l_i, 1.0))) / LOG2E,
                                          -jnp.inf)
        store_output(accs, inv_l, 0)
        plgpu.copy_smem_to_gmem(row_stats.at[STAGES + 1], lse_ref.at[row, split, heads])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _second():
        plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")

        def block_step(block, accs):  # the scorer waited for the stage before it published the probabilities
            stage = lax.rem(block, STAGES)
            plgpu.barrier_wait(probs_barriers.at[stage])
            alpha = plgpu.load(row_stats.at[stage], layout=row_vector)
            accs = accumulate(accs, alpha, None, stage, LEFT_SLABS)
            plgpu.barrier_arrive(consumed_barriers.at[stage])
            return accs

        store_output(lax.fori_loop(0, num_blocks, block_step, zeros(VALUE_DIM // SLAB - LEFT_SLABS)), None, LEFT_SLABS)
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _produce():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

        @pl.loop(0, num_blocks)
        def _gather(block):
            stage = lax.rem(block, STAGES)

            @pl.when(block >= STAGES)
            def _wait_consumed():
                plgpu.barrier_wait(consumed_barriers.at[stage])

            plgpu.copy_gmem_to_smem(slots_ref.at[row, pl.ds(start + block * BLOCK_S, BLOCK_S)],
                                    slots_smem.at[stage], slots_barriers.at[stage])
            plgpu.barrier_wait(slots_barriers.at[stage])
            meta_smem[STAGES, 16 + stage] = length - block * BLOCK_S
            _cp_async_gather(kv_ref, slots_smem.at[stage], meta_smem.at[STAGES, pl.ds(16 + stage, 1)],
                             kv_smem.at[stage])
            plgpu.barrier_arrive(kv_barriers.at[stage])


@functools.partial(jax.jit, static_argnames=("sm_scale", "num_splits"))
def sparse_mla_partials(q, kv_rows, slots, counts, *, sm_scale: float, num_splits: int):
    """The kernel on prepared inputs: q bf16 [R, H, 576] (H a multiple of 64), kv_rows bf16 [slots, 576],
    slots int32 [R, S] (S a multiple of 64), counts int32 [R, 16] (the count in column 0). Returns per-split
    out bf16 [R, N, H, 512] and lse f32 [R, N, H]."""
    rows, heads, _ = q.shape

    def entry(q_ref, kv_ref, slots_ref, counts_ref, out_ref, lse_ref):
        slabs = (STAGES, NUM_SLABS, BLOCK_S, SLAB)
        pl.run_scoped(
            lambda *scratch: _kernel(q_ref, kv_ref, slots_ref, counts_ref, out_ref, lse_ref, scratch,
                                     scale=sm_scale * LOG2E, num_splits=num_splits),
            plgpu.SMEM((NUM_SLABS, BLOCK_H, SLAB), jnp.bfloat16, transforms=_tiled((8, SLAB))),
            plgpu.SMEM(slabs, jnp.bfloat16, transforms=_tiled((8, SLAB))),
            plgpu.SMEM((STAGES + 1, BLOCK_S), jnp.int32),
            plgpu.SMEM((STAGES + 2, BLOCK_H), jnp.float32),
            plgpu.Barrier(num_arrivals=NUM_SLABS, num_barriers=1),  # one arrival per Q slab copy
            plgpu.Barrier(num_barriers=1),
            plgpu.Barrier(num_barriers=STAGES),
            plgpu.Barrier(num_barriers=STAGES),  # the producer arrives once per gathered block
            plgpu.Barrier(num_barriers=STAGES),  # the scorer arrives once a block's probabilities are in SMEM
            plgpu.Barrier(num_arrivals=2, num_barriers=STAGES),
            plgpu.Barrier(num_arrivals=2, num_barriers=1),
            collective_axes="wg",
        )

    return plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct((rows, num_splits, heads, VALUE_DIM), jnp.bfloat16),
                  jax.ShapeDtypeStruct((rows, num_splits, heads), jnp.float32)),
        grid=(heads // BLOCK_H, num_splits, rows), grid_names=("head_block", "split", "row"),
        num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
    )(q, kv_rows, slots, counts)


def unsupported(q, kv_cache, slots, value_dim: int, interpret: bool) -> list[str]:
    """Why this kernel does not take these inputs (empty: it does): it needs a bf16 cache of 512 + 64 columns, or
    an fp8 latent cache of those widths whose dequantized selection fits MAX_SELECTION_BYTES, compiled on an sm_90
    GPU."""
    reasons = []
    if isinstance(kv_cache, formats.Fp8LatentCache):
        try:
            if fp8_cache_rows(kv_cache, value_dim).shape[-1] != WIDTH:
                reasons.append(f"it needs an fp8 latent cache of {VALUE_DIM} + {ROPE_DIM} columns, got "
                               f"{kv_cache.latent.shape[-1]} + {kv_cache.rope.shape[-1]}")
        except ValueError as e:
            reasons.append(str(e))
        selection = slots.shape[0] * slots.shape[1] * ROW_BYTES
        if selection > MAX_SELECTION_BYTES:
            reasons.append(f"an fp8 latent cache's dequantized selection takes {selection / 2**30:.2f} GiB (R x S "
                           f"= {slots.shape[0]} x {slots.shape[1]} bf16 rows), above {MAX_SELECTION_BYTES >> 30} GiB")
    elif kv_cache.dtype != jnp.bfloat16:
        reasons.append(f"it needs a bf16 latent cache or an Fp8LatentCache, got {kv_cache.dtype}")
    if value_dim != VALUE_DIM or q.shape[-1] != WIDTH:
        reasons.append(f"it needs {VALUE_DIM} + {ROPE_DIM} columns, got {value_dim=} and q width {q.shape[-1]}")
    return reasons + on_hopper_compiled(interpret)


def dequantized_selection(cache: formats.Fp8LatentCache, slots, counts):
    """The bf16 rows [R * S, 576] of each row's slots in an fp8 latent cache (exact; past a row's count, slot 0's
    row, never read) and their slots [R, S]: row r's j-th at r * S + j."""
    rows, num_slots = slots.shape
    picked = jnp.where(jnp.arange(num_slots)[None, :] < counts[:, None], slots, 0)

    def gathered(part):  # [pages, B, ...] -> the slots' entries [R, S, ...]
        return part.reshape(-1, *part.shape[2:])[picked]

    # In bf16 throughout, and exact: an e4m3 value's 4 significant bits fit bf16's 8, the scales are powers of two.
    latent = gathered(cache.latent).astype(jnp.bfloat16)
    tiles = latent.reshape(rows, num_slots, -1, formats.LATENT_TILE) * gathered(cache.scales).astype(jnp.bfloat16)[
        ..., None]
    kv_rows = jnp.concatenate([tiles.reshape(latent.shape), gathered(cache.rope)], axis=-1)
    return kv_rows.reshape(rows * num_slots, WIDTH), jnp.arange(rows * num_slots, dtype=jnp.int32).reshape(
        rows, num_slots)


def sparse_mla_decode(q, kv_cache, slots, counts, sm_scale, *, value_dim=VALUE_DIM, num_splits=None):
    """The contract of `pallas_kernels.sparse_mla_decode` on this kernel (`unsupported` lists what it needs);
    out is rounded to bf16 in the kernel. num_splits: split-K programs per row (None: `default_num_splits`)."""
    del value_dim  # always VALUE_DIM here (`unsupported`)
    num_heads = q.shape[1]
    if isinstance(kv_cache, formats.Fp8LatentCache):
        kv_cache, slots = dequantized_selection(kv_cache, slots, counts)
    q, kv_rows, slots, counts = prepare(q, kv_cache, slots, counts)
    rows, padded_heads, _ = q.shape
    if num_splits is None:
        num_splits = default_num_splits(rows, padded_heads // BLOCK_H, slots.shape[1], BLOCK_S)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1; got {num_splits=}")
    outs, lses = sparse_mla_partials(q, kv_rows, slots, counts, sm_scale=float(sm_scale), num_splits=num_splits)
    out, lse = (outs[:, 0], lses[:, 0]) if num_splits == 1 else merge_splits(outs, lses)
    return out[:, :num_heads].astype(jnp.bfloat16), lse[:, :num_heads]


def prepare(q, kv_cache, slots, counts):
    """Pads the contract's inputs to the kernel's: heads to a multiple of 64 (zero queries), slots to a multiple
    of 64 (entries past the count are never read), counts to [R, 16] (clipped to [0, S]); q to bf16, the cache
    to rows."""
    heads, num_slots = q.shape[1], slots.shape[1]
    counts = jnp.clip(counts, 0, num_slots)  # counts above S act as S
    q = jnp.pad(q.astype(jnp.bfloat16), ((0, 0), (0, -heads % BLOCK_H), (0, 0)))
    slots = jnp.pad(slots, ((0, 0), (0, -num_slots % BLOCK_S)))
    counts = jnp.pad(counts[:, None], ((0, 0), (0, COUNT_COLUMNS - 1)))
    return q, kv_cache.reshape(-1, WIDTH), slots, counts
