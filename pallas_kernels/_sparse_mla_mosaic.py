"""Sparse MLA decode for Hopper (sm_90) in Mosaic GPU: the fast path of `pallas_kernels.sparse_mla_decode` for bf16
and fp8 latent caches.

Same contract as the Triton kernel for a bf16 cache of 512 latent + 64 rope columns (q is cast to bf16). Per CTA,
one row, one split of its valid slots and 64 heads, with three warpgroups (four on an fp8 latent cache):
- a producer (two on an fp8 cache, each half the rows) gathers each block of 64 slots' cache rows into one of two
  SMEM stages ([9 slabs, 64, 64], (8, 64)-tiled, 128B-swizzled) with cp.async, zero-filling rows past the split's
  end (one TMA per 128-byte row piece made the kernel 10x slower: docs/perf_sparse_mla.md);
- the scorer warpgroup computes the block's 64 x 64 scores (9 wgmmas of K=64) and the online softmax, writes
  the bf16 probabilities over the block's spent rope slab and the rescale factors to SMEM, and multiplies the
  probabilities by the first LEFT_SLABS value slabs;
- the second warpgroup multiplies the same probabilities, from SMEM, by the other value slabs.
Each score is computed once: both warpgroups computing them was 1.5x the tensor work (docs/perf_sparse_mla.md).
The output is rounded to bf16 in the kernel (as FlashMLA does); split-K partial results are merged by one Pallas
kernel (`_split_merge_triton`: 3.6 us at B = 1 where XLA's merge ran four kernels, 5.6 us, H100). On an fp8
latent cache (`formats.Fp8LatentCache`: 656 bytes a token) each producer stages its rows' e4m3 bytes, scales
and rope with cp.async and then dequantizes the e4m3 bytes into the stage's bf16 slabs itself
(`_cp_async_gather_fp8`), while the other two warpgroups multiply the previous block, as FlashMLA does: exact
(ue8m0 scales), so the products are the bf16 cache's. With `early_loads` (a knob, not yet run on a GPU) the
producers instead load a block's e4m3 bytes, scales and rope into registers before its stage is free, and only
dequantize and store them after the wait. Mosaic GPU has no interpreter for this kernel, so it runs on the GPU
only; on CPU it can be lowered for CUDA (the tests do).
"""

from __future__ import annotations

import functools
import math

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, memref, nvvm
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import formats
from pallas_kernels import _split_merge_triton
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
SLAB_BYTES = BLOCK_S * SLAB * 2  # one bf16 slab of a stage
CHUNK = 16  # bytes per cp.async
COUNT_COLUMNS = 16  # counts travel as [R, 16] int32: a TMA row must be 16-byte aligned and 64 bytes suit it
LOG2E = math.log2(math.e)
# Producer warpgroups by cache (fp8 or not): an fp8 cache's producers dequantize, and two (each half the rows)
# ran the B = 64 call in 116 us against one's 135 us (H100, same call; docs/perf_sparse_mla.md, stop 49).
PRODUCERS = {False: 1, True: 2}
# Registers a thread of each compute and each producer warpgroup, by cache. setmaxnreg moves registers between
# the warpgroups of a CTA: they sum to what the kernel starts with, 3 * 168 a thread with one producer and 4 * 128
# with two (a larger sum waits forever; `check_registers`).
REGISTERS = {False: (232, 40), True: (200, 56)}
LAUNCH_REGISTERS = {1: 168, 2: 128}  # a thread's registers at the launch, by producers
# With `early_loads` each fp8 producer thread holds a block's loads across the wait for its stage (EARLY_WORDS
# words: its 8 rows' 16 latent bytes, their 8 scales and 32 rope bytes), so each compute warpgroup gives 16
# registers a thread to the producers.
EARLY_REGISTERS = (184, 72)
EARLY_WORDS = 48
EARLY_LAYOUT = plgpu.Layout.WG_STRIDED((128 * EARLY_WORDS,), vec_size=4)
# The fp8 latent cache (formats.Fp8LatentCache): a token's 512 e4m3 bytes, 4 f32 scales, 64 bf16 rope columns.
SCALES_PER_ROW = VALUE_DIM // formats.LATENT_TILE
STAGING_SLAB = 4  # a block's e4m3 bytes are staged in its stage's bf16 slabs 4 .. 7 and dequantized in place
BF16_2_POW_120 = 0x7B80  # 2 ** 120 in bf16: an e4m3 byte moved into bf16's bits is its value times 2 ** -120


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
                nvvm.CpAsyncOp(mgpu_utils.getelementptr(dst_row, [slab * SLAB_BYTES], i8),
                               mgpu_utils.getelementptr(src_row, [slab * SLAB * 2], i8),
                               CHUNK, nvvm.LoadCacheModifierKind.CG, cpSize=size)
        nvvm.cp_async_commit_group()
        nvvm.cp_async_wait_group(0)
        mgpu_utils.commit_shared()  # fence the copies for the async proxy, then a warpgroup barrier

    gather(kv_ref, slots_ref, info_ref, kv_smem)


