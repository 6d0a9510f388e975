"""GPU probe for issue 4: a first warp-specialized sparse MLA decode kernel in Mosaic GPU (not wired anywhere).

The design of docs/perf_sparse_mla.md ("A first Mosaic kernel to try"), bf16 only, no split-K:
- one CTA per (64-head block, row); three warpgroups: two compute, one producer;
- the producer gathers each block of 64 slots into a double-buffered K buffer [9 slabs, 64 slots, 64], (8, 64)-
  tiled and 128B-swizzled, which the compute warpgroups read. Two ways (`--gather`):
  `tma`: one 128-byte TMA per (slot, slab) into a (1, 64)-tiled view of the same bytes (a plgpu.RefUnion); a
  slot past the row's count is pointed past the cache, so the TMA fills its row with zeros;
  `cp_async`: each of the producer's 128 threads copies 36 16-byte chunks with cp.async to the swizzled
  addresses it computes (zero-filled past the count), then waits, fences and arrives once;
  `none`: the producer only arrives, which times the compute alone (the check then fails);
- scores (`--scores`): `both`: each compute warpgroup computes all 64 x 64 scores (9 wgmmas of K=64) and the
  online softmax itself (1.53x the tensor work); `handoff`: warpgroup 0 does, and hands the bf16 probabilities
  and rescale factors to warpgroup 1 through SMEM (FlashMLA's split). Each warpgroup multiplies P by its 4 value
  slabs (256 columns).
Output: out bf16 [R, H, 512] and lse f32 [R, H] (natural log), compared with reference.sparse_mla_decode.
`--lower` only lowers it for CUDA (works on the CPU venv; the CPU test suite does this).
Run: PYTHONPATH=. python3 bench/probe_mgpu_sparse_mla.py [--gather tma|cp_async|none] [--scores both|handoff] [--lower]
"""

import math
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, memref, nvvm
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import reference

VALUE_DIM, ROPE_DIM = 512, 64
WIDTH = VALUE_DIM + ROPE_DIM
SLAB = 64  # columns per 128-byte swizzled slab of bf16
NUM_SLABS = WIDTH // SLAB  # 9: 8 value slabs, then the rope slab
BLOCK_S = 64  # slots per block (the K of the value wgmmas, which Mosaic wants a multiple of 64)
STAGES = 2  # K buffers: two fill the 227 KB of SMEM with Q
BLOCK_H = 64  # heads per CTA (one wgmma M)
LOG2E = math.log2(math.e)


def _tiled(tile):
    return plgpu.TilingTransform(tile), plgpu.SwizzleTransform(128)


CHUNK = 16  # bytes per cp.async
ROW_BYTES = WIDTH * 2


