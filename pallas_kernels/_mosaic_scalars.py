"""GMEM helpers of inline Mosaic GPU: a ref's global-space pointer, and small int32s a kernel reads without a TMA
(a TMA row must be at least 16 bytes, so a per-row length would need a padded copy made by an XLA op before the
kernel)."""

from __future__ import annotations

import jax.numpy as jnp
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, memref
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu


def global_ptr(ref):
    """A GMEM ref's address as a global-space pointer (in inline Mosaic GPU)."""
    return llvm.addrspacecast(llvm.PointerType.get(address_space=1), mgpu_utils.memref_ptr(ref))


def read_ints(gmem_ref, smem_ref):
    """Every thread of the warpgroup reads the int32s of gmem_ref [size] and stores them to smem_ref [size] (the same
    values, so the stores agree); a warpgroup barrier follows, so the warpgroup may read smem_ref."""
    [size] = gmem_ref.shape
    if gmem_ref.dtype != jnp.int32 or smem_ref.dtype != jnp.int32 or smem_ref.shape != (size,):
        raise TypeError(f"read_ints takes int32 [n] refs; got {gmem_ref.dtype} {gmem_ref.shape} -> "
                        f"{smem_ref.dtype} {smem_ref.shape}")

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()))
    def read(launch_ctx, gmem, smem):
        del launch_ctx
        i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
        base = global_ptr(gmem)
        values = [llvm.load(i32, mgpu_utils.getelementptr(base, [i], i32)) for i in range(size)]
        for i, value in enumerate(values):
            memref.store(value, smem, [arith.constant(index, i)])
        mgpu_utils.warpgroup_barrier()

    read(gmem_ref, smem_ref)
