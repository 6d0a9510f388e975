"""The producer warpgroups' gathers of the Mosaic GPU sparse MLA kernel (`_sparse_mla_mosaic`), in inline Mosaic
GPU: a block's 64 cache rows, named by their slots, into one stage of the kernel's shared memory ([9 slabs, 64,
64] bf16, (8, 64)-tiled, 128B-swizzled; slab 8 the rope), zero rows past the block's limit. From a bf16 cache
(`gather_bf16`), or from an fp8 latent cache staged in the stage with cp.async and dequantized exactly
(`gather_fp8`). The stage layout's constants live here."""

from __future__ import annotations

from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, memref, nvvm
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import formats
from pallas_kernels._mosaic_scalars import global_ptr

VALUE_DIM, ROPE_DIM = 512, 64
WIDTH = VALUE_DIM + ROPE_DIM
SLAB = 64  # columns per 128-byte swizzled slab of bf16
NUM_SLABS = WIDTH // SLAB  # 9: 8 value slabs, then the rope slab
BLOCK_S = 64  # slots per block: the contraction depth of the value wgmmas
ROW_BYTES = WIDTH * 2
SLAB_BYTES = BLOCK_S * SLAB * 2  # one bf16 slab of a stage
CHUNK = 16  # bytes per cp.async
# The fp8 latent cache (formats.Fp8LatentCache): a token's 512 e4m3 bytes, 4 f32 scales, 64 bf16 rope columns.
SCALES_PER_ROW = VALUE_DIM // formats.LATENT_TILE
STAGING_SLAB = 4  # a block's e4m3 bytes are staged in its stage's bf16 slabs 4 .. 7 and dequantized in place
BF16_2_POW_120 = 0x7B80  # 2 ** 120 in bf16: an e4m3 byte moved into bf16's bits is its value times 2 ** -120


def tiled(tile):
    return plgpu.TilingTransform(tile), plgpu.SwizzleTransform(128)


def gather_bf16(kv_ref, slots_ref, info_ref, kv_smem):
    """The producer warpgroup copies the cache rows named by slots_ref [64] into kv_smem ([9, 64, 64],
    (8, 64)-tiled, 128B-swizzled) with cp.async, zero-filling rows at or past info_ref[0]; then waits for its
    copies and fences them for the async proxy (wgmma). The caller arrives on the stage's barrier.

    Warp w copies rows 16w .. 16w + 15; lane l copies 16-byte chunk l % 8 of each 128-byte line of rows
    16w + 4j + l // 8 (j < 4). So one warp instruction copies four whole lines, and each thread computes four
    row addresses once: each of its 36 copies is a row address plus a constant."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType(),
                                  plgpu.RefType(transforms=tiled((8, SLAB)))))
    def gather(launch_ctx, kv_gmem, slots, info, smem):
        del launch_ctx
        i64 = ir.IntegerType.get_signless(64)
        tid = arith.andi(mgpu_utils.thread_idx(), _i32(127))
        first_row = arith.addi(arith.muli(arith.divui(tid, _i32(32)), _i32(16)),
                               arith.andi(arith.divui(tid, _i32(8)), _i32(3)))
        chunk = arith.andi(tid, _i32(7))  # 16-byte chunk within a 128-byte line
        limit = memref.load(info, [arith.constant(ir.IndexType.get(), 0)])
        gmem_base, smem_base = global_ptr(kv_gmem), mgpu_utils.memref_ptr(smem)
        for j in range(BLOCK_S // 16):
            row = arith.addi(first_row, _i32(4 * j))
            is_valid, slot = _slot_of(slots, limit, row)
            src_row = _at(gmem_base, arith.addi(arith.muli(slot, _i64(ROW_BYTES)),
                                                arith.extui(i64, arith.muli(chunk, _i32(CHUNK)))))
            dst_row = _at(smem_base, _swizzled(0, row, chunk))
            size = arith.select(is_valid, _i32(CHUNK), _i32(0))  # 0: zero-fill, read nothing
            for slab in range(NUM_SLABS):  # a slab row is one 128-byte line of the cache row
                nvvm.CpAsyncOp(_at(dst_row, slab * SLAB_BYTES), _at(src_row, slab * SLAB * 2),
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
    `row` of `slab` (row and chunk i32 values, slab a Python int)."""
    line = arith.addi(_i32(slab * SLAB_BYTES), arith.muli(row, _i32(SLAB * 2)))
    return arith.addi(line, arith.muli(arith.xori(chunk, arith.andi(row, _i32(7))), _i32(CHUNK)))


def _slot_of(slots, limit, row):
    """(row < limit, slots[row] as i64: 0 at or past the limit, so a load of it stays in bounds)."""
    is_valid = arith.cmpi(arith.CmpIPredicate.slt, row, limit)
    slot = arith.select(is_valid, memref.load(slots, [arith.index_cast(ir.IndexType.get(), row)]), _i32(0))
    return is_valid, arith.extui(ir.IntegerType.get_signless(64), slot)


