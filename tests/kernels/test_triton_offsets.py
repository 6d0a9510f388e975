"""pallas_kernels/_triton_offsets.py: the Triton kernels address fp8 arrays past 2**31 elements with 64-bit offsets
(JAX's lowering alone gives them 32-bit offsets up to 4 GiB, which wrap), and smaller arrays keep 32-bit ones."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.triton import lowering as triton_lowering
from jax.experimental import pallas as pl

import pallas_kernels
from pallas_kernels import formats
from tests.kernels.triton_ir import triton_modules

FP8 = jnp.float8_e4m3fn
S = jax.ShapeDtypeStruct
ROWS, PAGE = 8, 16


def _indexer(pages):
    keys = pallas_kernels.Fp8IndexKeys(S((pages, PAGE, 32), FP8), S((pages, PAGE), jnp.float32))
    shapes = (S((ROWS, 8, 32), FP8), S((ROWS, 8), jnp.float32), keys, S((ROWS, 64), jnp.int32), S((ROWS,), jnp.int32))
    return lambda *args: pallas_kernels.indexer_logits(*args, backend="triton", interpret=False), shapes


def _sparse_mla(pages):
    cache = pallas_kernels.Fp8LatentCache(S((pages, PAGE, 128), FP8), S((pages, PAGE, 1), jnp.float32),
                                          S((pages, PAGE, 16), jnp.bfloat16))
    shapes = (S((ROWS, 8, 144), jnp.bfloat16), cache, S((ROWS, 64), jnp.int32), S((ROWS,), jnp.int32))
    return (lambda *args: pallas_kernels.sparse_mla_decode(*args, 0.1, value_dim=128, backend="triton",
                                                           interpret=False), shapes)


def _grouped_matmul(experts):
    depth, width = 7168, 2048  # DeepSeek-V3.2's experts' gate/up: 256 of them are 3.5 GiB of e4m3
    shapes = (S((64, depth), FP8), S((64, depth // 128), jnp.float32), S((experts, width, depth), FP8),
              S((experts, width // 128, depth // 128), jnp.float32), S((experts,), jnp.int32))
    return (lambda *args: pallas_kernels.grouped_matmul_fp8(*args, block=(128, 128), out_dtype=jnp.bfloat16,
                                                            backend="triton", interpret=False), shapes)


# (kernel, a size whose fp8 operand holds 2**31 to 2**32 elements (under 4 GiB), a small size)
KERNELS = {"indexer": (_indexer, 6_000_000, 64), "sparse_mla": (_sparse_mla, 1_500_000, 64),
           "grouped_matmul": (_grouped_matmul, 256, 8)}


def _offset_widths(monkeypatch, kernel, size) -> dict[tuple, set[str]]:
    """(shape, dtype) of each array the kernel loads or stores -> the widths of its offsets in the Triton IR."""
    fn, shapes = kernel(size)
    widths = {}
    offsets = triton_lowering._compute_offsets_from_indices

    def spy(block_info, nd_indexer):
        result = offsets(block_info, nd_indexer)
        aval = block_info.full_shape_dtype
        widths.setdefault((aval.shape, str(aval.dtype)), set()).add(str(result.type).rstrip(">").split("x")[-1])
        return result

    monkeypatch.setattr(triton_lowering, "_compute_offsets_from_indices", spy)
    triton_modules(monkeypatch, fn, *shapes)
    return widths


@pytest.mark.parametrize("name", KERNELS)
def test_fp8_arrays_past_2g_elements_get_64_bit_offsets(monkeypatch, name):
    kernel, large, small = KERNELS[name]
    for size in large, small:
        widths = _offset_widths(monkeypatch, kernel, size)
        fp8 = {shape: width for (shape, dtype), width in widths.items() if dtype == "float8_e4m3fn"}
        assert fp8 and all(width == ({"i64"} if math.prod(shape) > 2**31 else {"i32"}) for shape, width in fp8.items())
        assert any(math.prod(shape) > 2**31 for shape in fp8) == (size == large)


def test_without_the_fix_the_lowering_gives_those_arrays_32_bit_offsets(monkeypatch):
    """What the fix is for: JAX's own rule counts bytes (64-bit over 2**32), the offsets count elements."""
    monkeypatch.setattr(triton_lowering, "_compute_offsets_from_indices",
                        triton_lowering._compute_offsets_from_indices.__wrapped__)
    kernel, large, _ = KERNELS["indexer"]
    widths = _offset_widths(monkeypatch, kernel, large)
    assert widths[((large * PAGE, 32), "float8_e4m3fn")] == {"i32"}  # the kernel's folded [slots, Di] keys


