"""pallas_kernels.indexer_logits (the Triton and Mosaic kernels) against reference.indexer_logits: interpreted on
CPU, compiled on GPU."""

import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import pallas_kernels
from pallas_kernels import _indexer_mosaic as indexer_mosaic
from pallas_kernels import _topk_triton
from pallas_kernels import formats, reference
from pallas_kernels.formats import Fp8IndexKeys

FP8 = jnp.float8_e4m3fn


def _case(seed, *, rows, heads, dim, page_size, max_blocks, lens, dtype, with_scale=False):
    """Random inputs; each row gets distinct random pages for its first ceil(len/page) blocks, -1 after."""
    rng = np.random.default_rng(seed)
    num_pages = rows * max_blocks + 3
    q = rng.standard_normal((rows, heads, dim), np.float32)
    keys = rng.standard_normal((num_pages, page_size, dim), np.float32)
    weights = jnp.asarray(rng.standard_normal((rows, heads)), jnp.float32)
    block_tables = np.full((rows, max_blocks), -1, np.int32)
    pages = rng.permutation(num_pages)
    for r, n in enumerate(lens):
        used = -(-n // page_size)
        block_tables[r, :used] = pages[r * max_blocks:r * max_blocks + used]
    if dtype == FP8:
        q, weights = formats.quantize_index_queries(jnp.asarray(q), weights)
        cache = formats.quantize_index_keys(jnp.asarray(keys))
    else:
        q, cache = jnp.asarray(q, dtype), jnp.asarray(keys, dtype)
        if with_scale:  # the kernels' scale path on keys of a wider dtype
            cache = Fp8IndexKeys(cache, jnp.asarray(rng.uniform(0.5, 2.0, (num_pages, page_size)), jnp.float32))
    return q, weights, cache, jnp.asarray(block_tables), jnp.asarray(lens, jnp.int32)


def test_reference_keeps_fp8_queries_rounded_under_jit():
    """The reference reads e4m3 queries through an optimization barrier (`formats.kept_e4m3`): quantized in the same
    program, XLA's GPU compiler would otherwise drop their rounding; other queries go straight in."""
    fp8_args = _case(2, rows=2, heads=4, dim=16, page_size=4, max_blocks=2, lens=[3, 8], dtype=FP8)
    plain_args = _case(2, rows=2, heads=4, dim=16, page_size=4, max_blocks=2, lens=[3, 8], dtype=jnp.bfloat16)
    barriers = [str(jax.make_jaxpr(reference.indexer_logits)(*args)).count("optimization_barrier")
                for args in (fp8_args, plain_args)]
    assert barriers == [1, 0]


def _check(args, *, rtol, backend="triton", **knobs):
    out = np.asarray(pallas_kernels.indexer_logits(*args, backend=backend, **knobs))
    ref = np.asarray(reference.indexer_logits(*args))
    lens = np.asarray(args[4])
    is_valid = np.arange(ref.shape[1])[None, :] < lens[:, None]
    assert out.shape == ref.shape and out.dtype == np.float32
    np.testing.assert_array_equal(out[~is_valid], -np.inf)
    assert np.isfinite(out[is_valid]).all()
    err = np.linalg.norm(out[is_valid] - ref[is_valid]) / max(np.linalg.norm(ref[is_valid]), 1e-30)
    assert err <= rtol, f"relative error {err:.2e} > {rtol:.0e}"


# (rows, heads, dim, page_size, max_blocks, lens): lengths 0, < one chunk, not a multiple of the page or chunk,
# and full; tokens per row not a power of two (output slicing) and pad rows (len 0, block table all -1).
CASES = [
    (3, 4, 16, 4, 5, [0, 7, 20]),
    (4, 8, 32, 8, 8, [64, 1, 33, 0]),
    (5, 8, 16, 16, 3, [48, 17, 0, 16, 5]),
]
RTOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-5, FP8: 1e-5}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, FP8], ids=["f32", "bf16", "fp8"])
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_indexer_logits_matches_reference(case, dtype):
    rows, heads, dim, page_size, max_blocks, lens = case
    args = _case(0, rows=rows, heads=heads, dim=dim, page_size=page_size, max_blocks=max_blocks, lens=lens,
                 dtype=dtype, with_scale=dtype == jnp.bfloat16)
    _check(args, rtol=RTOL[dtype])
    _check(args, rtol=RTOL[dtype], backend="pallas")  # the default picks the Triton kernel here


