"""GPU probe for issue 4 (sparse MLA in Mosaic GPU): how fast can a Mosaic GPU kernel gather KV rows by slot id?

Each CTA gathers 64 rows ([576] bf16 = 1152 B each) with one TMA per row piece into SMEM, then writes them out.
Variants: 3 pieces of 192 into an untiled tile; 9 pieces of 64 into a (1, 64)-tiled, 128B-swizzled tile
(the largest tiling Mosaic accepts for one-row copies; wgmma wants (8, 64)). Checks against jnp.take and times a
[64 * 2048]-row gather against the copy bandwidth. Lowers on the CPU venv too (`--lower`).
Run: PYTHONPATH=. python3 bench/probe_mgpu_row_gather.py [--lower]
"""
import sys
import time
import traceback

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

ROWS, DIM, BLOCK = 1 << 20, 576, 64
VARIANTS = {"untiled_3x192": (None, None, 3), "tiled1x64_swizzle128_9x64": ((1, 64), 128, 9)}


def make_gather(tiling, swizzle, pieces):
    transforms = ()
    if tiling:
        transforms += (plgpu.TilingTransform(tiling),)
    if swizzle:
        transforms += (plgpu.SwizzleTransform(swizzle),)
    width = DIM // pieces

    def body(kv_ref, slots_ref, out_ref, slots_smem, rows_smem, slots_barrier, rows_barrier):
        block = jax.lax.axis_index("block")
        plgpu.copy_gmem_to_smem(slots_ref.at[pl.ds(block * BLOCK, BLOCK)], slots_smem, slots_barrier.at[0])
        plgpu.barrier_wait(slots_barrier.at[0])
        for i in range(BLOCK):
            slot = slots_smem[i]
            for p in range(pieces):
                plgpu.copy_gmem_to_smem(kv_ref.at[pl.ds(slot, 1), pl.ds(p * width, width)],
                                        rows_smem.at[pl.ds(i, 1), pl.ds(p * width, width)], rows_barrier.at[0])
        plgpu.barrier_wait(rows_barrier.at[0])
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(rows_smem, out_ref.at[pl.ds(block * BLOCK, BLOCK)])
        plgpu.wait_smem_to_gmem(0)

    def gather(kv, slots):
        return plgpu.kernel(
            body, out_type=jax.ShapeDtypeStruct((slots.shape[0], DIM), kv.dtype), grid=(slots.shape[0] // BLOCK,),
            grid_names=("block",),
            scratch_types=[plgpu.SMEM((BLOCK,), jnp.int32),
                           plgpu.SMEM((BLOCK, DIM), kv.dtype, transforms=transforms),
                           plgpu.Barrier(num_barriers=1),
                           plgpu.Barrier(num_arrivals=BLOCK * pieces, num_barriers=1)],
        )(kv, slots)

    return jax.jit(gather)


def timed(f, *args, n=20):
    jax.block_until_ready(f(*args))
    start = time.perf_counter()
    for _ in range(n):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / n


def main():
    if "--lower" in sys.argv:  # CPU: check that every variant lowers for CUDA
        kv = jax.ShapeDtypeStruct((ROWS, DIM), jnp.bfloat16)
        slots = jax.ShapeDtypeStruct((128,), jnp.int32)
        for name, args in VARIANTS.items():
            make_gather(*args).trace(kv, slots).lower(lowering_platforms=("cuda",))
            print(name, "lowers")
        return
    print("jax", jax.__version__, jax.devices()[0].device_kind, flush=True)
    kv = jax.random.normal(jax.random.key(0), (ROWS, DIM), jnp.bfloat16)
    slots = jax.random.randint(jax.random.key(1), (64 * 2048,), 0, ROWS, jnp.int32)
    want = jnp.take(kv, slots, axis=0)
    t_copy = timed(jax.jit(lambda x: x + 1), kv)
    print(f"copy {2 * kv.nbytes / t_copy / 1e12:.2f} TB/s", flush=True)
    t_take = timed(jax.jit(lambda k, s: jnp.take(k, s, axis=0)), kv, slots)
    print(f"jnp.take: {t_take * 1e6:.1f} us = {want.nbytes / t_take / 1e12:.2f} TB/s gathered", flush=True)
    for name, args in VARIANTS.items():
        try:
            f = make_gather(*args)
            ok = bool(jnp.array_equal(f(kv, slots), want))
            t = timed(f, kv, slots)
            print(f"{name}: equal={ok} {t * 1e6:.1f} us = {want.nbytes / t / 1e12:.2f} TB/s gathered", flush=True)
        except Exception as e:
            print(f"{name}: {type(e).__name__}: {str(e)[:800]}", flush=True)
            traceback.print_exc(limit=3)


if __name__ == "__main__":
    main()