def _copy_block(start, x):
    """A kernel that reads x[start : start + 16] (a dynamic start: offsets up to x.size - 1)."""
    def kernel(start_ref, x_ref, out_ref):
        out_ref[...] = x_ref[pl.ds(start_ref[0], 16)]

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16,), x.dtype), in_specs=[pl.no_block_spec] * 2,
                          out_specs=pl.no_block_spec, interpret=False)(start, x)


@pytest.mark.parametrize("dtype", [FP8, jnp.int8, jnp.bool_, jnp.bfloat16], ids=["fp8", "int8", "bool", "bf16"])
def test_the_boundary_is_the_last_offset_past_int32(monkeypatch, dtype):
    """2**31 elements (last offset 2**31 - 1) keep 32-bit offsets, one more takes 64-bit ones: one-byte elements by
    the fix, two-byte ones by the lowering's own rule (over 2**32 bytes), left as it is."""
    for size, width in ((2**31, "i32"), (2**31 + 1, "i64")):
        widths = _offset_widths(monkeypatch, lambda size: (_copy_block, (S((1,), jnp.int32), S((size,), dtype))),
                                size)
        assert widths[((size,), str(jnp.dtype(dtype)))] == {width}, size


def _scatter_pages(pool, pages, values):
    return pool.at[jnp.asarray(pages)].set(values)


@pytest.mark.gpu
def test_fp8_index_keys_of_3_gib_are_read_right_past_element_2g_compiled():
    """6M pages of [16, 32] e4m3 keys (3.1 GB): pages from 4,194,304 (element 2**31) on were read 4 GiB early."""
    rng = np.random.default_rng(0)
    num_pages, pages = 6_000_000, [1000, 4_100_000, 4_300_000, 5_999_999]
    keys = formats.quantize_index_keys(jnp.asarray(rng.standard_normal((len(pages), PAGE, 32)), jnp.float32))
    pool = pallas_kernels.Fp8IndexKeys(
        _scatter_pages(jnp.zeros((num_pages, PAGE, 32), FP8), pages, keys.keys),
        _scatter_pages(jnp.zeros((num_pages, PAGE), jnp.float32), pages, keys.scales))
    q, weights = formats.quantize_index_queries(jnp.asarray(rng.standard_normal((len(pages), 8, 32)), jnp.float32),
                                                jnp.asarray(rng.standard_normal((len(pages), 8)), jnp.float32))
    lens = jnp.full((len(pages),), PAGE, jnp.int32)
    out = pallas_kernels.indexer_logits(q, weights, pool, jnp.asarray(pages, jnp.int32)[:, None], lens,
                                        backend="triton")
    # The reference reads the same keys from a pool of just those pages.
    want = pallas_kernels.reference.indexer_logits(q, weights, keys, jnp.arange(len(pages), dtype=jnp.int32)[:, None],
                                                   lens)
    # As the other fp8 indexer tests: a norm-relative error (heads cancel in some scores); a wrapped read is off by
    # the whole score.
    err = np.linalg.norm(np.asarray(out) - np.asarray(want)) / np.linalg.norm(np.asarray(want))
    assert err <= 2e-3, f"relative error {err:.2e}"


@pytest.mark.gpu
def test_fp8_latent_cache_of_3_gib_is_read_right_past_element_2g_compiled():
    """1.5M pages of [16, 128] e4m3 latents (3.1 GB): pages from 1,048,576 (element 2**31) on were read 4 GiB
    early."""
    rng = np.random.default_rng(1)
    num_pages, pages = 1_500_000, [10, 1_100_000, 1_499_999]
    filled = formats.quantize_latent_cache(
        jnp.asarray(rng.standard_normal((len(pages), PAGE, 144)), jnp.float32), value_dim=128)
    cache = pallas_kernels.Fp8LatentCache(*(
        _scatter_pages(jnp.zeros((num_pages, *part.shape[1:]), part.dtype), pages, part)
        for part in (filled.latent, filled.scales, filled.rope)))
    q = jnp.asarray(rng.standard_normal((len(pages), 8, 144)), jnp.bfloat16)
    offsets, counts = jnp.arange(PAGE, dtype=jnp.int32), jnp.full((len(pages),), PAGE, jnp.int32)
    slots = jnp.asarray(pages, jnp.int32)[:, None] * PAGE + offsets
    out, lse = pallas_kernels.sparse_mla_decode(q, cache, slots, counts, 0.1, value_dim=128, backend="triton")
    # The reference reads the same tokens from a cache of just those pages.
    own_slots = jnp.arange(len(pages), dtype=jnp.int32)[:, None] * PAGE + offsets
    want, want_lse = pallas_kernels.reference.sparse_mla_decode(q, filled, own_slots, counts, 0.1, value_dim=128)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-3, atol=1e-3)