def test_indexer_logits_several_chunks_per_program():
    """block_t > chunk_t: one program walks valid chunks, then stores -inf for the rest."""
    args = _case(1, rows=3, heads=4, dim=16, page_size=4, max_blocks=16, lens=[64, 21, 0], dtype=jnp.float32,
                 with_scale=True)
    _check(args, rtol=1e-5, block_t=64, chunk_t=16)


@pytest.mark.parametrize("fp8_imprecise_acc", [None, 32])
def test_indexer_logits_fp8_mma_modes(fp8_imprecise_acc):
    """Both fp8 paths (exact f16 products, fp8 wgmma with an accumulation allowance) match off the GPU."""
    args = _case(3, rows=3, heads=16, dim=64, page_size=16, max_blocks=8, lens=[128, 77, 0], dtype=FP8)
    _check(args, rtol=1e-5, fp8_imprecise_acc=fp8_imprecise_acc)


def test_indexer_logits_bf16_queries_fp8_keys():
    """Mixed dtypes multiply in the wider one (fp8 keys upcast to bf16 in the kernel)."""
    q8, *rest = _case(2, rows=2, heads=4, dim=32, page_size=8, max_blocks=4, lens=[30, 9], dtype=FP8)
    _check((q8.astype(jnp.bfloat16), *rest), rtol=1e-5)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(q=jnp.zeros((2, 4))), "q.shape"),
        (dict(weights=jnp.zeros((2, 8))), "weights.shape"),
        (dict(cache=jnp.zeros((6, 4, 32))), "head dim"),
        (dict(q=jnp.zeros((2, 4, 24)), cache=jnp.zeros((6, 4, 24))), "power of two"),
        (dict(q=jnp.zeros((2, 4, 16), jnp.float16)), "dtype"),
        (dict(block_tables=jnp.zeros((2, 3), jnp.float32)), "int32"),
        (dict(lens=jnp.zeros((3,), jnp.int32)), "lens.shape"),
        (dict(cache=Fp8IndexKeys(jnp.zeros((6, 4, 16)), jnp.zeros((6, 8), jnp.float32))), "scales"),
    ],
)
def test_indexer_logits_rejects_bad_inputs(change, match):
    args = dict(q=jnp.zeros((2, 4, 16)), weights=jnp.zeros((2, 4)), cache=jnp.zeros((6, 4, 16)),
                block_tables=jnp.zeros((2, 3), jnp.int32), lens=jnp.zeros((2,), jnp.int32))
    args.update(change)
    with pytest.raises(ValueError, match=match):
        pallas_kernels.indexer_logits(*args.values())


def test_indexer_logits_rejects_bad_knobs():
    args = _case(0, rows=1, heads=4, dim=16, page_size=4, max_blocks=2, lens=[5], dtype=jnp.float32)
    with pytest.raises(ValueError, match="chunk_t"):
        pallas_kernels.indexer_logits(*args, backend="triton", chunk_t=24)
    with pytest.raises(ValueError, match="block_t"):
        pallas_kernels.indexer_logits(*args, backend="triton", block_t=32, chunk_t=64)
    with pytest.raises(ValueError, match="fp8_imprecise_acc"):
        pallas_kernels.indexer_logits(*args, backend="triton", fp8_imprecise_acc=16)
    with pytest.raises(ValueError, match="backend must be"):
        pallas_kernels.indexer_logits(*args, backend="cuda")
    with pytest.raises(TypeError, match="explicit backend"):  # the default's knobs are not a caller's to turn
        pallas_kernels.indexer_logits(*args, chunk_t=16)
    with pytest.raises(ValueError, match="backend='mosaic' cannot run.*fp8.*interpreter"):  # f32 keys, on CPU
        pallas_kernels.indexer_logits(*args, backend="mosaic")


