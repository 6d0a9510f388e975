"""pallas_kernels/_fp8_dot.py: exact off the GPU, and the Triton lowering carries the accumulation allowance."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import pallas_kernels
from pallas_kernels._fp8_dot import fp8_dot_nt
from tests.kernels.triton_ir import triton_modules

FP8 = jnp.float8_e4m3fn


def test_fp8_dot_nt_is_the_exact_product():
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((64, 128)), FP8)
    b = jnp.asarray(rng.standard_normal((16, 128)), FP8)
    want = np.asarray(a, np.float32) @ np.asarray(b, np.float32).T
    np.testing.assert_array_equal(jax.jit(lambda a, b: fp8_dot_nt(a, b, max_num_imprecise_acc=128))(a, b), want)


@pytest.mark.parametrize("a, b, acc, match", [
    (jnp.zeros((4, 8), FP8), jnp.zeros((4, 16), FP8), 32, "a \\[M, K\\]"),
    (jnp.zeros((4, 8), jnp.bfloat16), jnp.zeros((4, 8), jnp.bfloat16), 32, "fp8 dtype"),
    (jnp.zeros((4, 8), FP8), jnp.zeros((4, 8), FP8), 16, ">= 32"),
    (jnp.zeros((4, 8), FP8), jnp.zeros((4, 8), FP8), 32.5, ">= 32"),
])
def test_fp8_dot_nt_rejects_bad_inputs(a, b, acc, match):
    with pytest.raises(ValueError, match=match):
        fp8_dot_nt(a, b, max_num_imprecise_acc=acc)


def _triton_ir(monkeypatch, **knobs):
    """The indexer kernel's Triton IR, lowered for an H200 on this CPU machine."""
    shapes = (jax.ShapeDtypeStruct((2, 64, 128), FP8), jax.ShapeDtypeStruct((2, 64), jnp.float32),
              jax.ShapeDtypeStruct((64, 64, 128), FP8), jax.ShapeDtypeStruct((2, 16), jnp.int32),
              jax.ShapeDtypeStruct((2,), jnp.int32))
    [module] = triton_modules(monkeypatch, lambda *args: pallas_kernels.indexer_logits(
        *args, backend="triton", interpret=False, **knobs), *shapes)
    return module


def test_indexer_fp8_dot_lowers_with_the_allowance(monkeypatch):
    """What makes Triton pick fp8 wgmma: tt.dot on fp8 operands with maxNumImpreciseAcc >= 32."""
    module = _triton_ir(monkeypatch, fp8_imprecise_acc=128)
    [dot] = [line for line in module.splitlines() if "tt.dot" in line]
    assert "maxNumImpreciseAcc = 128" in dot and "f8E4M3FN" in dot
    exact = _triton_ir(monkeypatch, fp8_imprecise_acc=None)
    assert "maxNumImpreciseAcc = 0" in exact or "maxNumImpreciseAcc" not in exact