def _cp_async_gather(kv_ref, slots_ref, info_ref, kv_smem):
    """The producer warpgroup copies rows slots[base : base + 64] of the cache into kv_smem ([9, 64, 64],
    (8, 64)-tiled, 128B-swizzled) with cp.async, zero-filling rows at or past `limit`, where info = [limit,
    base]; then waits for its copies and fences them for the async proxy (wgmma). The caller arrives on the
    stage's barrier.

    Warp w copies rows 16w .. 16w + 15; its lane l copies 16-byte chunk l % 8 of each 128-byte line of rows
    16w + 4j + l // 8 (j < 4). So one warp instruction copies four whole lines, and each thread computes four
    row addresses once: every one of its 36 copies is a row address plus a constant."""

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
        limit_value = memref.load(info, [arith.constant(index, 0)])
        base = memref.load(info, [arith.constant(index, 1)])
        gmem_base = llvm.addrspacecast(llvm.PointerType.get(address_space=1), mgpu_utils.memref_ptr(kv_gmem))
        smem_base = mgpu_utils.memref_ptr(smem)
        for j in range(BLOCK_S // 16):
            row = arith.addi(first_row, const(4 * j))
            is_valid = arith.cmpi(arith.CmpIPredicate.slt, row, limit_value)
            slot = memref.load(slots, [arith.index_cast(index, arith.select(is_valid, arith.addi(base, row), base))])
            slot = arith.select(is_valid, slot, const(0))
            src_row = mgpu_utils.getelementptr(
                gmem_base, [arith.addi(arith.muli(arith.extui(i64, slot), const(ROW_BYTES, i64)),
                                       arith.extui(i64, arith.muli(chunk, const(CHUNK))))], i8)
            swizzled = arith.xori(chunk, arith.andi(row, const(7)))
            dst_row = mgpu_utils.getelementptr(
                smem_base, [arith.addi(arith.muli(row, const(SLAB * 2)), arith.muli(swizzled, const(CHUNK)))], i8)
            size = arith.select(is_valid, const(CHUNK), const(0))
            for slab in range(NUM_SLABS):  # a slab row is one 128-byte line of the cache row
                nvvm.CpAsyncOp(mgpu_utils.getelementptr(dst_row, [slab * BLOCK_S * SLAB * 2], i8),
                               mgpu_utils.getelementptr(src_row, [slab * SLAB * 2], i8),
                               CHUNK, nvvm.LoadCacheModifierKind.CG, cpSize=size)
        nvvm.cp_async_commit_group()
        nvvm.cp_async_wait_group(0)
        mgpu_utils.commit_shared()  # fence the copies for the async proxy, then a warpgroup barrier

    gather(kv_ref, slots_ref, info_ref, kv_smem)


LINE = 128  # bytes per L2 line
LINES_PER_ROW = ROW_BYTES // LINE  # 9


def _l2_prefetch(kv_ref, slots_ref, info_ref):
    """The producer warpgroup asks L2 for rows slots[base : base + 64] of the cache (rows at or past `limit`
    skipped), where info = [limit, base]: one `prefetch.global.L2` per 128-byte line, no SMEM, no wait."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType()))
    def prefetch(launch_ctx, kv_gmem, slots, info):
        del launch_ctx
        i32, i64, i8 = (ir.IntegerType.get_signless(n) for n in (32, 64, 8))
        index = ir.IndexType.get()

        def const(value, ty=i32):
            return arith.constant(ty, value)

        tid = arith.andi(mgpu_utils.thread_idx(), const(127))
        limit_value = memref.load(info, [arith.constant(index, 0)])
        base = memref.load(info, [arith.constant(index, 1)])
        gmem_base = llvm.addrspacecast(llvm.PointerType.get(address_space=1), mgpu_utils.memref_ptr(kv_gmem))
        for u in range(-(-BLOCK_S * LINES_PER_ROW // 128)):
            line = arith.addi(tid, const(128 * u))
            row = arith.divui(line, const(LINES_PER_ROW))
            col = arith.remui(line, const(LINES_PER_ROW))
            is_valid = arith.andi(arith.cmpi(arith.CmpIPredicate.slt, row, limit_value),
                                  arith.cmpi(arith.CmpIPredicate.slt, row, const(BLOCK_S)))
            slot = memref.load(slots, [arith.index_cast(index, arith.select(is_valid, arith.addi(base, row), base))])
            gmem_offset = arith.addi(arith.muli(arith.extui(i64, slot), const(ROW_BYTES, i64)),
                                     arith.extui(i64, arith.muli(col, const(LINE))))
            mgpu_utils.inline_ptx("prefetch.global.L2 [$0];", mgpu_utils.getelementptr(gmem_base, [gmem_offset], i8),
                                  predicate=is_valid, has_side_effects=True)

    prefetch(kv_ref, slots_ref, info_ref)


def sparse_mla_decode(q, kv, slots, counts, sm_scale, gather="tma", scores_by="both", slots_once=False,
                      compute=True, prefetch_blocks=0):
    """q [R, H, 576] bf16, kv [num_slots, 576] bf16, slots [R, S] int32 (S a multiple of 64), counts [R, 16]
    int32 (count in column 0: a 64-byte row for the TMA). Returns out bf16 [R, H, 512], lse f32 [R, H]."""
    if gather not in ("tma", "cp_async", "none"):
        raise ValueError(f"gather must be 'tma', 'cp_async' or 'none'; got {gather!r}")
    if scores_by not in ("both", "handoff"):
        raise ValueError(f"scores_by must be 'both' or 'handoff'; got {scores_by!r}")
    if prefetch_blocks and not (slots_once and gather == "cp_async"):
        raise ValueError("prefetch_blocks needs slots_once and gather='cp_async'")
    if slots.shape[1] % BLOCK_S:
        raise ValueError(f"S must be a multiple of {BLOCK_S}; got {slots.shape=}")
    rows, heads, _ = q.shape
    num_slots = kv.shape[0]
    max_slots = slots.shape[1]
    scale = sm_scale * LOG2E

    def kernel(q_ref, kv_ref, slots_ref, counts_ref, out_ref, lse_ref, scratch):
        (q_smem, kv_buffers, meta_smem, row_stats, probs_smem, all_slots,
         q_barrier, count_barrier, slots_barriers, kv_barriers, consumed_barriers, done_barrier,
         probs_ready_barrier, probs_consumed_barrier) = scratch
        # Small buffers share two allocations (each SMEM allocation is padded to 1 KB): meta_smem rows 0 ..
        # STAGES-1 hold each stage's slots, row `STAGES` the count (16 ints) and then the per-stage valid-row
        # limits; row_stats rows hold the lse, the rescale factors and the row sums.
        slots_smem = meta_smem.at[pl.ds(0, STAGES)]
        lse_smem, alpha_smem, l_smem = (row_stats.at[i] for i in range(3))
        rows_view, mma_view = kv_buffers if gather == "tma" else (None, kv_buffers)
        head_block, row = lax.axis_index("head_block"), lax.axis_index("row")
        heads_slice = pl.ds(head_block * BLOCK_H, BLOCK_H)
        wg = lax.axis_index("wg")

        # Warpgroup 0 copies the count into the first 16 ints of row STAGES (a TMA destination must be 128-byte
        # aligned); every warpgroup waits for it.
        @pl.when(wg == 0)
        def _load_count():
            plgpu.copy_gmem_to_smem(counts_ref.at[pl.ds(row, 1)], meta_smem.at[pl.ds(STAGES, 1), pl.ds(0, 16)],
                                    count_barrier.at[0])

        plgpu.barrier_wait(count_barrier.at[0])
        count = jnp.clip(meta_smem[STAGES, 0], 0, max_slots)
        num_blocks = lax.div(count + BLOCK_S - 1, BLOCK_S)

        def init_carry():
            row_vector = plgpu.Layout.WGMMA.reduce(1)
            m_i = plgpu.layout_cast(jnp.full((BLOCK_H,), -jnp.inf, jnp.float32), row_vector)
            l_i = plgpu.layout_cast(jnp.full((BLOCK_H,), 0.0, jnp.float32), row_vector)
            accs = tuple(plgpu.layout_cast(jnp.zeros((BLOCK_H, SLAB), jnp.float32), plgpu.Layout.WGMMA)
                         for _ in range(4))
            return accs, m_i, l_i

        def softmax_block(block, stage, m_i, l_i):
            """Scores of one block (9 wgmmas), masked past the count; the online-softmax update."""
            def scores_dot(acc_ref):
                for c in range(NUM_SLABS):
                    plgpu.wgmma(acc_ref, q_smem.at[c], mma_view.at[stage, c].transpose((1, 0)))
                return acc_ref[...]

            scores = pl.run_scoped(scores_dot, plgpu.ACC((BLOCK_H, BLOCK_S), jnp.float32))
            slot_ids = plgpu.broadcasted_iota(jnp.int32, (BLOCK_H, BLOCK_S), 1, layout=plgpu.Layout.WGMMA)
            scores = jnp.where(block * BLOCK_S + slot_ids < count, scores * scale, -jnp.inf)
            m_next = jnp.maximum(m_i, scores.max(axis=1))
            alpha = jnp.exp2(m_i - m_next)
            probs = jnp.exp2(scores - lax.broadcast_in_dim(m_next, scores.shape, [0]))
            return probs.astype(jnp.bfloat16), alpha, m_next, l_i * alpha + probs.sum(axis=1)

        def values_block(accs, alpha, probs, stage, first_slab):
            """accs * alpha + probs @ value slabs first_slab .. first_slab + 3 (probs in registers or SMEM)."""
            new_accs = []
            for j in range(4):
                acc = accs[j] * lax.broadcast_in_dim(alpha, accs[j].shape, [0])

                def values_dot(acc_ref, j=j):
                    plgpu.wgmma(acc_ref, probs, mma_view.at[stage, first_slab + j])

                new_accs.append(pl.run_state(values_dot)(plgpu.ACC.init(acc)))
            return tuple(new_accs)

        def finish(accs, m_i, l_i):
            """Normalize and store this warpgroup's 256 output columns (and, warpgroup 0, the lse)."""
            # Both warpgroups are done with Q: its slabs become the output staging buffers.
            plgpu.barrier_arrive(done_barrier.at[0])
            plgpu.barrier_wait(done_barrier.at[0])
            if scores_by == "handoff":  # warpgroup 1 has no softmax state of its own
                l_i = plgpu.load(l_smem, layout=plgpu.Layout.WGMMA.reduce(1))
            has_mass = l_i > 0
            inv_l = jnp.where(has_mass, 1.0 / jnp.where(has_mass, l_i, 1.0), 0.0)
            for j in range(4):
                q_smem[wg * 4 + j] = (accs[j] * lax.broadcast_in_dim(inv_l, accs[j].shape, [0])).astype(
                    jnp.bfloat16)

            @pl.when(wg == 0)
            def _lse():
                lse_smem[...] = jnp.where(has_mass, (m_i + jnp.log2(jnp.where(has_mass, l_i, 1.0))) / LOG2E,
                                          -jnp.inf)

            plgpu.commit_smem()
            for j in range(4):
                plgpu.copy_smem_to_gmem(
                    q_smem.at[wg * 4 + j], out_ref.at[row, heads_slice, pl.ds((wg * 4 + j) * SLAB, SLAB)])

            @pl.when(wg == 0)
            def _store_lse():
                plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[row, heads_slice])

            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")

            @pl.when(wg == 0)
            def _load_q():
                for c in range(NUM_SLABS):
                    plgpu.copy_gmem_to_smem(q_ref.at[row, heads_slice, pl.ds(c * SLAB, SLAB)], q_smem.at[c],
                                            q_barrier.at[0])

            plgpu.barrier_wait(q_barrier.at[0])

        if scores_by == "both":
            @pl.when(wg < 2)
            def _both():
                def block_step(block, carry):
                    accs, m_i, l_i = carry
                    stage = lax.rem(block, STAGES)
                    plgpu.barrier_wait(kv_barriers.at[stage])
                    if compute:  # else time the gather alone
                        probs, alpha, m_i, l_i = softmax_block(block, stage, m_i, l_i)
                        accs = values_block(accs, alpha, probs, stage, wg * 4)
                    plgpu.barrier_arrive(consumed_barriers.at[stage])
                    return accs, m_i, l_i

                finish(*lax.fori_loop(0, num_blocks, block_step, init_carry()))
        else:
            @pl.when(wg == 0)
            def _scorer():
                def block_step(block, carry):
                    accs, m_i, l_i = carry
                    stage = lax.rem(block, STAGES)
                    plgpu.barrier_wait(kv_barriers.at[stage])
                    probs, alpha, m_i, l_i = softmax_block(block, stage, m_i, l_i)

                    @pl.when(block > 0)
                    def _wait_probs_read():
                        plgpu.barrier_wait(probs_consumed_barrier.at[0])

                    probs_smem[...] = probs
                    alpha_smem[...] = alpha
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(probs_ready_barrier.at[0])
                    accs = values_block(accs, alpha, probs, stage, 0)
                    plgpu.barrier_arrive(consumed_barriers.at[stage])
                    return accs, m_i, l_i

                accs, m_i, l_i = lax.fori_loop(0, num_blocks, block_step, init_carry())
                l_smem[...] = l_i
                finish(accs, m_i, l_i)

            @pl.when(wg == 1)
            def _second():
                def block_step(block, accs):
                    stage = lax.rem(block, STAGES)
                    plgpu.barrier_wait(kv_barriers.at[stage])
                    plgpu.barrier_wait(probs_ready_barrier.at[0])
                    alpha = plgpu.load(alpha_smem, layout=plgpu.Layout.WGMMA.reduce(1))
                    accs = values_block(accs, alpha, probs_smem, stage, 4)
                    plgpu.barrier_arrive(probs_consumed_barrier.at[0])
                    plgpu.barrier_arrive(consumed_barriers.at[stage])
                    return accs

                accs, m_i, l_i = init_carry()
                finish(lax.fori_loop(0, num_blocks, block_step, accs), m_i, l_i)

        @pl.when(wg == 2)
        def _produce():
            plgpu.set_max_registers(40, action="decrease")
            if slots_once:  # the row's whole slot list, once (a TMA box is at most 256 long)
                for piece in range(max_slots // BLOCK_S):
                    chunk = pl.ds(piece * BLOCK_S, BLOCK_S)
                    plgpu.copy_gmem_to_smem(slots_ref.at[row, chunk], all_slots.at[chunk], slots_barriers.at[0])
                plgpu.barrier_wait(slots_barriers.at[0])

            def prefetch_block(block, info_column):
                """L2 prefetch of a later block's rows (slots_once only)."""
                @pl.when(block < num_blocks)
                def _prefetch():
                    meta_smem[STAGES, info_column] = count - block * BLOCK_S
                    meta_smem[STAGES, info_column + 1] = block * BLOCK_S
                    _l2_prefetch(kv_ref, all_slots, meta_smem.at[STAGES, pl.ds(info_column, 2)])

            for ahead in range(1, prefetch_blocks):
                prefetch_block(ahead, 56)

            @pl.loop(0, num_blocks)
            def _gather(block):
                stage = lax.rem(block, STAGES)

                @pl.when(block >= STAGES)
                def _wait_consumed():
                    plgpu.barrier_wait(consumed_barriers.at[stage])

                if prefetch_blocks:
                    prefetch_block(block + prefetch_blocks, 58 + 2 * stage)
                if not slots_once:
                    plgpu.copy_gmem_to_smem(slots_ref.at[row, pl.ds(block * BLOCK_S, BLOCK_S)],
                                            slots_smem.at[stage], slots_barriers.at[stage])
                    plgpu.barrier_wait(slots_barriers.at[stage])
                if gather == "none":  # times the compute alone (the results are wrong)
                    plgpu.barrier_arrive(kv_barriers.at[stage])
                    return
                if gather == "cp_async":
                    info = meta_smem.at[STAGES, pl.ds(48 + 2 * stage, 2)]
                    meta_smem[STAGES, 48 + 2 * stage] = count - block * BLOCK_S
                    meta_smem[STAGES, 49 + 2 * stage] = block * BLOCK_S if slots_once else 0
                    _cp_async_gather(kv_ref, all_slots if slots_once else slots_smem.at[stage], info,
                                     mma_view.at[stage])
                    plgpu.barrier_arrive(kv_barriers.at[stage])
                    return
                for i in range(BLOCK_S):
                    # Past the count, aim past the cache: the TMA fills the row with zeros.
                    slot = jnp.where(block * BLOCK_S + i < count, all_slots[block * BLOCK_S + i] if slots_once
                                     else slots_smem[stage, i], num_slots)
                    for c in range(NUM_SLABS):
                        plgpu.copy_gmem_to_smem(kv_ref.at[pl.ds(slot, 1), pl.ds(c * SLAB, SLAB)],
                                                rows_view.at[stage, c, pl.ds(i, 1)], kv_barriers.at[stage])

    def entry(q_ref, kv_ref, slots_ref, counts_ref, out_ref, lse_ref):
        handoff = scores_by == "handoff"
        slabs = (STAGES, NUM_SLABS, BLOCK_S, SLAB)
        mma_buffers = plgpu.SMEM(slabs, jnp.bfloat16, transforms=_tiled((8, SLAB)))
        kv_buffers = (mma_buffers if gather != "tma" else
                      plgpu.RefUnion(plgpu.SMEM(slabs, jnp.bfloat16, transforms=_tiled((1, SLAB))), mma_buffers))
        pl.run_scoped(
            lambda *scratch: kernel(q_ref, kv_ref, slots_ref, counts_ref, out_ref, lse_ref, scratch),
            plgpu.SMEM((NUM_SLABS, BLOCK_H, SLAB), jnp.bfloat16, transforms=_tiled((8, SLAB))),
            kv_buffers,
            plgpu.SMEM((STAGES + 1, BLOCK_S), jnp.int32),
            plgpu.SMEM((3, BLOCK_H), jnp.float32),
            # handoff: warpgroup 0's probabilities, for warpgroup 1
            plgpu.SMEM((BLOCK_H, BLOCK_S), jnp.bfloat16, transforms=_tiled((8, SLAB))) if handoff else None,
            plgpu.SMEM((max_slots,), jnp.int32) if slots_once else None,
            plgpu.Barrier(num_arrivals=NUM_SLABS, num_barriers=1),  # one arrival per Q slab copy
            plgpu.Barrier(num_barriers=1),
            plgpu.Barrier(num_arrivals=max_slots // BLOCK_S if slots_once else 1, num_barriers=STAGES),
            # tma: one arrival per (row, slab) copy; cp_async: the producer arrives once per block.
            plgpu.Barrier(num_arrivals=BLOCK_S * NUM_SLABS if gather == "tma" else 1, num_barriers=STAGES),
            plgpu.Barrier(num_arrivals=2, num_barriers=STAGES),
            plgpu.Barrier(num_arrivals=2, num_barriers=1),
            plgpu.Barrier(num_barriers=1) if handoff else None,
            plgpu.Barrier(num_barriers=1) if handoff else None,
            collective_axes="wg",
        )

    return plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct((rows, heads, VALUE_DIM), jnp.bfloat16),
                  jax.ShapeDtypeStruct((rows, heads), jnp.float32)),
        grid=(heads // BLOCK_H, rows), grid_names=("head_block", "row"),
        num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
    )(q, kv, slots, counts)


def _inputs(rows, heads, max_slots, num_slots, counts, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (rows, heads, WIDTH), jnp.bfloat16)
    kv = jax.random.normal(keys[1], (num_slots, WIDTH), jnp.bfloat16)
    slots = jax.random.randint(keys[2], (rows, max_slots), 0, num_slots, jnp.int32)
    counts = jnp.zeros((rows, 16), jnp.int32).at[:, 0].set(jnp.asarray(counts, jnp.int32))
    return q, kv, slots, counts


def main():
    def option(name, default):
        return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default

    gather, scores_by = option("--gather", "tma"), option("--scores", "both")
    slots_once, compute = option("--slots", "per_block") == "once", option("--compute", "full") == "full"
    prefetch_blocks = int(option("--prefetch", "0"))
    decode = jax.jit(sparse_mla_decode, static_argnums=(4, 5, 6, 7, 8, 9))
    if "--lower" in sys.argv:
        q, kv, slots, counts = (jax.ShapeDtypeStruct(s, d) for s, d in [
            ((2, 128, WIDTH), jnp.bfloat16), ((1 << 16, WIDTH), jnp.bfloat16), ((2, 2048), jnp.int32),
            ((2, 16), jnp.int32)])
        for way in ("tma", "cp_async", "none"):
            for by in ("both", "handoff"):
                for once in (False, True) if by == "both" else (False,):  # handoff + once passes 227 KB
                    decode.trace(q, kv, slots, counts, 0.1352, way, by, once).lower(lowering_platforms=("cuda",))
                    print(f"gather={way} scores={by} slots_once={once} lowers")
        decode.trace(q, kv, slots, counts, 0.1352, "cp_async", "both", True, True, 2).lower(
            lowering_platforms=("cuda",))
        print("gather=cp_async scores=both slots_once=True prefetch_blocks=2 lowers")
        return
    print("jax", jax.__version__, jax.devices()[0].device_kind,
          f"gather={gather} scores={scores_by} slots_once={slots_once} compute={compute} {prefetch_blocks=}",
          flush=True)
    sm_scale = 0.1352
    rows, heads, max_slots = 8, 128, 2048
    q, kv, slots, counts = _inputs(rows, heads, max_slots, 1 << 16, [2048, 0, 1, 700, 1000, 333, 2047, 64])
    out, lse = decode(q, kv, slots, counts, sm_scale, gather, scores_by, slots_once, compute, prefetch_blocks)
    want_out, want_lse = reference.sparse_mla_decode(q, kv[:, None, :], slots, counts[:, 0], sm_scale)
    rel = float(jnp.linalg.norm(out.astype(jnp.float32) - want_out) / jnp.linalg.norm(want_out))
    lse_err = float(jnp.max(jnp.where(jnp.isfinite(want_lse), jnp.abs(lse - want_lse), 0.0)))
    empty_ok = bool(jnp.all(out[1] == 0) and jnp.all(lse[1] == -jnp.inf))
    print(f"check: rel error {rel:.2e}, max lse error {lse_err:.2e}, empty row ok {empty_ok}", flush=True)
    # Time B=64, H=128, 2048 valid slots per row over a 1.2 GB cache.
    rows, heads = 64, int(option("--heads", "128"))
    q, kv, slots, counts = _inputs(rows, heads, max_slots, 1 << 20, [max_slots] * rows, seed=1)
    l2_slots = "--l2-slots" in sys.argv
    if l2_slots:  # every row reads cache rows 0 .. k-1 (2.4 MB): the gather hits in L2
        slots = jnp.broadcast_to(jnp.arange(max_slots, dtype=jnp.int32), slots.shape)
    jax.block_until_ready(decode(q, kv, slots, counts, sm_scale, gather, scores_by, slots_once, compute,
                                 prefetch_blocks))
    start, n = time.perf_counter(), 20
    for _ in range(n):
        result = decode(q, kv, slots, counts, sm_scale, gather, scores_by, slots_once, compute, prefetch_blocks)
    jax.block_until_ready(result)
    seconds = (time.perf_counter() - start) / n
    flops = 2 * rows * heads * max_slots * (WIDTH + VALUE_DIM)
    print(f"B={rows} H={heads} k={max_slots}{' L2 slots' if l2_slots else ''}: {seconds * 1e6:.1f} us = "
          f"{flops / seconds / 1e12:.0f} TFLOP/s (host-timed, back to back)", flush=True)


if __name__ == "__main__":
    main()