def test_backend_table_says_why_mosaic_does_not_apply():
    """No silent fallback: every reason is named, and the default names the backend each one belongs to."""
    args = _case(0, rows=1, heads=4, dim=16, page_size=4, max_blocks=2, lens=[5], dtype=jnp.float32)
    reasons = pallas_kernels.unsupported("indexer_logits", "mosaic", *args)
    assert any("fp8" in r for r in reasons) and any("pages of 64" in r for r in reasons)
    assert pallas_kernels.unsupported("indexer_logits", "reference", *args) == []
    assert pallas_kernels.choose("indexer_logits", "pallas", *args) == "triton"
    bad = (jnp.zeros((1, 4, 24)), args[1], jnp.zeros((6, 4, 24)), *args[3:])
    with pytest.raises(ValueError, match="mosaic: .*triton: Di must be a power of two"):
        pallas_kernels.indexer_logits(*bad)


@pytest.mark.parametrize("rows, heads, max_blocks, pages_per_cta, stages, rows_per_cta",
                         [(4, 64, 64, 16, 4, 1), (3, 16, 8, 4, 2, 1), (1, 128, 256, 32, 6, 1), (8, 64, 64, 16, 4, 4),
                          (4, 128, 32, 8, 3, 2), (6, 16, 8, 4, 2, 3)])
@pytest.mark.parametrize("with_maxima", [False, True], ids=["logits", "with-maxima"])
def test_mosaic_kernel_lowers_for_cuda(rows, heads, max_blocks, pages_per_cta, stages, rows_per_cta, with_maxima):
    """No interpreter runs the Mosaic GPU kernel; lowering it for CUDA checks its layouts and SMEM plan: a row a
    CTA, or rows_per_cta rows (one wgmma of their heads side by side where their tables agree, else row by
    row)."""
    fp8 = jnp.float8_e4m3fn
    args = (jax.ShapeDtypeStruct((rows, heads, indexer_mosaic.DIM), fp8),
            jax.ShapeDtypeStruct((rows, heads), jnp.float32),
            jax.ShapeDtypeStruct((1000, indexer_mosaic.PAGE, indexer_mosaic.DIM), fp8),
            jax.ShapeDtypeStruct((1000, indexer_mosaic.PAGE), jnp.float32),
            jax.ShapeDtypeStruct((rows, max_blocks), jnp.int32),
            jax.ShapeDtypeStruct((rows,), jnp.int32))
    indexer_mosaic.indexer_logits_pages.trace(*args, pages_per_cta=pages_per_cta, stages=stages,
                                              rows_per_cta=rows_per_cta, with_maxima=with_maxima).lower(
        lowering_platforms=("cuda",))


