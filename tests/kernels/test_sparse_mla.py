"""pallas_kernels.sparse_mla_decode (the Triton and Mosaic kernels) against reference.sparse_mla_decode
(interpreted on CPU, compiled on GPU).

The Mosaic GPU backend has no interpreter: on CPU it is lowered for CUDA (which checks shapes, layouts and shared
memory); its numbers are checked by the `gpu` tests.

Cache rows that no valid slot names hold NaN and slots past a row's count name those rows, -1 or ids far outside
the cache, so any use of a slot past the count turns the output NaN (or faults on the GPU). The interpreter fills
unwritten outputs with NaN, so a finite result proves every element was written.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import _sparse_mla_mosaic as sparse_mla_mosaic
from pallas_kernels import _sparse_mla_mosaic_gather as sparse_mla_gather
from pallas_kernels import _sparse_mla_triton, formats, reference
from pallas_kernels._lse import merge_splits


def _decode(*args, backend="triton", **kwargs):
    return pallas_kernels.sparse_mla_decode(*args, backend=backend, **kwargs)


FP8 = jnp.float8_e4m3fn

# name -> (rows, heads, value_dim, rope_dim, slots, pages, page_size): tiny for the interpreter, real for the GPU.
SHAPES = {
    "tiny": (3, 16, 64, 16, 40, 8, 16),
    "tiny_h64": (2, 64, 64, 16, 40, 8, 16),
    "tiny_h128": (2, 128, 64, 16, 40, 8, 16),
    "tiny_h8_padded": (2, 8, 64, 16, 40, 8, 16),
    "tiny_h48_padded": (2, 48, 64, 16, 40, 8, 16),
    "deepseek_tiny_s": (2, 16, 512, 64, 24, 4, 16),
    "tiny_d128": (3, 16, 128, 16, 40, 8, 16),  # the smallest latent an fp8 latent cache takes (one scale tile)
    "deepseek": (4, 128, 512, 64, 2048, 512, 64),
    "dsa_tiny": (4, 8, 128, 16, 64, 300, 16),  # the shipped dsa-tiny's attention (index_topk 64, page 16)
}
# Relative Frobenius error of out; absolute and relative error of lse. bf16 rounds the softmax weights before the
# value dot. An f32 lse near 20 is a sum of exp2 terms and a log2, a few f32 ulps (1.9e-6 each) from the reference:
# 1.5e-5 measured at deepseek_tiny_s on some CPUs, hence the relative term.
TOLERANCE = {jnp.float32: (1e-5, 1e-5, 2e-6), jnp.bfloat16: (1e-2, 1e-3, 0.0)}


def _beyond_bounds(counts, num_slots):
    """Counts as a caller may pass them: full rows' above S and empty rows' below 0 (the contract reads them as S
    and 0)."""
    return jnp.where(counts >= num_slots, num_slots + 77, jnp.where(counts <= 0, -7, counts))


def _make_inputs(seed, shape, counts, dtype):
    rows, heads, value_dim, rope_dim, num_slots, pages, page_size = shape
    rng = np.random.default_rng(seed)
    width = value_dim + rope_dim
    counts = np.asarray(counts, np.int32)
    assert counts.shape == (rows,)
    slots = np.full((rows, num_slots), -1, np.int32)
    for r, count in enumerate(counts):
        slots[r, :count] = rng.permutation(pages * page_size)[:count]
    is_named = np.zeros(pages * page_size, bool)
    is_named[slots[slots >= 0]] = True
    # Past the count: ids of NaN rows, -1, and ids far outside the cache.
    garbage = np.concatenate([np.flatnonzero(~is_named), [-1, 2**30, -(2**30)]])
    for r, count in enumerate(counts):
        slots[r, count:] = rng.choice(garbage, size=num_slots - count)
    cache = rng.standard_normal((pages * page_size, width)).astype(np.float32)
    cache[~is_named] = np.nan
    q = rng.standard_normal((rows, heads, width)).astype(np.float32)
    return (jnp.asarray(q, dtype), jnp.asarray(cache.reshape(pages, page_size, width), dtype),
            jnp.asarray(slots), jnp.asarray(counts))


def _reference(q, kv_cache, slots, counts, sm_scale, value_dim):
    # The reference gathers clamped slots for every column; give it a NaN-free cache (masked columns drop out).
    clean = jnp.nan_to_num(kv_cache.astype(jnp.float32), nan=0.0)
    return reference.sparse_mla_decode(q.astype(jnp.float32), clean, slots, counts, sm_scale, value_dim=value_dim)


def _check(out, lse, ref_out, ref_lse, counts, dtype):
    out_tol, lse_tol, lse_rtol = TOLERANCE[dtype]
    assert out.dtype == dtype and lse.dtype == jnp.float32  # out in the cache's dtype
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    out = out.astype(jnp.float32)
    assert not np.isnan(np.asarray(out)).any() and not np.isnan(np.asarray(lse)).any()
    is_empty = np.asarray(counts) <= 0
    np.testing.assert_array_equal(np.asarray(out)[is_empty], 0.0)
    np.testing.assert_array_equal(np.asarray(lse)[is_empty], -np.inf)
    full = ~is_empty
    if full.any():
        err = np.linalg.norm(np.asarray(out - ref_out)[full]) / np.linalg.norm(np.asarray(ref_out)[full])
        assert err < out_tol, f"{err=}"
        np.testing.assert_allclose(np.asarray(lse)[full], np.asarray(ref_lse)[full], rtol=lse_rtol, atol=lse_tol)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    ("shape_name", "counts", "num_splits"),
    [
        ("tiny", [0, 1, 40], 1),           # empty, single slot, full row
        ("tiny", [17, 33, 5], 3),          # not multiples of the block; splits left empty
        ("tiny", [40, 0, 23], None),       # default split count
        ("tiny_h64", [31, 40], 2),
        ("tiny_h128", [40, 9], None),
        ("deepseek_tiny_s", [24, 0], 2),
        ("tiny_h8_padded", [40, 3], 2),    # H < 16: zero-padded query heads, outputs dropped
        ("tiny_h48_padded", [0, 29], None),  # H = 48: blocks of 16 heads
    ],
)
def test_matches_reference(shape_name, counts, num_splits, dtype):
    shape = SHAPES[shape_name]
    value_dim = shape[2]
    q, kv_cache, slots, counts = _make_inputs(sum(counts), shape, counts, dtype)
    sm_scale = 0.3
    out, lse = _decode(q, kv_cache, slots, counts, sm_scale, value_dim=value_dim,
                                            block_s=16, num_splits=num_splits)
    ref_out, ref_lse = _reference(q, kv_cache, slots, counts, sm_scale, value_dim)
    _check(out, lse, ref_out, ref_lse, counts, dtype)


def _fp8_inputs(seed, shape, counts):
    """bf16 queries and the f32 cache quantized to an Fp8LatentCache (the NaN rows stay NaN in every part)."""
    q, kv_cache, slots, counts = _make_inputs(seed, shape, counts, jnp.float32)
    return q.astype(jnp.bfloat16), formats.quantize_latent_cache(kv_cache, value_dim=shape[2]), slots, counts


def _fp8_reference(q, cache, slots, counts, sm_scale, value_dim):
    return _reference(q, formats.dequantize_latent_cache(cache), slots, counts, sm_scale, value_dim)


def _inputs_and_reference(seed, shape, counts, sm_scale, fp8):
    """(q, cache, slots, counts), (out, lse) of the reference: a bf16 cache, or an fp8 latent cache."""
    if fp8:
        inputs = _fp8_inputs(seed, shape, counts)
        return inputs, _fp8_reference(*inputs, sm_scale, shape[2])
    inputs = _make_inputs(seed, shape, counts, jnp.bfloat16)
    return inputs, _reference(*inputs, sm_scale, shape[2])


@pytest.mark.parametrize(
    ("shape_name", "counts", "num_splits"),
    [
        ("tiny_d128", [0, 1, 40], 1),
        ("tiny_d128", [17, 33, 5], 3),
        ("tiny_d128", [40, 0, 23], None),
        ("deepseek_tiny_s", [24, 0], 2),   # four scale tiles
        ("deepseek_tiny_s", [7, 24], 1),
    ],
)
def test_fp8_latent_cache_matches_reference(shape_name, counts, num_splits):
    shape = SHAPES[shape_name]
    q, cache, slots, counts = _fp8_inputs(sum(counts), shape, counts)
    out, lse = _decode(q, cache, slots, counts, 0.3, value_dim=shape[2], block_s=16,
                                            num_splits=num_splits)
    ref_out, ref_lse = _fp8_reference(q, cache, slots, counts, 0.3, shape[2])
    _check(out, lse, ref_out, ref_lse, counts, jnp.bfloat16)  # out in bf16


def test_fp8_latent_cache_rejects_bad_parts():
    q, cache, slots, counts = _fp8_inputs(0, SHAPES["tiny_d128"], [1, 2, 3])
    run = lambda cache, **knobs: _decode(q, cache, slots, counts, 0.1, value_dim=128,
                                                               **knobs)
    with pytest.raises(ValueError, match="e4m3 latent, f32 scales, bf16 rope"):
        run(dataclasses.replace(cache, scales=cache.scales.astype(jnp.bfloat16)))
    with pytest.raises(ValueError, match="one scale per 128"):
        run(dataclasses.replace(cache, scales=cache.scales[..., :0]))
    with pytest.raises(ValueError, match="needs latent"):
        run(dataclasses.replace(cache, rope=cache.rope[:2]))
    with pytest.raises(ValueError, match="backend='mosaic' cannot run.*it needs 512 \\+ 64 columns"):
        run(cache, backend="mosaic")


def _emulated_dequantize(byte, scale):
    """The bit steps of `_sparse_mla_mosaic_gather.dequantized` in numpy, on e4m3 bytes (uint16) and f32 scales: the
    byte moved into bf16's bits, then two bf16 products (exact here, so f32 products give the same values)."""
    bits = ((byte & 0x80) << 8) | ((byte & 0x7F) << 4)
    as_f32 = lambda b: (b.astype(np.uint32) << 16).view(np.float32)
    return as_f32(bits) * as_f32(np.uint16(sparse_mla_gather.BF16_2_POW_120)) * scale