def _dequantized(words, scale_pair):
    """Four i32 words of 16 e4m3 values -> eight i32 words of their bf16 values times the scale (two bf16 in
    `scale_pair`): exact, as the scale is a power of two. Each byte s.eeee.mmm moves into bf16's bits as
    s.0000eeee.mmm0000, which is its value (normal or subnormal) times 2 ** -120; two bf16 products restore it
    (`mul.rn.bf16x2` keeps subnormals). A NaN byte (s.1111.111) reads as +-480 times the scale."""
    i32 = ir.IntegerType.get_signless(32)
    out = []
    for word in words:
        out += mgpu_utils.inline_ptx(
            "{\n.reg .b32 a, b, c, d, z, p;\n"
            "mov.b32 z, 0;\n"
            f"mov.b32 p, {BF16_2_POW_120 << 16 | BF16_2_POW_120};\n"
            "prmt.b32 a, $2, z, 0x1404;\n"  # [0, byte 0, 0, byte 1]
            "prmt.b32 b, $2, z, 0x3424;\n"  # [0, byte 2, 0, byte 3]
            "shr.u32 c, a, 4;\nshr.u32 d, b, 4;\n"
            "and.b32 a, a, 0x80008000;\nand.b32 b, b, 0x80008000;\n"
            "and.b32 c, c, 0x07F007F0;\nand.b32 d, d, 0x07F007F0;\n"
            "or.b32 a, a, c;\nor.b32 b, b, d;\n"
            "mul.rn.bf16x2 a, a, p;\nmul.rn.bf16x2 b, b, p;\n"
            "mul.rn.bf16x2 $0, a, $3;\nmul.rn.bf16x2 $1, b, $3;\n}",
            word, scale_pair, result_types=[i32, i32])
    return out