@pytest.mark.parametrize("entry", ["indexer_logits", "indexer_top_k"])
@pytest.mark.parametrize("rows, rows_per_cta", [(2048, 2), (2047, 1), (8, 1)])
def test_mosaic_pairs_the_rows_of_prefill_sized_calls(monkeypatch, entry, rows, rows_per_cta):
    """By default calls of SHARED_ROWS_MIN (2048) rows or more score rows in pairs, through the logits and through
    the top-k (the engine's call, here with the group maxima fused); smaller ones (decode steps) one row a CTA; and
    the logits call lowers for CUDA (the top-k's Triton kernels lower only where a GPU is)."""
    fp8 = jnp.float8_e4m3fn
    S = jax.ShapeDtypeStruct
    args = (S((rows, 64, indexer_mosaic.DIM), fp8), S((rows, 64), jnp.float32),
            S((1000, indexer_mosaic.PAGE, indexer_mosaic.DIM), fp8), S((rows, 32), jnp.int32), S((rows,), jnp.int32))
    kernel, chosen = indexer_mosaic.indexer_logits_pages, []
    monkeypatch.setattr(indexer_mosaic, "indexer_logits_pages",
                        lambda *a, **knobs: chosen.append(knobs["rows_per_cta"]) or kernel(*a, **knobs))
    extra = dict(k=64) if entry == "indexer_top_k" else {}
    call = jax.jit(lambda q, w, keys, tables, lens: getattr(indexer_mosaic, entry)(
        q, w, keys, tables, lens, k_scale=jnp.ones(keys.shape[:2], jnp.float32), **extra))
    traced = call.trace(*args)
    if entry == "indexer_logits":
        traced.lower(lowering_platforms=("cuda",))
    assert chosen == [rows_per_cta]


def test_mosaic_rows_are_not_paired_when_two_rows_heads_pass_one_wgmma():
    assert indexer_mosaic.default_rows_per_cta(4096, 128) == 2
    assert indexer_mosaic.default_rows_per_cta(4096, 256) == 1  # 256 heads fill one wgmma N alone


def test_mosaic_rows_per_cta_is_checked_before_anything_is_traced():
    """rows_per_cta x the padded heads fill at most one wgmma N (256)."""
    q, weights, cache, tables, lens = _case(1, rows=4, heads=64, dim=128, page_size=64, max_blocks=2,
                                            lens=[1, 2, 3, 4], dtype=FP8)
    with pytest.raises(ValueError, match="rows_per_cta x 64 padded heads <= 256"):
        indexer_mosaic.indexer_logits(q, weights, cache.keys, tables, lens, k_scale=cache.scales, rows_per_cta=8)
    with pytest.raises(ValueError, match="need rows_per_cta >= 1"):
        indexer_mosaic.indexer_logits(q, weights, cache.keys, tables, lens, k_scale=cache.scales, rows_per_cta=0)


def test_mosaic_decode_call_is_the_kernel_alone():
    """A decode call of the kernel's shapes (64 heads, tables of whole CTAs, f32 weights) lowers to the kernel and
    reshapes: the lens are read in the kernel as they are."""
    fp8, S = jnp.float8_e4m3fn, jax.ShapeDtypeStruct
    args = (S((8, 64, indexer_mosaic.DIM), fp8), S((8, 64), jnp.float32),
            S((1000, indexer_mosaic.PAGE, indexer_mosaic.DIM), fp8), S((1000, indexer_mosaic.PAGE), jnp.float32),
            S((8, 32), jnp.int32), S((8,), jnp.int32))
    text = jax.jit(lambda q, w, keys, scales, tables, lens: indexer_mosaic.indexer_logits(
        q, w, keys, tables, lens, k_scale=scales)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert set(re.findall(r"stablehlo\.\w+", text)) == {"stablehlo.custom_call", "stablehlo.reshape"}


def test_mosaic_prepare_pads_to_the_kernel():
    tables = jnp.arange(10, dtype=jnp.int32).reshape(2, 5)
    weights, padded, lens = indexer_mosaic.prepare(jnp.ones((2, 3), jnp.bfloat16), tables,
                                                   jnp.array([999, -4], jnp.int32), pages_per_cta=4)
    assert weights.dtype == jnp.float32
    np.testing.assert_array_equal(padded[:, :5], tables)
    assert padded.shape == (2, 8)
    # Clipped to the tables' tokens, as the tables are padded; the kernel clips the rest.
    np.testing.assert_array_equal(lens, [5 * indexer_mosaic.PAGE, -4])
    # Tables of whole CTAs and lens pass as they are: no XLA op before the kernel.
    tables = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)
    lens = jnp.array([999, -4], jnp.int32)
    _, padded, lens_p = indexer_mosaic.prepare(jnp.ones((2, 3), jnp.float32), tables, lens, pages_per_cta=4)
    assert padded is tables and lens_p is lens


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, fp8_imprecise_acc, backend",
                         [(FP8, 128, "triton"), (FP8, 128, "mosaic"), (FP8, None, "triton"),
                          (jnp.bfloat16, None, "triton")],
                         ids=["fp8-wgmma", "fp8-mosaic", "fp8-exact", "bf16"])
