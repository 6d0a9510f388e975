"""GPU probe for issue 4 (sparse MLA in Mosaic GPU): do one-row TMAs into a (1, 64)-tiled, 128B-swizzled view give
the bytes that wgmma reads through an (8, 64)-tiled view of the same SMEM (a plgpu.RefUnion)?

Gathers 64 rows (first 64 columns) by slot id with one TMA each, then scores = a @ rows.T with one wgmma, and
compares with the same product in XLA. `--lower` only lowers it (works on the CPU venv).
Run: PYTHONPATH=. python3 bench/probe_mgpu_union_view.py [--lower]
"""
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

SWIZZLE = plgpu.SwizzleTransform(128)


def body(a_ref, kv_ref, slots_ref, out_ref, a_smem, kv_union, slots_smem, barriers, rows_barrier, out_smem):
    rows_view, mma_view = kv_union
    plgpu.copy_gmem_to_smem(a_ref, a_smem, barriers.at[0])
    plgpu.barrier_wait(barriers.at[0])
    plgpu.copy_gmem_to_smem(slots_ref, slots_smem, barriers.at[1])
    plgpu.barrier_wait(barriers.at[1])
    for i in range(64):
        plgpu.copy_gmem_to_smem(kv_ref.at[pl.ds(slots_smem[i], 1), pl.ds(0, 64)], rows_view.at[pl.ds(i, 1)],
                                rows_barrier.at[0])
    plgpu.barrier_wait(rows_barrier.at[0])

    def compute(acc_ref):
        plgpu.wgmma(acc_ref, a_smem, mma_view.transpose((1, 0)))
        return acc_ref[...]

    out_smem[...] = pl.run_scoped(compute, plgpu.ACC((64, 64), jnp.float32))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, out_ref)
    plgpu.wait_smem_to_gmem(0)


@jax.jit
def scores(a, kv, slots):
    def tiled(tile):
        return plgpu.TilingTransform(tile), SWIZZLE

    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((64, 64), jnp.float32),
        scratch_types=[plgpu.SMEM((64, 64), jnp.bfloat16, transforms=tiled((8, 64))),
                       plgpu.RefUnion(plgpu.SMEM((64, 64), jnp.bfloat16, transforms=tiled((1, 64))),
                                      plgpu.SMEM((64, 64), jnp.bfloat16, transforms=tiled((8, 64)))),
                       plgpu.SMEM((64,), jnp.int32), plgpu.Barrier(num_barriers=2),
                       plgpu.Barrier(num_arrivals=64, num_barriers=1), plgpu.SMEM((64, 64), jnp.float32)],
    )(a, kv, slots)


def main():
    a_type = jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)
    kv_type = jax.ShapeDtypeStruct((1 << 16, 576), jnp.bfloat16)
    if "--lower" in sys.argv:
        scores.trace(a_type, kv_type, jax.ShapeDtypeStruct((64,), jnp.int32)).lower(lowering_platforms=("cuda",))
        print("lowers")
        return
    a = jax.random.normal(jax.random.key(0), a_type.shape, jnp.bfloat16)
    kv = jax.random.normal(jax.random.key(1), kv_type.shape, jnp.bfloat16)
    slots = jax.random.permutation(jax.random.key(2), kv_type.shape[0])[:64].astype(jnp.int32)
    got = scores(a, kv, slots)
    want = jnp.dot(a, jnp.take(kv, slots, axis=0)[:, :64].T, preferred_element_type=jnp.float32)
    err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
    print(f"union view: max rel error {err:.2e} ({'same bytes' if err < 1e-2 else 'DIFFERENT bytes'})")


if __name__ == "__main__":
    main()