def _cp_async_gather_fp8(latent_ref, scales_ref, rope_ref, slots_ref, info_ref, kv_smem, scales_smem, *,
                         first_row, tokens):
    """A producer warpgroup's fp8 gather of the block's rows first_row .. first_row + tokens - 1 (its share):
    copies the e4m3 latent, scales and rope of the cache rows named by slots_ref [64] with cp.async (zero-filling
    rows at or past info_ref[0]): the rope into slab 8 of kv_smem ([9, 64, 64] bf16, (8, 64)-tiled,
    128B-swizzled), the scales into scales_smem [64, 4], the e4m3 bytes into these rows' part of slabs 4 .. 7 as
    staged slabs ([tokens, 64 bytes] each); then dequantizes them into these rows of slabs 0 .. 7 in place and
    fences them for the async proxy. The caller arrives on the stage's barrier.

    Lane l of warp w copies 16-byte chunk l of the e4m3 rows of tokens w * tokens / 4 + j (so a warp instruction
    reads a whole 512-byte row) into staged slab l // 4; odd staged slabs swap each token pair's rows, so each
    8-lane phase of a copy writes all 32 banks. Thread t dequantizes 16 bytes (token t // 4 + 32j, chunk t % 4) of
    each slab into 32 bf16 bytes, with a warpgroup barrier before slabs 4, 6 and 7 (slab 7's staged bytes are read
    before it), so that no slab is written before its staged bytes are read.
    Every byte a producer stages and writes lies in its own rows, so producers need no barrier between them."""
    rows_per_warp = tokens // 4
    scale_bytes = tokens // 8  # scale bytes a thread copies (a cp.async size: 4 for two producers' 32 rows)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType(), plgpu.RefType(),
                                  plgpu.RefType(), plgpu.RefType(transforms=_tiled((8, SLAB))), plgpu.RefType()))
    def gather(launch_ctx, latent_gmem, scales_gmem, rope_gmem, slots, info, smem, scale_smem):
        del launch_ctx
        i32, i64, i8 = (ir.IntegerType.get_signless(n) for n in (32, 64, 8))
        index = ir.IndexType.get()
        words = ir.VectorType.get((4,), i32)

        def const(value, ty=i32):
            return arith.constant(ty, value)

        def global_ptr(ref):
            return llvm.addrspacecast(llvm.PointerType.get(address_space=1), mgpu_utils.memref_ptr(ref))

        def at(ptr, offset):
            return mgpu_utils.getelementptr(ptr, [offset], i8)

        limit = memref.load(info, [arith.constant(index, 0)])

        def slot_of(row):  # (valid, the row's slot as i64: 0 past the limit)
            is_valid = arith.cmpi(arith.CmpIPredicate.slt, row, limit)
            slot = arith.select(is_valid, memref.load(slots, [arith.index_cast(index, row)]), const(0))
            return is_valid, arith.extui(i64, slot)

        def copy(dst, src, is_valid, size=CHUNK, cache=nvvm.LoadCacheModifierKind.CG):
            nvvm.CpAsyncOp(dst, src, size, cache, cpSize=arith.select(is_valid, const(size), const(0)))

        def swizzled(slab, row, chunk):  # the offset of 16-byte chunk `chunk` of a slab's row in the stage
            line = arith.addi(const(slab * SLAB_BYTES), arith.muli(row, const(SLAB * 2)))
            return arith.addi(line, arith.muli(arith.xori(chunk, arith.andi(row, const(7))), const(CHUNK)))

        tid = arith.andi(mgpu_utils.thread_idx(), const(127))
        lane, warp = arith.andi(tid, const(31)), arith.divui(tid, const(32))
        latent, scales, rope = global_ptr(latent_gmem), global_ptr(scales_gmem), global_ptr(rope_gmem)
        stage, scale_stage = mgpu_utils.memref_ptr(smem), mgpu_utils.memref_ptr(scale_smem)

        def staged_offset(slab, local_row):  # staged slab `slab` (static or not) lies in slab 4 + slab // 2
            return arith.addi(arith.addi(arith.muli(arith.addi(const(STAGING_SLAB), arith.shrui(slab, const(1))),
                                                    const(SLAB_BYTES)),
                                         arith.muli(arith.andi(slab, const(1)), const(tokens * SLAB))),
                              arith.addi(const(first_row * SLAB * 2),
                                         arith.muli(arith.xori(local_row, arith.andi(slab, const(1))), const(SLAB))))

        staged_slab = arith.divui(lane, const(4))
        column = arith.muli(arith.andi(lane, const(3)), const(CHUNK))
        for j in range(rows_per_warp):
            local_row = arith.addi(arith.muli(warp, const(rows_per_warp)), const(j))
            is_valid, slot = slot_of(arith.addi(local_row, const(first_row)))
            copy(at(stage, arith.addi(staged_offset(staged_slab, local_row), column)),
                 at(latent, arith.addi(arith.muli(slot, const(VALUE_DIM, i64)),
                                       arith.extui(i64, arith.muli(lane, const(CHUNK))))), is_valid)
        # Rope rows: as `_cp_async_gather`, into slab 8.
        first_rope_row = arith.addi(arith.addi(arith.muli(warp, const(rows_per_warp)), const(first_row)),
                                    arith.andi(arith.divui(tid, const(8)), const(3)))
        chunk = arith.andi(tid, const(7))
        for j in range(tokens // 16):
            row = arith.addi(first_rope_row, const(4 * j))
            is_valid, slot = slot_of(row)
            copy(at(stage, swizzled(NUM_SLABS - 1, row, chunk)),
                 at(rope, arith.addi(arith.muli(slot, const(ROPE_DIM * 2, i64)),
                                     arith.extui(i64, arith.muli(chunk, const(CHUNK))))), is_valid)
        # Scales: scale_bytes a thread.
        pieces = SCALES_PER_ROW * 4 // scale_bytes  # threads a row
        row, piece = arith.addi(arith.divui(tid, const(pieces)), const(first_row)), arith.remui(tid, const(pieces))
        is_valid, slot = slot_of(row)
        copy(at(scale_stage, arith.addi(const(first_row * SCALES_PER_ROW * 4), arith.muli(tid, const(scale_bytes)))),
             at(scales, arith.addi(arith.muli(slot, const(SCALES_PER_ROW * 4, i64)),
                                   arith.extui(i64, arith.muli(piece, const(scale_bytes))))),
             is_valid, size=scale_bytes, cache=nvvm.LoadCacheModifierKind.CA)
        nvvm.cp_async_commit_group()
        nvvm.cp_async_wait_group(0)
        mgpu_utils.warpgroup_barrier()  # every thread's copies landed

        token, part = arith.divui(tid, const(4)), arith.andi(tid, const(3))

        def vector_extract(vector, i):
            return llvm.extractelement(vector, const(i))

        def vector_of(values):
            vector = llvm.mlir_undef(words)
            for i, value in enumerate(values):
                vector = llvm.insertelement(vector, value, const(i))
            return vector

        def load(slab, j):  # this thread's j-th 16 staged bytes of `slab` and its token's scale pair
            local_row = arith.addi(token, const(32 * j))
            row = arith.addi(local_row, const(first_row))
            src = at(stage, arith.addi(staged_offset(const(slab), local_row), arith.muli(part, const(CHUNK))))
            vector = llvm.load(words, src)
            scale_bits = llvm.load(i32, at(scale_stage, arith.addi(arith.muli(row, const(SCALES_PER_ROW * 4)),
                                                                  const(slab // 2 * 4))))
            high = arith.shrui(scale_bits, const(16))  # a power of two (or 0) is exact in bf16
            scale_pair = arith.ori(high, arith.shli(high, const(16)))
            return row, [vector_extract(vector, i) for i in range(4)], scale_pair

        def store(slab, loaded):
            row, parts, scale_pair = loaded
            out = _dequantized(parts, scale_pair)
            for half in range(2):  # bf16 chunks 2 * part and 2 * part + 1 of the row's line
                chunk = arith.addi(arith.muli(part, const(2)), const(half))
                llvm.store(vector_of(out[4 * half:4 * half + 4]), at(stage, swizzled(slab, row, chunk)))

        # Staged slabs 0 .. 3 lie in slabs 4 and 5, 4 and 5 in slab 6, 6 and 7 in slab 7: a barrier before each slab
        # is written whose staged bytes other threads read.
        last_slab = VALUE_DIM // SLAB - 1
        for slab in range(last_slab):
            if slab in (STAGING_SLAB, STAGING_SLAB + 2):
                mgpu_utils.warpgroup_barrier()
            for j in range(tokens // 32):
                store(slab, load(slab, j))
        last = [load(last_slab, j) for j in range(tokens // 32)]
        mgpu_utils.warpgroup_barrier()
        for loaded in last:
            store(last_slab, loaded)
        mgpu_utils.commit_shared()  # fence the stores for the async proxy, then a warpgroup barrier

    gather(latent_ref, scales_ref, rope_ref, slots_ref, info_ref, kv_smem, scales_smem)


def _i32(value):
    return arith.constant(ir.IntegerType.get_signless(32), value)


def _i64(value):
    return arith.constant(ir.IntegerType.get_signless(64), value)


def _at(ptr, offset):
    """ptr plus `offset` bytes."""
    return mgpu_utils.getelementptr(ptr, [offset], ir.IntegerType.get_signless(8))


def _words(values):
    """Four i32 values as one vector<4xi32> (a 16-byte load or store)."""
    vector = llvm.mlir_undef(ir.VectorType.get((4,), ir.IntegerType.get_signless(32)))
    for i, value in enumerate(values):
        vector = llvm.insertelement(vector, value, _i32(i))
    return vector


def _swizzled(slab, row, chunk):
    """The byte offset in a stage ([9, 64, 64] bf16, (8, 64)-tiled, 128B-swizzled) of 16-byte chunk `chunk` of
    `row` of `slab` (i32 values)."""
    line = arith.addi(arith.muli(slab, _i32(SLAB_BYTES)), arith.muli(row, _i32(SLAB * 2)))
    return arith.addi(line, arith.muli(arith.xori(chunk, arith.andi(row, _i32(7))), _i32(CHUNK)))


def _load_fp8_block(latent_ref, scales_ref, rope_ref, slots_ref, info_ref, *, first_row, tokens):
    """`early_loads`' first half: a producer warpgroup loads its rows' (first_row .. first_row + 31) e4m3 latent
    bytes, scales and rope from the cache rows named by slots_ref [64] into registers, zeros for rows at or past
    info_ref[0]; returns them as one [128 * EARLY_WORDS] int32 array (EARLY_LAYOUT) for `_store_fp8_block`. Lane l
    of warp w loads 16-byte chunk l of rows first_row + 8w + j (j < 8), so a warp instruction reads a whole
    512-byte row, and the scale of that chunk; thread t loads 32 rope bytes (chunks 2 (t % 4), + 1) of row
    first_row + t // 4. Nothing waits for the stage: the loads fly while the stage's last block is multiplied."""
    if tokens != 32:
        raise ValueError(f"early fp8 loads take 32 rows a producer (two producers); got {tokens=}")
    rows_per_warp = tokens // 4

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 5,
                       return_type=plgpu.ShapeDtypeStruct((128 * EARLY_WORDS,), jnp.int32, layout=EARLY_LAYOUT))
    def load(launch_ctx, latent_gmem, scales_gmem, rope_gmem, slots, info):
        del launch_ctx
        i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
        index = ir.IndexType.get()
        words = ir.VectorType.get((4,), i32)

        def global_ptr(ref):
            return llvm.addrspacecast(llvm.PointerType.get(address_space=1), mgpu_utils.memref_ptr(ref))

        limit = memref.load(info, [arith.constant(index, 0)])

        def slot_of(row):  # (valid, the row's slot as i64: 0 past the limit)
            is_valid = arith.cmpi(arith.CmpIPredicate.slt, row, limit)
            slot = arith.select(is_valid, memref.load(slots, [arith.index_cast(index, row)]), _i32(0))
            return is_valid, arith.extui(i64, slot)

        def masked(is_valid, value, zero):  # loads of rows past the limit read slot 0: zeros instead
            return arith.select(is_valid, value, zero)

        zeros = _words([_i32(0)] * 4)
        tid = arith.andi(mgpu_utils.thread_idx(), _i32(127))
        lane, warp = arith.andi(tid, _i32(31)), arith.divui(tid, _i32(32))
        latent, scales, rope = global_ptr(latent_gmem), global_ptr(scales_gmem), global_ptr(rope_gmem)
        latent_column = arith.extui(i64, arith.muli(lane, _i32(CHUNK)))
        scale_column = arith.extui(i64, arith.muli(arith.divui(lane, _i32(8)), _i32(4)))  # chunk l's 128-value tile
        latent_words, scale_words = [], []
        for j in range(rows_per_warp):
            is_valid, slot = slot_of(arith.addi(arith.muli(warp, _i32(rows_per_warp)), _i32(first_row + j)))
            chunk = llvm.load(words, _at(latent, arith.addi(arith.muli(slot, _i64(VALUE_DIM)), latent_column)))
            scale = llvm.load(i32, _at(scales, arith.addi(arith.muli(slot, _i64(SCALES_PER_ROW * 4)), scale_column)))
            latent_words.append(masked(is_valid, chunk, zeros))
            scale_words.append(masked(is_valid, scale, _i32(0)))
        is_valid, slot = slot_of(arith.addi(arith.divui(tid, _i32(4)), _i32(first_row)))
        rope_words = []
        for half in range(2):
            column = arith.muli(arith.addi(arith.muli(arith.andi(tid, _i32(3)), _i32(2)), _i32(half)), _i32(CHUNK))
            chunk = llvm.load(words, _at(rope, arith.addi(arith.muli(slot, _i64(ROPE_DIM * 2)),
                                                          arith.extui(i64, column))))
            rope_words.append(masked(is_valid, chunk, zeros))
        registers = np.empty((EARLY_WORDS // 4,), dtype=object)
        registers[:] = latent_words + [_words(scale_words[:4]), _words(scale_words[4:])] + rope_words
        return mgpu.FragmentedArray(_registers=registers, _layout=EARLY_LAYOUT.to_mgpu(), _is_signed=True)

    return load(latent_ref, scales_ref, rope_ref, slots_ref, info_ref)


def _store_fp8_block(loaded, kv_smem, *, first_row, tokens):
    """`early_loads`' second half, once the stage is free: dequantizes `_load_fp8_block`'s latent bytes into the
    rows' slabs 0 .. 7 of kv_smem ([9, 64, 64] bf16, (8, 64)-tiled, 128B-swizzled; each chunk l's 32 bf16 bytes
    to 16-byte chunks 2 (l % 4) and + 1 of slab l // 4), writes the rope into slab 8, and fences them for the
    async proxy. Lanes of odd slabs store their second chunk first, so each 8-lane phase writes 8 distinct 16-byte
    bank groups. The caller arrives on the stage's barrier."""
    rows_per_warp = tokens // 4

    @plgpu.inline_mgpu(arg_types=(EARLY_LAYOUT, plgpu.RefType(transforms=_tiled((8, SLAB)))))
    def store(launch_ctx, loaded, smem):
        del launch_ctx
        registers = list(loaded.registers.flat)
        latent_words, scale_vectors, rope_words = registers[:8], registers[8:10], registers[10:]
        tid = arith.andi(mgpu_utils.thread_idx(), _i32(127))
        lane, warp = arith.andi(tid, _i32(31)), arith.divui(tid, _i32(32))
        stage = mgpu_utils.memref_ptr(smem)
        slab = arith.divui(lane, _i32(4))
        odd = arith.andi(slab, _i32(1))
        is_odd = arith.cmpi(arith.CmpIPredicate.ne, odd, _i32(0))
        first_chunk = arith.addi(arith.muli(arith.andi(lane, _i32(3)), _i32(2)), odd)
        second_chunk = arith.xori(first_chunk, _i32(1))
        for j in range(rows_per_warp):
            row = arith.addi(arith.muli(warp, _i32(rows_per_warp)), _i32(first_row + j))
            scale_bf16 = arith.shrui(llvm.extractelement(scale_vectors[j // 4], _i32(j % 4)), _i32(16))  # exact
            out = _dequantized([llvm.extractelement(latent_words[j], _i32(i)) for i in range(4)],
                               arith.ori(scale_bf16, arith.shli(scale_bf16, _i32(16))))
            even_chunk, odd_chunk = _words(out[:4]), _words(out[4:])  # chunks 2 (l % 4) and 2 (l % 4) + 1
            llvm.store(arith.select(is_odd, odd_chunk, even_chunk), _at(stage, _swizzled(slab, row, first_chunk)))
            llvm.store(arith.select(is_odd, even_chunk, odd_chunk), _at(stage, _swizzled(slab, row, second_chunk)))
        rope_row = arith.addi(arith.divui(tid, _i32(4)), _i32(first_row))
        for half, value in enumerate(rope_words):
            chunk = arith.addi(arith.muli(arith.andi(tid, _i32(3)), _i32(2)), _i32(half))
            llvm.store(value, _at(stage, _swizzled(_i32(NUM_SLABS - 1), rope_row, chunk)))
        mgpu_utils.commit_shared()  # fence the stores for the async proxy, then a warpgroup barrier

    store(loaded, kv_smem)


def check_registers(registers: tuple[int, int], producers: int) -> None:
    """ValueError unless (compute, producer) registers a thread are multiples of 8 in [24, 256] that sum over the
    two compute and `producers` producer warpgroups to what the kernel starts with (setmaxnreg would hang)."""
    compute, producer = registers
    total = (2 + producers) * LAUNCH_REGISTERS[producers]
    if any(r % 8 or not 24 <= r <= 256 for r in registers) or 2 * compute + producers * producer != total:
        raise ValueError(f"registers (compute, producer) must be multiples of 8 in [24, 256] with 2 * compute + "
                         f"{producers} * producer = {total} ({producers} producer warpgroups); got {registers}")


def _kernel(q_ref, kv_refs, slots_ref, counts_ref, out_ref, lse_ref, scratch, *, scale, num_splits, early_loads,
            registers):
    """kv_refs: (the bf16 cache rows,), or an fp8 latent cache's (e4m3 bytes, scales, rope) rows."""
    fp8 = len(kv_refs) == 3
    producers = PRODUCERS[fp8]
    compute_registers, producer_registers = registers
    (q_smem, kv_smem, meta_smem, row_stats, *staged_scales,
     q_barrier, count_barrier, slots_barriers, kv_barriers, probs_barriers, consumed_barriers, done_barrier) = scratch
    # meta_smem rows 0 .. STAGES-1 hold each stage's slots; row STAGES holds the count (16 ints) and then each
    # stage's gather limit for each producer. row_stats rows 0 .. STAGES-1 hold each stage's rescale factors, row
    # STAGES the reciprocal row sums, row STAGES + 1 stages the lse.
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

        def wait_consumed(block):
            @pl.when(block >= STAGES)
            def _wait():
                plgpu.barrier_wait(consumed_barriers.at[lax.rem(block, STAGES)])

        def block_slots(block):  # this producer's slots of the block, and its gather limit, in the stage's SMEM
            stage = lax.rem(block, STAGES)
            plgpu.copy_gmem_to_smem(slots_ref.at[row, pl.ds(start + block * BLOCK_S + first_row, tokens)],
                                    slots_smem.at[stage, pl.ds(first_row, tokens)], barrier(block))
            plgpu.barrier_wait(barrier(block))
            limit_column = 16 + stage * producers + producer
            meta_smem[STAGES, limit_column] = length - block * BLOCK_S
            return slots_smem.at[stage], meta_smem.at[STAGES, pl.ds(limit_column, 1)]

        if early_loads:  # the block's slots and loads go before the wait for its stage (the slots are this producer's)
            @pl.loop(0, num_blocks)
            def _load_then_store(block):
                stage = lax.rem(block, STAGES)
                loaded = _load_fp8_block(*kv_refs, *block_slots(block), first_row=first_row, tokens=tokens)
                wait_consumed(block)
                _store_fp8_block(loaded, kv_smem.at[stage], first_row=first_row, tokens=tokens)
                plgpu.barrier_arrive(kv_barriers.at[stage])
            return

        @pl.loop(0, num_blocks)
        def _gather(block):
            stage = lax.rem(block, STAGES)
            wait_consumed(block)
            slots, limit = block_slots(block)
            if fp8:
                [scales_smem] = staged_scales
                _cp_async_gather_fp8(*kv_refs, slots, limit, kv_smem.at[stage], scales_smem.at[stage],
                                     first_row=first_row, tokens=tokens)
            else:
                _cp_async_gather(*kv_refs, slots, limit, kv_smem.at[stage])
            plgpu.barrier_arrive(kv_barriers.at[stage])

    for producer in range(producers):
        pl.when(wg == 2 + producer)(functools.partial(produce, producer))


@functools.partial(jax.jit, static_argnames=("sm_scale", "num_splits", "early_loads", "registers"))
def sparse_mla_partials(q, kv_parts, slots, counts, *, sm_scale: float, num_splits: int, early_loads: bool = False,
                        registers: tuple[int, int] | None = None):
    """The kernel on prepared inputs: q bf16 [R, H, 576] (H a multiple of 64); kv_parts (bf16 rows [slots, 576],)
    or an fp8 latent cache's (e4m3 bytes as uint8 [slots, 512], f32 scales [slots, 4], bf16 rope [slots, 64]);
    slots int32 [R, S] (S a multiple of 64), counts int32 [R, 16] (the count in column 0). Returns per-split
    out bf16 [R, N, H, 512] and lse f32 [R, N, H]. early_loads (fp8 only) and registers: `sparse_mla_decode`'s."""
    rows, heads, _ = q.shape
    num_parts = len(kv_parts)
    producers = PRODUCERS[num_parts == 3]
    if early_loads and num_parts != 3:
        raise ValueError("early_loads applies to an fp8 latent cache only")
    if registers is None:
        registers = EARLY_REGISTERS if early_loads else REGISTERS[num_parts == 3]
    check_registers(registers, producers)

    def entry(q_ref, *refs):
        kv_refs, (slots_ref, counts_ref, out_ref, lse_ref) = refs[:num_parts], refs[num_parts:]
        slabs = (STAGES, NUM_SLABS, BLOCK_S, SLAB)
        # The scales the fp8 gather stages (`_cp_async_gather_fp8`); none for a bf16 cache or early loads.
        staged_scales = ([plgpu.SMEM((STAGES, BLOCK_S * SCALES_PER_ROW), jnp.float32)]
                         if num_parts == 3 and not early_loads else [])
        pl.run_scoped(
            lambda *scratch: _kernel(q_ref, kv_refs, slots_ref, counts_ref, out_ref, lse_ref, scratch,
                                     scale=sm_scale * LOG2E, num_splits=num_splits, early_loads=early_loads,
                                     registers=registers),
            plgpu.SMEM((NUM_SLABS, BLOCK_H, SLAB), jnp.bfloat16, transforms=_tiled((8, SLAB))),
            plgpu.SMEM(slabs, jnp.bfloat16, transforms=_tiled((8, SLAB))),
            plgpu.SMEM((STAGES + 1, BLOCK_S), jnp.int32),
            plgpu.SMEM((STAGES + 2, BLOCK_H), jnp.float32),
            *staged_scales,
            plgpu.Barrier(num_arrivals=NUM_SLABS, num_barriers=1),  # one arrival per Q slab copy
            plgpu.Barrier(num_barriers=1),
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
                      early_loads=False, registers=None):
    """The contract of `pallas_kernels.sparse_mla_decode` on this kernel (`unsupported` lists what it needs);
    out is rounded to bf16 in the kernel. num_splits: split-K programs per row (None: `default_num_splits`).
    early_loads (an fp8 latent cache; not yet run on a GPU): each producer loads a block's e4m3 bytes, scales and
    rope into registers before the block's stage is free (`_load_fp8_block`), so that only the dequantization and
    stores wait for it (`_store_fp8_block`); stop 50 measured that dequantizing after the copies costs the fp8
    kernel its whole gap to bf16. registers: (compute, producer) registers a thread of each warpgroup
    (`check_registers`; None: REGISTERS by cache, EARLY_REGISTERS with early_loads)."""
    del value_dim  # always VALUE_DIM here (`unsupported`)
    num_heads = q.shape[1]
    q, kv_parts, slots, counts = prepare(q, kv_cache, slots, counts)
    rows, padded_heads, _ = q.shape
    if num_splits is None:
        num_splits = default_num_splits(rows, padded_heads // BLOCK_H, slots.shape[1], BLOCK_S)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1; got {num_splits=}")
    outs, lses = sparse_mla_partials(q, kv_parts, slots, counts, sm_scale=float(sm_scale), num_splits=num_splits,
                                     early_loads=early_loads, registers=None if registers is None else tuple(registers))
    out, lse = ((outs[:, 0], lses[:, 0]) if num_splits == 1
                else _split_merge_triton.merge_splits(outs, lses, out_dtype=jnp.bfloat16))
    return out[:, :num_heads], lse[:, :num_heads]


def prepare(q, kv_cache, slots, counts):
    """Pads the contract's inputs to the kernel's: heads to a multiple of 64 (zero queries), slots to a multiple
    of 64 (entries past the count are never read), counts to [R, 16] (clipped to [0, S]); q to bf16, the cache
    to the kernel's parts (`sparse_mla_partials`)."""
    heads, num_slots = q.shape[1], slots.shape[1]
    counts = jnp.clip(counts, 0, num_slots)  # counts above S act as S
    q = jnp.pad(q.astype(jnp.bfloat16), ((0, 0), (0, -heads % BLOCK_H), (0, 0)))
    slots = jnp.pad(slots, ((0, 0), (0, -num_slots % BLOCK_S)))
    counts = jnp.pad(counts[:, None], ((0, 0), (0, COUNT_COLUMNS - 1)))
    if isinstance(kv_cache, formats.Fp8LatentCache):
        latent = lax.bitcast_convert_type(kv_cache.latent, jnp.uint8)
        kv_parts = (latent.reshape(-1, VALUE_DIM), kv_cache.scales.reshape(-1, SCALES_PER_ROW),
                    kv_cache.rope.reshape(-1, ROPE_DIM))
    else:
        kv_parts = (kv_cache.reshape(-1, WIDTH),)
    return q, kv_parts, slots, counts
