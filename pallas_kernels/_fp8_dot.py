"""fp8 x fp8 -> f32 dot for Pallas kernels, on Hopper's fp8 tensor cores (wgmma) under the Triton backend.

`lax.dot_general` in a Pallas-Triton kernel emits `tt.dot` with no imprecise-accumulation allowance, and Triton
then refuses fp8 wgmma with an f32 result: it upcasts both operands to f16 and runs mma.sync at half the fp8
rate. `fp8_dot_nt` is the same product with the allowance Triton needs: `max_num_imprecise_acc` contraction
elements may accumulate in the tensor core's reduced-precision (truncated f32) accumulator before each full f32 add
(DeepGEMM's indexer accumulates its whole 128-wide contraction that way). Off the GPU (interpret mode, XLA) the
product is exact f32.

This registers a Pallas-Triton lowering rule through JAX internals (`jax._src.pallas.triton.lowering`, jax 0.11.2).
Meant for kernel bodies: the primitive has no batching or differentiation rules.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax._src import core as jax_core
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas.triton import lowering as triton_lowering
from jax.extend import core as jex_core

_FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
# Triton's MMAv3 (wgmma) takes fp8 with an f32 result only from an allowance of 32 up.
MIN_IMPRECISE_ACC = 32

fp8_dot_nt_p = jex_core.Primitive("fp8_dot_nt")


def fp8_dot_nt(a, b, *, max_num_imprecise_acc: int):
    """a [rows, in] fp8 . b [out, in]^T fp8 -> f32 [rows, out] (both operands contract their last axis)."""
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"fp8_dot_nt wants a [M, K] and b [N, K]; got {a.shape=} {b.shape=}")
    if jnp.dtype(a.dtype) not in _FP8_DTYPES or a.dtype != b.dtype:
        raise ValueError(f"fp8_dot_nt wants two operands of one fp8 dtype; got {a.dtype=} {b.dtype=}")
    if not isinstance(max_num_imprecise_acc, int) or max_num_imprecise_acc < MIN_IMPRECISE_ACC:
        raise ValueError(f"max_num_imprecise_acc must be >= {MIN_IMPRECISE_ACC} (wgmma); got "
                         f"{max_num_imprecise_acc}")
    return fp8_dot_nt_p.bind(a, b, max_num_imprecise_acc=max_num_imprecise_acc)


def _exact_product(a, b, *, max_num_imprecise_acc):
    del max_num_imprecise_acc  # exact everywhere but on the tensor cores
    return lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32), (((1,), (1,)), ((), ())),
                           precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


@fp8_dot_nt_p.def_abstract_eval
def _abstract_eval(a, b, *, max_num_imprecise_acc):
    del max_num_imprecise_acc
    return jax_core.ShapedArray((a.shape[0], b.shape[0]), jnp.float32)


fp8_dot_nt_p.def_impl(_exact_product)
mlir.register_lowering(fp8_dot_nt_p, mlir.lower_fun(_exact_product, multiple_results=False))


@triton_lowering.register_lowering(fp8_dot_nt_p)
def _triton_lowering(ctx, a, b, *, max_num_imprecise_acc):
    [out_aval] = ctx.avals_out
    acc = triton_lowering._zeros(ir.RankedTensorType.get(
        list(out_aval.shape), triton_lowering._dtype_to_ir_type(jnp.float32)))
    b_t = tt_dialect.trans(b, (1, 0))  # [in, out]
    return tt_dialect.dot(a, b_t, acc, max_num_imprecise_acc=max_num_imprecise_acc)