def test_indexer_logits_compiled_real_shapes(dtype, fp8_imprecise_acc, backend):
    """DeepSeek-V3.2 indexer (Hi=64, Di=128, page 64) compiled with the default knobs; mixed lengths."""
    lens = [0, 1, 63, 64, 1000, 4095, 3000, 4096]
    args = _case(4, rows=8, heads=64, dim=128, page_size=64, max_blocks=64, lens=lens, dtype=dtype,
                 with_scale=True)
    knobs = dict(fp8_imprecise_acc=fp8_imprecise_acc) if backend == "triton" else {}
    _check(args, rtol=2e-3 if dtype == FP8 else 1e-4, interpret=False, backend=backend, **knobs)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [FP8, jnp.bfloat16], ids=["fp8", "bf16"])
def test_dsa_tiny_shapes_compiled(dtype):
    """The kernel `backend="pallas"` picks at dsa-tiny's indexer shapes (8 heads of 32, pages of 16), compiled."""
    lens = [0, 1, 15, 16, 300, 1023, 777, 1024]
    args = _case(8, rows=8, heads=8, dim=32, page_size=16, max_blocks=64, lens=lens, dtype=dtype,
                 with_scale=True)
    _check(args, rtol=2e-3 if dtype == FP8 else 1e-4, interpret=False, backend="pallas")


@pytest.mark.gpu
@pytest.mark.parametrize("heads, max_blocks, pages_per_cta, stages",
                         [(64, 64, 4, 1), (64, 70, 16, 4), (20, 9, 8, 6), (128, 33, None, 3)])
def test_mosaic_kernel_on_gpu(heads, max_blocks, pages_per_cta, stages):
    """The Mosaic kernel: a ragged block-table width, fewer heads than a wgmma N, lengths 0 ... full, NaN keys
    and scales behind every token past a row's length (never read, or masked)."""
    full = max_blocks * 64
    lens = [0, 1, 63, 64, 65, 1000 % full, full - 1, full, 3 * 64 + 5]
    q, weights, cache, tables, lens_ = _case(6, rows=len(lens), heads=heads, dim=128, page_size=64,
                                             max_blocks=max_blocks, lens=lens, dtype=FP8)
    valid = np.arange(64)[None, :] + 64 * np.arange(max_blocks)[:, None]  # [blocks, 64] token positions
    nan_keys, nan_scales = np.array(cache.keys.astype(jnp.float32)), np.array(cache.scales)
    for r, n in enumerate(lens):
        for b, page in enumerate(np.asarray(tables)[r]):
            if page >= 0:
                nan_keys[page][valid[b] >= n] = np.nan
                nan_scales[page][valid[b] >= n] = np.nan
    args = (q, weights, Fp8IndexKeys(jnp.asarray(nan_keys, FP8), jnp.asarray(nan_scales)), tables, lens_)
    _check(args, rtol=2e-3, interpret=False, backend="mosaic", pages_per_cta=pages_per_cta, stages=stages)