def test_mosaic_fp8_dequantization_bits_give_every_e4m3_value_times_its_scale():
    """Every e4m3 byte but NaN (zeros, subnormals, 448), times ue8m0 scales from 2 ** -100 to 2 ** 100."""
    byte = np.arange(256, dtype=np.uint16)
    byte = byte[(byte & 0x7F) != 0x7F]
    values = byte.astype(np.uint8).view(FP8).astype(np.float32)
    assert (values[np.abs(values) > 0].min(initial=1) < 2.0 ** -6) and np.abs(values).max() == 448
    for exponent in (-100, -7, 0, 7, 100):
        np.testing.assert_array_equal(_emulated_dequantize(byte, np.float32(2.0 ** exponent)),
                                      values * np.float32(2.0 ** exponent))


def test_mosaic_takes_an_fp8_latent_cache_of_deepseek_widths():
    """The Mosaic kernel takes DeepSeek's fp8 latent cache at decode and for a 2048-token prefill chunk, not other
    widths; on CPU it also names the GPU."""
    S = jax.ShapeDtypeStruct
    fp8_cache = formats.Fp8LatentCache(S((64, 64, 512), FP8), S((64, 64, 4), jnp.float32),
                                       S((64, 64, 64), jnp.bfloat16))
    q = S((64, 128, sparse_mla_mosaic.WIDTH), jnp.bfloat16)
    cpu = sparse_mla_mosaic.unsupported(q, fp8_cache, 512, interpret=None)
    assert cpu == sparse_mla_mosaic.unsupported(q, S((1, 1, 576), jnp.bfloat16), 512, None)
    chunk = (S((2048, 128, sparse_mla_mosaic.WIDTH), jnp.bfloat16), fp8_cache, S((2048, 2048), jnp.int32),
             S((2048,), jnp.int32), 0.1352)
    assert cpu == pallas_kernels.unsupported("sparse_mla_decode", "mosaic", *chunk)
    narrow = formats.Fp8LatentCache(S((64, 64, 128), FP8), S((64, 64, 1), jnp.float32), S((64, 64, 16), jnp.bfloat16))
    assert "512 + 64 columns" in " ".join(sparse_mla_mosaic.unsupported(q, narrow, 128, None))
    narrow_rope = dataclasses.replace(fp8_cache, rope=S((64, 64, 32), jnp.bfloat16))
    assert "an fp8 latent cache of 512 + 64 columns, got 512 + 32" in " ".join(
        sparse_mla_mosaic.unsupported(q, narrow_rope, 512, None))


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_mosaic_decode_lowers_for_cuda(fp8):
    """The whole call lowers for CUDA: the kernel (on fp8, its cp.async staging and in-place dequantization by two
    producers) and the Pallas merge of its default 8 splits at 8 rows. Inputs of the kernel's shapes go to it
    with no XLA op before it (the counts are read in the kernel as they are)."""
    S = jax.ShapeDtypeStruct
    cache = (formats.Fp8LatentCache(S((512, 64, 512), FP8), S((512, 64, 4), jnp.float32),
                                    S((512, 64, 64), jnp.bfloat16)) if fp8
             else S((512, 64, sparse_mla_mosaic.WIDTH), jnp.bfloat16))
    args = (S((8, 128, sparse_mla_mosaic.WIDTH), jnp.bfloat16), cache, S((8, 2048), jnp.int32), S((8,), jnp.int32))
    lowered = jax.jit(lambda *a: sparse_mla_mosaic.sparse_mla_decode(*a, 0.1352)).trace(*args).lower(
        lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "merge_splits" in text
    assert not {"stablehlo.pad", "stablehlo.clamp", "stablehlo.minimum"} & set(text.split())
    # One split (B = 64): the kernel and free reshapes (an fp8 cache's bytes viewed as uint8) alone.
    args = (S((64, 128, sparse_mla_mosaic.WIDTH), jnp.bfloat16), cache, S((64, 2048), jnp.int32),
            S((64,), jnp.int32))
    text = jax.jit(lambda *a: sparse_mla_mosaic.sparse_mla_decode(*a, 0.1352)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    ops = {"stablehlo.custom_call", "stablehlo.reshape"} | ({"stablehlo.bitcast_convert"} if fp8 else set())
    assert set(re.findall(r"stablehlo\.\w+", text)) == ops


@pytest.mark.parametrize("registers, producers, ok", [
    ((232, 40), 1, True), ((200, 56), 2, True), ((184, 72), 2, True), ((192, 64), 2, True),
    ((232, 48), 1, False),  # 512 > 3 * 168: the increase would wait forever
    ((196, 64), 2, False),  # not a multiple of 8
    ((248, 16), 2, False),  # under 24
])
def test_mosaic_registers_must_sum_to_the_launch(registers, producers, ok):
    if ok:
        sparse_mla_mosaic.check_registers(registers, producers)
    else:
        with pytest.raises(ValueError, match="registers"):
            sparse_mla_mosaic.check_registers(registers, producers)


def test_mosaic_registers_knob_lowers_for_cuda():
    """A registers knob reaches the kernel: (192, 64) on an fp8 cache lowers; (200, 64) is refused before tracing
    the kernel."""
    S = jax.ShapeDtypeStruct
    cache = formats.Fp8LatentCache(S((512, 64, 512), FP8), S((512, 64, 4), jnp.float32), S((512, 64, 64), jnp.bfloat16))
    args = (S((8, 128, sparse_mla_mosaic.WIDTH), jnp.bfloat16), cache, S((8, 2048), jnp.int32), S((8,), jnp.int32))

    def lower(registers):
        return jax.jit(lambda *a: sparse_mla_mosaic.sparse_mla_decode(
            *a, 0.1352, registers=registers)).trace(*args).lower(lowering_platforms=("cuda",))

    assert "merge_splits" in lower((192, 64)).as_text()
    with pytest.raises(ValueError, match=r"2 \* compute \+ 2 \* producer = 512"):
        lower((200, 64))


def test_counts_past_slots_act_as_slots():
    shape = SHAPES["tiny"]
    q, kv_cache, slots, counts = _make_inputs(1, shape, [40, 40, 3], jnp.float32)
    out, lse = _decode(q, kv_cache, slots, jnp.array([99, 40, -5], jnp.int32), 0.3,
                                            value_dim=64, block_s=16)
    ref_out, ref_lse = _reference(q, kv_cache, slots, jnp.array([40, 40, 0], jnp.int32), 0.3, 64)
    _check(out, lse, ref_out, ref_lse, jnp.array([40, 40, 0]), jnp.float32)


def test_merge_splits_matches_whole_row():
    # Attend over two disjoint parts of each row, then merge; part 1 of row 1 and both parts of row 2 are empty.
    shape = SHAPES["tiny"]
    q, kv_cache, slots, _ = _make_inputs(2, shape, [40, 40, 40], jnp.float32)
    first = jnp.array([25, 30, 0], jnp.int32)
    second = jnp.array([15, 0, 0], jnp.int32)
    # Part 2 reads the slots after part 1's, shifted to the front (compacted).
    shifted = jax.vmap(lambda row, n: jnp.roll(row, -n))(slots, first)
    out_a, lse_a = _reference(q, kv_cache, slots, first, 0.3, 64)
    out_b, lse_b = _reference(q, kv_cache, shifted, second, 0.3, 64)
    out, lse = merge_splits(jnp.stack([out_a, out_b], axis=1), jnp.stack([lse_a, lse_b], axis=1))
    ref_out, ref_lse = _reference(q, kv_cache, slots, first + second, 0.3, 64)
    _check(out, lse, ref_out, ref_lse, first + second, jnp.float32)


def test_default_num_splits_fills_the_gpu():
    assert _sparse_mla_triton.default_num_splits(64, 2, 2048, 64) == 1
    assert _sparse_mla_triton.default_num_splits(8, 2, 2048, 64) == 8
    assert _sparse_mla_triton.default_num_splits(1, 2, 2048, 64) == 16
    # Never more splits than full blocks.
    assert _sparse_mla_triton.default_num_splits(1, 1, 100, 64) == 2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(q=jnp.zeros((2, 16, 80))[0]), "want q"),
        (dict(kv_cache=jnp.zeros((4, 16, 96))), "mismatched"),
        (dict(counts=jnp.zeros((3,), jnp.int32)), "mismatched"),
        (dict(kv_cache=jnp.zeros((4, 16, 80), jnp.float16)), "bf16 or f32"),
        (dict(slots=jnp.zeros((2, 8), jnp.float32)), "int32"),
        (dict(value_dim=48), "powers of two"),
        (dict(block_h=24), "block_h"),
        (dict(block_h=8), "block_h"),
        (dict(block_s=24), "block_s"),
        (dict(num_splits=0), "num_splits"),
    ],
)
def test_rejects_bad_inputs(change, message):
    args = dict(q=jnp.zeros((2, 16, 80)), kv_cache=jnp.zeros((4, 16, 80)), slots=jnp.zeros((2, 8), jnp.int32),
                counts=jnp.zeros((2,), jnp.int32), value_dim=64)
    args.update(change)
    with pytest.raises(ValueError, match=message):
        _decode(args.pop("q"), args.pop("kv_cache"), args.pop("slots"), args.pop("counts"),
                                     0.1, **args)


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "backend"), [(jnp.float32, "triton"), (jnp.bfloat16, "triton"),
                                                (jnp.bfloat16, "mosaic")], ids=["f32", "bf16-triton", "bf16-mosaic"])
