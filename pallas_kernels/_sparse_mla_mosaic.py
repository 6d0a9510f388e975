"""Sparse MLA decode for Hopper (sm_90) in Mosaic GPU: the fast path of `pallas_kernels.sparse_mla_decode` for bf16
and fp8 latent caches.

Same contract as the Triton kernel for a bf16 cache of 512 latent + 64 rope columns (q is cast to bf16). Per CTA,
one row, one split of its valid slots and 64 heads, with three warpgroups (four on an fp8 latent cache):
- a producer (two on an fp8 cache, each half the rows) gathers each block of 64 slots' cache rows into one of two
  SMEM stages ([9 slabs, 64, 64], (8, 64)-tiled, 128B-swizzled) with cp.async, zero-filling rows past the split's
  end (`_sparse_mla_mosaic_gather`; one TMA per 128-byte row piece made the kernel 10x slower:
  docs/perf_sparse_mla.md, "The first Mosaic kernel, and how its gather was found");
- the scorer warpgroup computes the block's 64 x 64 scores (9 wgmmas of depth 64) and the online softmax, writes
  the bf16 probabilities over the block's spent rope slab and the rescale factors to SMEM, and multiplies the
  probabilities by the first LEFT_SLABS value slabs;
- the second warpgroup multiplies the same probabilities, from SMEM, by the other value slabs.
Each score is computed once: both warpgroups computing them was 1.5x the tensor work (docs/perf_sparse_mla.md, "The
first Mosaic kernel, and how its gather was found").
The output is rounded to bf16 in the kernel (as FlashMLA does); split-K partial results are merged by one Pallas
kernel (`_split_merge_triton`: at R = 1 3.6 us where XLA's merge ran four kernels, 5.6 us, and 2.4 us alone with its
current blocks; H100, docs/perf_sparse_mla.md, "Small batches: the kernel reads its counts, one Pallas kernel merges
the splits"). On an fp8 latent cache (`formats.Fp8LatentCache`: 656 bytes a token) each producer stages
its rows' e4m3 bytes, scales and rope with cp.async and then dequantizes the e4m3 bytes into the stage's bf16 slabs
itself (`gather_fp8`), while the other two warpgroups multiply the previous block, as FlashMLA does: exact (ue8m0
scales), so the products are the bf16 cache's. Mosaic GPU has no interpreter for this kernel, so it runs on the GPU
only; on CPU it can be lowered for CUDA (the tests do).
Letters: see the legend in `dcp_jax/__init__.py`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import formats
from pallas_kernels import _sparse_mla_mosaic_gather as gather
from pallas_kernels import _split_merge_triton
from pallas_kernels._mosaic_scalars import read_ints
from pallas_kernels._platform import on_hopper_compiled
from pallas_kernels._sparse_mla_mosaic_gather import (BLOCK_S, NUM_SLABS, ROPE_DIM, SCALES_PER_ROW, SLAB, VALUE_DIM,
                                                      WIDTH)
from pallas_kernels._sparse_mla_triton import default_num_splits, fp8_cache_rows

STAGES = 2  # the queries and two stages fill the 227 KB of SMEM
BLOCK_H = 64  # heads per CTA: one wgmma's rows
LEFT_SLABS = 3  # value slabs of the scorer; the second warpgroup takes the other 5 (4 + 4 was slower)
LOG2E = math.log2(math.e)
# Producer warpgroups by cache (fp8 or not): an fp8 cache's producers dequantize, and two (each half the rows)
# ran the R = 64 call in 116 us against one's 135 us (H100, same call; docs/perf_sparse_mla.md, "fp8 latent cache
# dequantized inside the Mosaic kernel").
PRODUCERS = {False: 1, True: 2}
# Registers a thread of each compute and each producer warpgroup, by cache. setmaxnreg moves registers between
# the warpgroups of a CTA: they sum to what the kernel starts with, 3 * 168 a thread with one producer and 4 * 128
# with two (a larger sum waits forever; `check_registers`).
REGISTERS = {False: (232, 40), True: (200, 56)}
LAUNCH_REGISTERS = {1: 168, 2: 128}  # a thread's registers at the launch, by producers


def check_registers(registers: tuple[int, int], producers: int) -> None:
    """ValueError unless (compute, producer) registers a thread are multiples of 8 in [24, 256] that sum over the
    two compute and `producers` producer warpgroups to what the kernel starts with (setmaxnreg would hang)."""
    compute, producer = registers
    total = (2 + producers) * LAUNCH_REGISTERS[producers]
    if any(r % 8 or not 24 <= r <= 256 for r in registers) or 2 * compute + producers * producer != total:
        raise ValueError(f"registers (compute, producer) must be multiples of 8 in [24, 256] with 2 * compute + "
                         f"{producers} * producer = {total} ({producers} producer warpgroups); got {registers}")


def _kernel(q_ref, kv_refs, slots_ref, counts_ref, out_ref, lse_ref, scratch, *, scale, num_splits, registers):
    """kv_refs: (the bf16 cache rows,), or an fp8 latent cache's (e4m3 bytes, scales, rope) rows."""
    fp8 = len(kv_refs) == 3
    producers = PRODUCERS[fp8]
    compute_registers, producer_registers = registers
    (q_smem, kv_smem, meta_smem, row_stats, *staged_scales,
     q_barrier, slots_barriers, kv_barriers, probs_barriers, consumed_barriers, done_barrier) = scratch
    # meta_smem rows 0 .. STAGES-1 hold each stage's slots; row STAGES holds warpgroup wg's copy of the count in
    # column wg and, from column 16, each stage's gather limit for each producer. row_stats rows 0 .. STAGES-1 hold
    # each stage's rescale factors, row STAGES the reciprocal row sums, row STAGES + 1 stages the lse.
    slots_smem = meta_smem.at[pl.ds(0, STAGES)]
    head_block, split, row = lax.axis_index("head_block"), lax.axis_index("split"), lax.axis_index("row")
    heads = pl.ds(head_block * BLOCK_H, BLOCK_H)
    wg = lax.axis_index("wg")
    max_slots = slots_ref.shape[1]
    row_vector = plgpu.Layout.WGMMA.reduce(1)

    @pl.when(wg == 0)
    def _load_q():
        for c in range(NUM_SLABS):
            plgpu.copy_gmem_to_smem(q_ref.at[row, heads, pl.ds(c * SLAB, SLAB)], q_smem.at[c], q_barrier.at[0])

    # Each warpgroup reads the count itself (a TMA row would need 16 bytes: a pad of the counts before the kernel).
    read_ints(counts_ref.at[pl.ds(row, 1)], meta_smem.at[STAGES, pl.ds(wg, 1)])
    count = jnp.clip(meta_smem[STAGES, wg], 0, max_slots)
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
        """Normalized bf16 output slabs, staged in the queries' spent slabs (after done_barrier) and copied out."""
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
        plgpu.set_max_registers(compute_registers, action="increase")
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
        plgpu.set_max_registers(compute_registers, action="increase")

        def block_step(block, accs):  # the scorer waited for the stage before it published the probabilities
            stage = lax.rem(block, STAGES)
            plgpu.barrier_wait(probs_barriers.at[stage])
            alpha = plgpu.load(row_stats.at[stage], layout=row_vector)
            accs = accumulate(accs, alpha, None, stage, LEFT_SLABS)
            plgpu.barrier_arrive(consumed_barriers.at[stage])
            return accs

        store_output(lax.fori_loop(0, num_blocks, block_step, zeros(VALUE_DIM // SLAB - LEFT_SLABS)), None, LEFT_SLABS)
        plgpu.wait_smem_to_gmem(0)

    def produce(producer):
        plgpu.set_max_registers(producer_registers, action="decrease")
        tokens = BLOCK_S // producers
        first_row = producer * tokens

        def barrier(block):  # this producer's slots barrier of the block's stage
            return slots_barriers.at[lax.rem(block, STAGES) * producers + producer]

        @pl.loop(0, num_blocks)
        def _gather(block):
            stage = lax.rem(block, STAGES)

            @pl.when(block >= STAGES)
            def _wait_consumed():
                plgpu.barrier_wait(consumed_barriers.at[stage])

            # This producer's slots of the block, and its gather limit, in the stage's SMEM.
            plgpu.copy_gmem_to_smem(slots_ref.at[row, pl.ds(start + block * BLOCK_S + first_row, tokens)],
                                    slots_smem.at[stage, pl.ds(first_row, tokens)], barrier(block))
            plgpu.barrier_wait(barrier(block))
            limit_column = 16 + stage * producers + producer
            meta_smem[STAGES, limit_column] = length - block * BLOCK_S
            slots, limit = slots_smem.at[stage], meta_smem.at[STAGES, pl.ds(limit_column, 1)]
            if fp8:
                [scales_smem] = staged_scales
                gather.gather_fp8(*kv_refs, slots, limit, kv_smem.at[stage], scales_smem.at[stage],
                                  first_row=first_row, tokens=tokens)
            else:
                gather.gather_bf16(*kv_refs, slots, limit, kv_smem.at[stage])
            plgpu.barrier_arrive(kv_barriers.at[stage])

    for producer in range(producers):
        pl.when(wg == 2 + producer)(functools.partial(produce, producer))


@functools.partial(jax.jit, static_argnames=("sm_scale", "num_splits", "registers"))
def sparse_mla_partials(q, kv_parts, slots, counts, *, sm_scale: float, num_splits: int,
                        registers: tuple[int, int] | None = None):
    """The kernel on prepared inputs: q bf16 [R, H, 576] (H a multiple of 64); kv_parts (bf16 rows [slots, 576],)
    or an fp8 latent cache's (e4m3 bytes as uint8 [slots, 512], f32 scales [slots, 4], bf16 rope [slots, 64]);
    slots int32 [R, K] (K a multiple of 64), counts int32 [R] (clipped to [0, K] here). Returns per-split
    out bf16 [R, splits, H, 512] and lse f32 [R, splits, H]. registers: `sparse_mla_decode`'s."""
    rows, heads, _ = q.shape
    num_parts = len(kv_parts)
    producers = PRODUCERS[num_parts == 3]
    if registers is None:
        registers = REGISTERS[num_parts == 3]
    check_registers(registers, producers)

    def entry(q_ref, *refs):
        kv_refs, (slots_ref, counts_ref, out_ref, lse_ref) = refs[:num_parts], refs[num_parts:]
        slabs = (STAGES, NUM_SLABS, BLOCK_S, SLAB)
        # The scales the fp8 gather stages (`gather.gather_fp8`); none for a bf16 cache.
        staged_scales = [plgpu.SMEM((STAGES, BLOCK_S * SCALES_PER_ROW), jnp.float32)] if num_parts == 3 else []
        pl.run_scoped(
            lambda *scratch: _kernel(q_ref, kv_refs, slots_ref, counts_ref, out_ref, lse_ref, scratch,
                                     scale=sm_scale * LOG2E, num_splits=num_splits, registers=registers),
            plgpu.SMEM((NUM_SLABS, BLOCK_H, SLAB), jnp.bfloat16, transforms=gather.tiled((8, SLAB))),
            plgpu.SMEM(slabs, jnp.bfloat16, transforms=gather.tiled((8, SLAB))),
            plgpu.SMEM((STAGES + 1, BLOCK_S), jnp.int32),
            plgpu.SMEM((STAGES + 2, BLOCK_H), jnp.float32),
            *staged_scales,
            plgpu.Barrier(num_arrivals=NUM_SLABS, num_barriers=1),  # one arrival per query slab copy
            plgpu.Barrier(num_barriers=STAGES * producers),
            plgpu.Barrier(num_arrivals=producers, num_barriers=STAGES),  # each producer once per gathered block
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
        num_threads=2 + producers, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
    )(q, *kv_parts, slots, counts)


def unsupported(q, kv_cache, value_dim: int, interpret: bool) -> list[str]:
    """Why this kernel does not take these inputs (empty: it does): it needs a bf16 cache of 512 + 64 columns, or
    an fp8 latent cache of those widths, compiled on an sm_90 GPU."""
    reasons = []
    if isinstance(kv_cache, formats.Fp8LatentCache):
        try:
            if fp8_cache_rows(kv_cache, value_dim).shape[-1] != WIDTH:
                reasons.append(f"it needs an fp8 latent cache of {VALUE_DIM} + {ROPE_DIM} columns, got "
                               f"{kv_cache.latent.shape[-1]} + {kv_cache.rope.shape[-1]}")
        except ValueError as e:
            reasons.append(str(e))
    elif kv_cache.dtype != jnp.bfloat16:
        reasons.append(f"it needs a bf16 latent cache or an Fp8LatentCache, got {kv_cache.dtype}")
    if value_dim != VALUE_DIM or q.shape[-1] != WIDTH:
        reasons.append(f"it needs {VALUE_DIM} + {ROPE_DIM} columns, got {value_dim=} and q width {q.shape[-1]}")
    return reasons + on_hopper_compiled(interpret)


def sparse_mla_decode(q, kv_cache, slots, counts, sm_scale, *, value_dim=VALUE_DIM, num_splits=None,
                      registers=None):
    """The contract of `pallas_kernels.sparse_mla_decode` on this kernel (`unsupported` lists what it needs);
    out is rounded to bf16 in the kernel. num_splits: split-K programs per row (None: `default_num_splits`).
    registers: (compute, producer) registers a thread of each warpgroup (`check_registers`; None: REGISTERS by
    cache)."""
    del value_dim  # always VALUE_DIM here (`unsupported`)
    num_heads = q.shape[1]
    q, kv_parts, slots, counts = prepare(q, kv_cache, slots, counts)
    rows, padded_heads, _ = q.shape
    if num_splits is None:
        num_splits = default_num_splits(rows, padded_heads // BLOCK_H, slots.shape[1], BLOCK_S)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1; got {num_splits=}")
    outs, lses = sparse_mla_partials(q, kv_parts, slots, counts, sm_scale=float(sm_scale), num_splits=num_splits,
                                     registers=None if registers is None else tuple(registers))
    out, lse = ((outs[:, 0], lses[:, 0]) if num_splits == 1
                else _split_merge_triton.merge_splits(outs, lses, out_dtype=jnp.bfloat16))
    return out[:, :num_heads], lse[:, :num_heads]


def prepare(q, kv_cache, slots, counts):
    """Pads the contract's inputs to the kernel's: heads to a multiple of 64 (zero queries), slots to a multiple
    of 64 (entries past the count are never read; counts are then clipped to K, as the kernel clips them to the
    padded width); q to bf16, the cache to the kernel's parts (`sparse_mla_partials`). Inputs of the kernel's
    shapes pass unchanged (no XLA op before the kernel)."""
    heads, num_slots = q.shape[1], slots.shape[1]
    if num_slots % BLOCK_S:
        counts = jnp.minimum(counts, num_slots)  # counts above K act as K
        slots = jnp.pad(slots, ((0, 0), (0, -num_slots % BLOCK_S)))
    if q.dtype != jnp.bfloat16:
        q = q.astype(jnp.bfloat16)
    if heads % BLOCK_H:
        q = jnp.pad(q, ((0, 0), (0, -heads % BLOCK_H), (0, 0)))
    if isinstance(kv_cache, formats.Fp8LatentCache):
        latent = lax.bitcast_convert_type(kv_cache.latent, jnp.uint8)
        kv_parts = (latent.reshape(-1, VALUE_DIM), kv_cache.scales.reshape(-1, SCALES_PER_ROW),
                    kv_cache.rope.reshape(-1, ROPE_DIM))
    else:
        kv_parts = (kv_cache.reshape(-1, WIDTH),)
    return q, kv_parts, slots, counts