def _chunk_case(seed, *, heads, max_blocks, chunk_lens, decode_lens):
    """fp8 inputs of a mixed step: prefill chunks (each a run of consecutive rows of one sequence, causal lengths
    over one block table) then decode rows (each its own sequence), with NaN keys and scales behind each page's
    last token that any row reading it may score (never read, or masked)."""
    lens = [n for chunk in chunk_lens for n in chunk] + list(decode_lens)
    q, weights, cache, _, lens_ = _case(seed, rows=len(lens), heads=heads, dim=128, page_size=64,
                                        max_blocks=max_blocks, lens=lens, dtype=FP8)
    rng = np.random.default_rng(seed + 1)
    sequences = [max(chunk) for chunk in chunk_lens] + list(decode_lens)
    pages = rng.permutation(cache.keys.shape[0])
    tables, scored = [], np.zeros(cache.keys.shape[:2], bool)
    for s, n in enumerate(sequences):
        table = np.full(max_blocks, -1, np.int32)
        used = -(-n // 64)
        table[:used] = pages[s * max_blocks:s * max_blocks + used]
        scored[table[:used]] = True
        if used:
            scored[table[used - 1], n - 64 * (used - 1):] = False
        tables.append(table)
    rows_of = [s for s, chunk in enumerate(chunk_lens) for _ in chunk] + [len(chunk_lens) + d
                                                                          for d in range(len(decode_lens))]
    keys, scales = np.array(cache.keys.astype(jnp.float32)), np.array(cache.scales)
    keys[~scored], scales[~scored] = np.nan, np.nan
    cache = Fp8IndexKeys(jnp.asarray(keys, FP8), jnp.asarray(scales))
    return q, weights, cache, jnp.asarray(np.stack(tables)[rows_of]), lens_


@pytest.mark.gpu
@pytest.mark.parametrize("rows_per_cta, pages_per_cta, stages", [(1, None, 4), (2, None, 4), (3, 16, 3), (4, None, 4),
                                                                  (4, 16, 3), (4, 8, 1)])
def test_mosaic_rows_of_a_chunk_share_pages_on_gpu(rows_per_cta, pages_per_cta, stages):
    """rows_per_cta rows a CTA: chunks whose rows end mid-group and groups mixing a chunk's last rows with decode
    rows (row by row), causal lengths from 0 to a full table, rows not a multiple of the group, stages refilled
    within a row or not dividing its pages: equal to the reference and, within f32 rounding, to one row a CTA; the group
    maxima too."""
    chunk_lens = [[0, 1, 2, 63, 64, 65], list(range(4000, 4007)), [4096 - 2, 4096 - 1, 4096]]
    args = _chunk_case(7, heads=64, max_blocks=64, chunk_lens=chunk_lens, decode_lens=[5, 4096, 300])
    knobs = dict(pages_per_cta=pages_per_cta, stages=stages)
    _check(args, rtol=2e-3, interpret=False, backend="mosaic", rows_per_cta=rows_per_cta, **knobs)
    q, weights, cache, tables, lens = args
    (one_row, _), (logits, maxima) = (indexer_mosaic.indexer_logits_and_group_maxima(
        q, weights, cache.keys, tables, lens, k_scale=cache.scales, rows_per_cta=g, **knobs) for g in (1, rows_per_cta))
    # A later row's head sum reads its columns at an offset of the shared accumulator, and Mosaic may add them in
    # another order (measured on the H100: up to 1.9e-5 apart, on the second row of a pair only).
    np.testing.assert_allclose(np.asarray(logits), np.asarray(one_row), rtol=1e-5, atol=1e-4)
    group_max = jnp.asarray(logits).reshape(logits.shape[0], -1, indexer_mosaic.GROUP_TOKENS).max(axis=-1)
    np.testing.assert_array_equal(np.asarray(maxima), np.asarray(_topk_triton._to_key(group_max)))


@pytest.mark.gpu
def test_indexer_logits_compiled_short_rows_fp8():
    """Rows of at most 16 tokens shrink the chunk below wgmma's 64-row tile: the fp8 dot must still compile."""
    args = _case(5, rows=4, heads=64, dim=128, page_size=8, max_blocks=2, lens=[0, 1, 9, 16], dtype=FP8)
    _check(args, rtol=2e-3, interpret=False)