@pytest.mark.parametrize("num_splits", [1, 4, None])
def test_real_shape_on_gpu(dtype, backend, num_splits):
    shape = SHAPES["deepseek"]
    q, kv_cache, slots, counts = _make_inputs(3, shape, [2048, 0, 1, 700], dtype)
    out, lse = jax.jit(lambda *a: _decode(*a, 0.1352, num_splits=num_splits,
                                                               backend=backend))(q, kv_cache, slots, counts)
    ref_out, ref_lse = _reference(q, kv_cache, slots, counts, 0.1352, 512)
    _check(out, lse, ref_out, ref_lse, counts, dtype)


def test_rejects_bad_backend():
    q, kv_cache, slots, counts = _make_inputs(0, SHAPES["tiny"], [1, 2, 3], jnp.bfloat16)
    with pytest.raises(ValueError, match="backend must be"):
        _decode(q, kv_cache, slots, counts, 0.1, value_dim=64, backend="cuda")
    # The Mosaic kernel wants 512 + 64 columns on an sm_90 GPU, compiled.
    with pytest.raises(ValueError, match="backend='mosaic' cannot run.*512 \\+ 64 columns"):
        _decode(q, kv_cache, slots, counts, 0.1, value_dim=64, backend="mosaic")


@pytest.mark.parametrize(("rows", "heads", "num_slots", "num_splits"),
                         [(2, 128, 2048, 1), (1, 64, 1024, 4), (3, 64, 64, 16)])