def gather_fp8(latent_ref, scales_ref, rope_ref, slots_ref, info_ref, kv_smem, scales_smem, *, first_row,
               tokens):
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
                                  plgpu.RefType(), plgpu.RefType(transforms=tiled((8, SLAB))), plgpu.RefType()))
    def gather(launch_ctx, latent_gmem, scales_gmem, rope_gmem, slots, info, smem, scale_smem):
        del launch_ctx
        i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
        words = ir.VectorType.get((4,), i32)
        limit = memref.load(info, [arith.constant(ir.IndexType.get(), 0)])

        def slot_of(row):
            return _slot_of(slots, limit, row)

        def copy(dst, src, is_valid, size=CHUNK, cache=nvvm.LoadCacheModifierKind.CG):
            nvvm.CpAsyncOp(dst, src, size, cache, cpSize=arith.select(is_valid, _i32(size), _i32(0)))

        tid = arith.andi(mgpu_utils.thread_idx(), _i32(127))
        lane, warp = arith.andi(tid, _i32(31)), arith.divui(tid, _i32(32))
        latent, scales, rope = global_ptr(latent_gmem), global_ptr(scales_gmem), global_ptr(rope_gmem)
        stage, scale_stage = mgpu_utils.memref_ptr(smem), mgpu_utils.memref_ptr(scale_smem)

        def staged_offset(slab, local_row):  # staged slab `slab` (static or not) lies in slab 4 + slab // 2
            return arith.addi(arith.addi(arith.muli(arith.addi(_i32(STAGING_SLAB), arith.shrui(slab, _i32(1))),
                                                    _i32(SLAB_BYTES)),
                                         arith.muli(arith.andi(slab, _i32(1)), _i32(tokens * SLAB))),
                              arith.addi(_i32(first_row * SLAB * 2),
                                         arith.muli(arith.xori(local_row, arith.andi(slab, _i32(1))), _i32(SLAB))))

        staged_slab = arith.divui(lane, _i32(4))
        column = arith.muli(arith.andi(lane, _i32(3)), _i32(CHUNK))
        for j in range(rows_per_warp):
            local_row = arith.addi(arith.muli(warp, _i32(rows_per_warp)), _i32(j))
            is_valid, slot = slot_of(arith.addi(local_row, _i32(first_row)))
            copy(_at(stage, arith.addi(staged_offset(staged_slab, local_row), column)),
                 _at(latent, arith.addi(arith.muli(slot, _i64(VALUE_DIM)),
                                       arith.extui(i64, arith.muli(lane, _i32(CHUNK))))), is_valid)
        # Rope rows: as `gather_bf16`, into slab 8.
        first_rope_row = arith.addi(arith.addi(arith.muli(warp, _i32(rows_per_warp)), _i32(first_row)),
                                    arith.andi(arith.divui(tid, _i32(8)), _i32(3)))
        chunk = arith.andi(tid, _i32(7))
        for j in range(tokens // 16):
            row = arith.addi(first_rope_row, _i32(4 * j))
            is_valid, slot = slot_of(row)
            copy(_at(stage, _swizzled(NUM_SLABS - 1, row, chunk)),
                 _at(rope, arith.addi(arith.muli(slot, _i64(ROPE_DIM * 2)),
                                     arith.extui(i64, arith.muli(chunk, _i32(CHUNK))))), is_valid)
        # Scales: scale_bytes a thread.
        pieces = SCALES_PER_ROW * 4 // scale_bytes  # threads a row
        row, piece = arith.addi(arith.divui(tid, _i32(pieces)), _i32(first_row)), arith.remui(tid, _i32(pieces))
        is_valid, slot = slot_of(row)
        copy(_at(scale_stage, arith.addi(_i32(first_row * SCALES_PER_ROW * 4), arith.muli(tid, _i32(scale_bytes)))),
             _at(scales, arith.addi(arith.muli(slot, _i64(SCALES_PER_ROW * 4)),
                                   arith.extui(i64, arith.muli(piece, _i32(scale_bytes))))),
             is_valid, size=scale_bytes, cache=nvvm.LoadCacheModifierKind.CA)
        nvvm.cp_async_commit_group()
        nvvm.cp_async_wait_group(0)
        mgpu_utils.warpgroup_barrier()  # every thread's copies landed

        token, part = arith.divui(tid, _i32(4)), arith.andi(tid, _i32(3))

        def vector_extract(vector, i):
            return llvm.extractelement(vector, _i32(i))

        def load(slab, j):  # this thread's j-th 16 staged bytes of `slab` and its token's scale pair
            local_row = arith.addi(token, _i32(32 * j))
            row = arith.addi(local_row, _i32(first_row))
            src = _at(stage, arith.addi(staged_offset(_i32(slab), local_row), arith.muli(part, _i32(CHUNK))))
            vector = llvm.load(words, src)
            scale_bits = llvm.load(i32, _at(scale_stage, arith.addi(arith.muli(row, _i32(SCALES_PER_ROW * 4)),
                                                                  _i32(slab // 2 * 4))))
            high = arith.shrui(scale_bits, _i32(16))  # a power of two (or 0) is exact in bf16
            scale_pair = arith.ori(high, arith.shli(high, _i32(16)))
            return row, [vector_extract(vector, i) for i in range(4)], scale_pair

        def store(slab, loaded):
            row, parts, scale_pair = loaded
            out = _dequantized(parts, scale_pair)
            for half in range(2):  # bf16 chunks 2 * part and 2 * part + 1 of the row's line
                chunk = arith.addi(arith.muli(part, _i32(2)), _i32(half))
                llvm.store(_words(out[4 * half:4 * half + 4]), _at(stage, _swizzled(slab, row, chunk)))

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

