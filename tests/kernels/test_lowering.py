"""Every Triton kernel lowers to Triton IR for CUDA (an H200) from abstract shapes, for each dtype its contract
takes, at the shapes the models run: the interpreter never runs Triton's lowering, so a kernel that only interprets
(an fp8 load whose `other` the lowering cannot cast, say) would pass the rest of the CPU suite."""

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels
from tests.kernels.triton_ir import triton_modules

FP8 = jnp.float8_e4m3fn
S = jax.ShapeDtypeStruct
ROWS = 8
# (index heads, index dim, page) of DeepSeek-V3.2 and of dsa-tiny.
INDEXER_SHAPES = {"deepseek": (64, 128, 64), "dsa_tiny": (8, 32, 16)}
# (heads, latent width, rope width, page) likewise.
MLA_SHAPES = {"deepseek": (128, 512, 64, 64), "dsa_tiny": (8, 128, 16, 16)}


def _index_keys(pages, page, dim, dtype):
    if dtype == FP8:
        return pallas_kernels.Fp8IndexKeys(S((pages, page, dim), FP8), S((pages, page), jnp.float32))
    return S((pages, page, dim), dtype)


def _indexer_args(shape, dtype):
    heads, dim, page = INDEXER_SHAPES[shape]
    return (S((ROWS, heads, dim), dtype), S((ROWS, heads), jnp.float32), _index_keys(1024, page, dim, dtype),
            S((ROWS, 64), jnp.int32), S((ROWS,), jnp.int32))


def _latent_cache(pages, page, value_dim, rope_dim, dtype):
    if dtype == FP8:
        return pallas_kernels.Fp8LatentCache(S((pages, page, value_dim), FP8),
                                             S((pages, page, value_dim // 128), jnp.float32),
                                             S((pages, page, rope_dim), jnp.bfloat16))
    return S((pages, page, value_dim + rope_dim), dtype)


def _lowers(monkeypatch, fn, *shapes):
    assert triton_modules(monkeypatch, fn, *shapes)  # at least one Triton kernel, lowered without error


@pytest.mark.parametrize("shape", INDEXER_SHAPES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, FP8], ids=["f32", "bf16", "fp8"])
def test_indexer_lowers(monkeypatch, shape, dtype):
    _lowers(monkeypatch, lambda *args: pallas_kernels.indexer_logits(*args, backend="triton", interpret=False),
            *_indexer_args(shape, dtype))


@pytest.mark.parametrize("is_sorted", [True, False], ids=["sorted", "column-order"])
def test_indexer_top_k_and_topk_lower(monkeypatch, is_sorted):
    _lowers(monkeypatch, lambda *args: pallas_kernels.indexer_top_k(*args, k=2048, sorted=is_sorted, backend="triton",
                                                                    interpret=False), *_indexer_args("deepseek", FP8))
    _lowers(monkeypatch, lambda scores, lens: pallas_kernels.topk(scores, lens, k=2048, sorted=is_sorted,
                                                                  backend="triton", interpret=False),
            S((ROWS, 65536), jnp.float32), S((ROWS,), jnp.int32))


@pytest.mark.parametrize("shape", MLA_SHAPES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, FP8], ids=["f32", "bf16", "fp8"])
def test_sparse_mla_lowers(monkeypatch, shape, dtype):
    heads, value_dim, rope_dim, page = MLA_SHAPES[shape]
    q_dtype = jnp.bfloat16 if dtype == FP8 else dtype
    shapes = (S((ROWS, heads, value_dim + rope_dim), q_dtype), _latent_cache(1024, page, value_dim, rope_dim, dtype),
              S((ROWS, 2048), jnp.int32), S((ROWS,), jnp.int32))
    _lowers(monkeypatch, lambda *args: pallas_kernels.sparse_mla_decode(*args, 0.1, value_dim=value_dim,
                                                                         backend="triton", interpret=False), *shapes)


@pytest.mark.parametrize("rows", [64, 4096], ids=["decode", "prefill"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, FP8], ids=["f32", "bf16", "fp8"])
def test_grouped_matmul_lowers(monkeypatch, rows, dtype):
    experts, depth, width = 32, 7168, 2048
    if dtype == FP8:
        shapes = (S((rows, depth), FP8), S((rows, depth // 128), jnp.float32), S((experts, width, depth), FP8),
                  S((experts, width // 128, depth // 128), jnp.float32), S((experts,), jnp.int32))
        _lowers(monkeypatch, lambda *args: pallas_kernels.grouped_matmul_fp8(
            *args, block=(128, 128), out_dtype=jnp.bfloat16, backend="triton", interpret=False), *shapes)
    else:
        shapes = (S((rows, depth), dtype), S((experts, depth, width), dtype), S((experts,), jnp.int32))
        _lowers(monkeypatch, lambda *args: pallas_kernels.grouped_matmul(*args, backend="triton", interpret=False),
                *shapes)