def test_mosaic_kernel_lowers_for_cuda(rows, heads, num_slots, num_splits):
    args = (jax.ShapeDtypeStruct((rows, heads, sparse_mla_mosaic.WIDTH), jnp.bfloat16),
            (jax.ShapeDtypeStruct((1 << 16, sparse_mla_mosaic.WIDTH), jnp.bfloat16),),
            jax.ShapeDtypeStruct((rows, num_slots), jnp.int32),
            jax.ShapeDtypeStruct((rows,), jnp.int32))
    sparse_mla_mosaic.sparse_mla_partials.trace(*args, sm_scale=0.1, num_splits=num_splits).lower(
        lowering_platforms=("cuda",))


def test_mosaic_prepare_pads_to_the_kernel():
    q, kv_cache, slots, counts = _make_inputs(0, SHAPES["deepseek_tiny_s"], [24, 0], jnp.float32)
    q_p, (rows_p,), slots_p, counts_p = sparse_mla_mosaic.prepare(q, kv_cache, slots, jnp.array([99, -3], jnp.int32))
    assert q_p.shape == (2, 64, 576) and q_p.dtype == jnp.bfloat16 and not q_p[:, 16:].any()
    assert rows_p.shape == (4 * 16, 576)
    fp8_parts = sparse_mla_mosaic.prepare(q, formats.quantize_latent_cache(kv_cache), slots, counts)[1]
    assert [(p.shape, p.dtype) for p in fp8_parts] == [((64, 512), jnp.uint8), ((64, 4), jnp.float32),
                                                       ((64, 64), jnp.bfloat16)]
    assert slots_p.shape == (2, 64) and (slots_p[:, :24] == slots).all()
    np.testing.assert_array_equal(counts_p, [24, -3])  # clipped to S, as slots are padded; the kernel clips at 0
    # Inputs of the kernel's shapes pass as they are.
    q, kv_cache, slots, counts = _make_inputs(0, SHAPES["deepseek"], [2048, 0, 1, 700], jnp.bfloat16)
    q_p, _, slots_p, counts_p = sparse_mla_mosaic.prepare(q, kv_cache, slots, counts)
    assert q_p is q and slots_p is slots and counts_p is counts


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 64, 128])
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_mosaic_matches_reference_on_gpu(heads, num_splits):
    # S = 1000 is not a multiple of the 64-slot block; counts 0, 1, S, and ragged ones around block edges.
    shape = (6, heads, 512, 64, 1000, 512, 64)
    counts = [0, 1, 1000, 63, 65, 640]
    q, kv_cache, slots, counts = _make_inputs(heads + (num_splits or 0), shape, counts, jnp.bfloat16)
    out, lse = jax.jit(lambda *a: _decode(*a, 0.1352, num_splits=num_splits, backend="mosaic"))(
        q, kv_cache, slots, _beyond_bounds(counts, 1000))
    ref_out, ref_lse = _reference(q, kv_cache, slots, counts, 0.1352, 512)
    _check(out, lse, ref_out, ref_lse, counts, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 4, None])
def test_fp8_latent_cache_on_gpu(num_splits):
    shape = SHAPES["deepseek"]
    q, cache, slots, counts = _fp8_inputs(4, shape, [2048, 0, 1, 700])
    out, lse = jax.jit(lambda *a: _decode(*a, 0.1352, num_splits=num_splits))(q, cache, slots, counts)
    ref_out, ref_lse = _fp8_reference(q, cache, slots, counts, 0.1352, 512)
    _check(out, lse, ref_out, ref_lse, counts, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 4, None])
def test_mosaic_fp8_latent_cache_on_gpu(num_splits):
    """The Mosaic kernel on DeepSeek's fp8 latent cache (dequantized in the kernel)."""
    q, cache, slots, counts = _fp8_inputs(4, SHAPES["deepseek"], [2048, 0, 1, 700])
    out, lse = jax.jit(lambda *a: _decode(*a, 0.1352, num_splits=num_splits, backend="mosaic"))(q, cache, slots,
                                                                                                 counts)
    ref_out, ref_lse = _fp8_reference(q, cache, slots, counts, 0.1352, 512)
    _check(out, lse, ref_out, ref_lse, counts, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_mosaic_block_edge_counts_on_gpu(fp8, num_splits):
    """Counts of 0, 1, one block, two blocks, two blocks and a slot, and full: the producers' edges; and one full
    row alone (None: 16 splits, merged by the Pallas kernel). The empty and full rows' counts are passed below 0
    and above S."""
    for counts in ([0, 1, 64, 128, 129, 2048], [2048]):
        (q, cache, slots, counts), (ref_out, ref_lse) = _inputs_and_reference(
            11, (len(counts), 128, 512, 64, 2048, 512, 64), counts, 0.1352, fp8)
        out, lse = jax.jit(lambda *a: _decode(*a, 0.1352, num_splits=num_splits, backend="mosaic"))(
            q, cache, slots, _beyond_bounds(counts, 2048))
        _check(out, lse, ref_out, ref_lse, counts, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_mosaic_more_splits_than_blocks_on_gpu(fp8):
    """S = 128 (two blocks) over 4 splits: two splits have no blocks; counts around the block edge."""
    (q, cache, slots, counts), (ref_out, ref_lse) = _inputs_and_reference(13, (5, 128, 512, 64, 128, 64, 64),
                                                                          [0, 1, 64, 100, 128], 0.1352, fp8)
    out, lse = jax.jit(lambda *a: _decode(*a, 0.1352, num_splits=4, backend="mosaic"))(q, cache, slots, counts)
    _check(out, lse, ref_out, ref_lse, counts, jnp.bfloat16)


@pytest.mark.gpu
def test_mosaic_fp8_latent_cache_every_e4m3_byte_on_gpu():
    """Random e4m3 bytes (but NaN) under scales from 2 ** -14 to 2 ** -6: the kernel's in-place dequantization
    gives the exact dequantized cache's attention. A row of count 1 returns its token's values bit for bit, and
    eight such rows hold every non-NaN byte (zeros and subnormals among them) in each byte of a 4-byte word."""
    counts = [1] * 8 + [2048, 1000, 0, 63]
    q, cache, slots, counts = _fp8_inputs(9, (12, 128, 512, 64, 2048, 512, 64), counts)
    rng = np.random.default_rng(9)
    byte = rng.integers(0, 256, cache.latent.shape, dtype=np.uint8).reshape(-1, 512)
    single = np.asarray(slots)[:8, 0]
    byte[single] = (np.arange(512)[None, :] + 37 * np.arange(8)[:, None]) % 256
    byte[(byte & 0x7F) == 0x7F] = 0
    latent = jax.lax.bitcast_convert_type(jnp.asarray(byte.reshape(cache.latent.shape)), FP8)
    scales = jnp.asarray(2.0 ** rng.integers(-14, -5, cache.scales.shape), jnp.float32)
    cache = formats.Fp8LatentCache(latent, scales, cache.rope)
    out, lse = jax.jit(lambda *a: _decode(*a, 0.1352, backend="mosaic"))(q, cache, slots, counts)
    ref_out, ref_lse = _fp8_reference(q, cache, slots, counts, 0.1352, 512)
    _check(out, lse, ref_out, ref_lse, counts, jnp.bfloat16)
    exact = np.asarray(formats.dequantize_latent_cache(cache)).reshape(-1, 576)[single, :512]
    np.testing.assert_array_equal(np.asarray(out[:8].astype(jnp.float32)),
                                  np.broadcast_to(exact[:, None], (8, 128, 512)))


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8-latent"])
def test_dsa_tiny_shapes_on_gpu(fp8):
    """The kernel `backend="pallas"` picks at dsa-tiny's shapes (8 heads, latent 128, rope 16), compiled."""
    (q, cache, slots, counts), (ref_out, ref_lse) = _inputs_and_reference(6, SHAPES["dsa_tiny"], [64, 0, 1, 37],
                                                                          0.17, fp8)
    out, lse = jax.jit(lambda *a: _decode(*a, 0.17, value_dim=128, backend="pallas"))(q, cache, slots, counts)
    _check(out, lse, ref_out, ref_lse, counts, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, want", [(jnp.bfloat16, "mosaic"), (FP8, "mosaic"), (jnp.float32, "triton")],
                         ids=["bf16", "fp8-latent", "f32"])
def test_the_default_backend_on_gpu(dtype, want):
    """backend="pallas" (what the engine runs) picks the Mosaic kernel for a bf16 or an fp8 latent cache, the
    Triton one else."""
    if dtype == FP8:
        q, kv_cache, slots, counts = _fp8_inputs(5, SHAPES["deepseek"], [2048, 0, 1, 700])
        ref_out, ref_lse = _fp8_reference(q, kv_cache, slots, counts, 0.1352, 512)
    else:
        q, kv_cache, slots, counts = _make_inputs(5, SHAPES["deepseek"], [2048, 0, 1, 700], dtype)
        ref_out, ref_lse = _reference(q, kv_cache, slots, counts, 0.1352, 512)
    assert pallas_kernels.choose("sparse_mla_decode", "pallas", q, kv_cache, slots, counts, 0.1352) == want
    out, lse = jax.jit(lambda *a: pallas_kernels.sparse_mla_decode(*a, 0.1352))(q, kv_cache, slots, counts)
    _check(out, lse, ref_out, ref_lse, counts, jnp.bfloat16 if dtype == FP8 else dtype)
