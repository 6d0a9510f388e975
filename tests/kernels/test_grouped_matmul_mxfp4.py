"""MXFP4 weights (pallas_kernels/formats.py: Mxfp4Weight, quantize_mxfp4, dequantize_mxfp4) and their grouped matmul
(pallas_kernels/_grouped_matmul_mxfp4_triton.py) against reference.grouped_matmul_mxfp4: the format's codes and
nibble order from hand-built bytes, the OCP quantization rule, exact round trips, the kernel interpreted on CPU
(groups of no rows, rows not a multiple of the block, bf16 and f32 rows), its refusals, its Triton IR for CUDA, and
a compiled run at GLM-5.2's expert shapes on a GPU."""

import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import pallas_kernels
from pallas_kernels import _grouped_matmul_mxfp4_triton as kernel
from pallas_kernels import formats, reference
from pallas_kernels.formats import Mxfp4Weight
from tests.kernels.triton_ir import triton_modules

S = jax.ShapeDtypeStruct


def _dequantized(packed, scales):
    return np.asarray(formats.dequantize_mxfp4(packed, scales, np.float32))


def test_each_code_and_the_nibble_order_from_hand_built_bytes():
    """Byte i holds input 2i in its low nibble and 2i + 1 in its high one; bit 3 of a code is the sign; one e8m0
    scale 2^(code - 127) covers 32 inputs; scale code 255 is NaN. numpy in, numpy out; jnp gives the same."""
    e2m1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    row = np.zeros(16, np.uint8)  # 32 inputs
    row[0], row[1] = 0x72, 0x9F  # inputs 0, 1, 2, 3: codes 2, 7, 15, 9
    row[8:16] = [c | (15 - c) << 4 for c in range(0, 16, 2)]  # inputs 16..31: codes 0, 15, 2, 13, ...
    packed = np.stack([row, row, row])
    scales = np.array([[127], [128], [255]], np.uint8)  # x1, x2, NaN
    values = _dequantized(packed, scales)
    want = np.zeros(32, np.float32)
    want[:4] = [1.0, 6.0, -6.0, -0.5]
    want[16::2], want[17::2] = [e2m1[c] for c in range(0, 16, 2)], [e2m1[15 - c] for c in range(0, 16, 2)]
    np.testing.assert_array_equal(values[0], want)
    np.testing.assert_array_equal(values[1], 2 * want)
    assert np.isnan(values[2]).all()
    assert isinstance(values, np.ndarray)
    from_jnp = formats.dequantize_mxfp4(jnp.asarray(packed), jnp.asarray(scales), jnp.bfloat16)
    assert from_jnp.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(from_jnp, np.float32), values)


def test_quantize_follows_the_ocp_rule():
    """shared = floor(log2(amax)) - 2 per 32 inputs (e8m0 code shared + 127; an all-zero block takes code 0), each
    input over 2^shared clamped to +-6 and rounded to the nearest e2m1 value, ties to the even code."""
    blocks = np.zeros((4, 32), np.float32)
    blocks[0, :9] = [7.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.5]  # amax 7: shared 0
    blocks[1, :3] = [1.0, -0.5, 0.3]  # amax 1: shared -2, so 4, -2, 1.2 -> 1
    blocks[2, :2] = [3.0 * 2.0**100, 2.0**99]  # amax 3 * 2^100: shared 99
    packed, scales = formats.quantize_mxfp4(blocks)
    np.testing.assert_array_equal(scales[:, 0], [127, 125, 226, 0])
    values = _dequantized(packed, scales)
    np.testing.assert_array_equal(values[0, :9], [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -6.0])
    np.testing.assert_array_equal(values[1, :3], [1.0, -0.5, 0.25])
    np.testing.assert_array_equal(values[2, :2], [3.0 * 2.0**100, 2.0**99])
    assert not values[3].any() and not packed[3].any()
    with pytest.raises(ValueError, match="multiple of 32"):
        formats.quantize_mxfp4(np.zeros((2, 48), np.float32))


def test_values_on_the_grid_round_trip_exactly_in_numpy_and_jnp():
    """Random codes and scales: their values quantize back to the same bytes (every block holds a +-6, so its
    scale is the one they were built with; no negative zeros), in numpy and in jnp alike."""
    rng = np.random.default_rng(0)
    codes = rng.choice([c for c in range(16) if c != 8], size=(3, 8, 64)).astype(np.uint8)
    codes[..., ::32] = 7 + 8 * rng.integers(0, 2, (3, 8, 2))  # a +-6 in each block of 32
    packed = codes[..., 0::2] | codes[..., 1::2] << 4
    scales = rng.integers(100, 150, (3, 8, 2)).astype(np.uint8)
    values = _dequantized(packed, scales)
    for quantized in (formats.quantize_mxfp4(values), formats.quantize_mxfp4(jnp.asarray(values, jnp.bfloat16))):
        np.testing.assert_array_equal(np.asarray(quantized[0]), packed)
        np.testing.assert_array_equal(np.asarray(quantized[1]), scales)
    weight = Mxfp4Weight(packed, scales)
    assert weight.shape == (3, 8, 64)


def _case(seed, sizes, *, rows, depth, width, dtype):
    """x [rows, depth] in dtype; MXFP4 weights [groups, width, depth] whose blocks of 32 span 2^-4 .. 2^4 (so the
    scales differ block to block); int32 group sizes."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, depth)), dtype)
    w = rng.standard_normal((len(sizes), width, depth // 32, 32)) * 2.0 ** rng.integers(-4, 5, (1, 1, depth // 32, 1))
    weight = Mxfp4Weight(*formats.quantize_mxfp4(w.reshape(len(sizes), width, depth).astype(np.float32)))
    return x, jax.tree.map(jnp.asarray, weight), jnp.asarray(sizes, jnp.int32)


def _check(args, *, out_dtype=jnp.float32, backend="triton", **knobs):
    covered = int(np.asarray(args[2]).sum())
    out = pallas_kernels.grouped_matmul_mxfp4(*args, out_dtype=out_dtype, backend=backend, **knobs)
    ref = reference.grouped_matmul_mxfp4(*args, out_dtype=out_dtype)
    assert out.shape == ref.shape == (args[0].shape[0], args[1].shape[1]) and out.dtype == out_dtype
    out, ref = (np.asarray(a, np.float32)[:covered] for a in (out, ref))
    # bf16 rows times bf16-exact weights: exact products, so only the f32 summation order differs.
    tolerance = 1e-5 if out_dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(out, ref, rtol=tolerance, atol=tolerance * np.max(np.abs(ref), initial=1.0))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("sizes", [[7, 0, 20, 1, 0, 15], [0, 0, 0]], ids=["groups", "no-rows"])
def test_grouped_matmul_mxfp4_matches_reference(sizes, dtype):
    """Groups of 0, 1, fewer rows than a block and more than one block, 5 rows past the groups; 4 steps of
    block_k and 2 blocks of block_n."""
    args = _case(0, sizes, rows=sum(sizes) + 5, depth=128, width=32, dtype=dtype)
    _check(args, block_m=16, block_n=16, block_k=32)


def test_the_default_backend_runs_the_kernel_with_its_default_tiles():
    """"pallas" picks the Triton kernel; decode tiles below PREFILL_ROWS_PER_GROUP rows a group (given or counted),
    prefill tiles from it (f32 rows: 64-row tiles), at GLM-5.2's expert shapes; bf16 out."""
    args = _case(1, [3, 0, 9], rows=14, depth=64, width=32, dtype=jnp.bfloat16)
    assert pallas_kernels.choose("grouped_matmul_mxfp4", "pallas", *args) == "triton"
    _check(args, out_dtype=jnp.bfloat16, backend="pallas")
    glm = Mxfp4Weight(S((256, 2048, 3072), jnp.uint8), S((256, 2048, 192), jnp.uint8))  # in 6144, out 2048
    assert kernel.default_knobs(2, jnp.bfloat16, glm) == dict(block_m=16, block_n=128, block_k=64, num_warps=4,
                                                              num_stages=3, unpack="interleave")
    assert kernel.default_knobs(8, jnp.bfloat16, glm) == dict(block_m=128, block_n=256, block_k=64, num_warps=8,
                                                              num_stages=4, unpack="interleave")
    assert kernel.default_knobs(8, jnp.float32, glm)["block_m"] == 64

    def kernel_name(**knobs):
        jaxpr = jax.make_jaxpr(lambda *a: pallas_kernels.grouped_matmul_mxfp4(
            *a, out_dtype=jnp.float32, backend="triton", **knobs))(*args)
        return re.search(r"grouped_matmul_mxfp4_block_m=\d+", str(jaxpr)).group()

    assert kernel_name() == "grouped_matmul_mxfp4_block_m=16"  # 14 rows over 3 groups
    assert kernel_name(rows_per_group=64) == "grouped_matmul_mxfp4_block_m=128"


def test_grouped_matmul_mxfp4_refuses_what_it_cannot_run():
    x, w, sizes = _case(2, [2, 3], rows=5, depth=64, width=32, dtype=jnp.float32)

    def run(*args, **kw):
        return pallas_kernels.grouped_matmul_mxfp4(*args, out_dtype=jnp.float32, **kw)

    with pytest.raises(TypeError, match="Mxfp4Weight"):
        run(x, w.packed, sizes)
    with pytest.raises(ValueError, match="must be uint8"):
        run(x, Mxfp4Weight(w.packed.astype(jnp.int8), w.scales), sizes)
    with pytest.raises(ValueError, match=r"scales \[groups, out, in / 32\] = \(2, 32, 2\)"):
        run(x, Mxfp4Weight(w.packed, w.scales[..., :1]), sizes)
    with pytest.raises(ValueError, match="in = 64"):
        run(x[:, :32], w, sizes)
    with pytest.raises(ValueError, match="groups = 2"):
        run(x, w, sizes[:1])
    with pytest.raises(ValueError, match="group_sizes must be int32"):
        run(x, w, sizes.astype(jnp.uint32))
    with pytest.raises(ValueError, match="bf16 or f32"):
        run(x.astype(jnp.float16), w, sizes)
    narrow = Mxfp4Weight(w.packed[:, :24], w.scales[:, :24])  # out 24
    assert pallas_kernels.unsupported("grouped_matmul_mxfp4", "triton", x, narrow, sizes) == [
        "it needs out a multiple of 16; got w (2, 24, 64) (groups, out, in)"]
    with pytest.raises(ValueError, match="triton: it needs out a multiple of 16"):
        run(x, narrow, sizes)
    with pytest.raises(ValueError, match="block_k >= 32"):
        run(x, w, sizes, backend="triton", block_k=16)
    with pytest.raises(TypeError, match="unknown grouped matmul mxfp4 knobs"):
        run(x, w, sizes, backend="triton", block_rows=16)


@pytest.mark.parametrize("depth, width", [(6144, 2048), (2048, 6144)], ids=["gate-up", "down"])
@pytest.mark.parametrize("rows", [64 * 8, 4096], ids=["decode", "prefill"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_grouped_matmul_mxfp4_lowers_reading_packed_weights(monkeypatch, rows, dtype, depth, width):
    """The Triton IR for CUDA (an H200) at GLM-5.2's expert shapes: the weights and scales are read as bytes (i8
    pointers), the nibbles joined back into input order, then one tensor-core dot a step."""
    weight = Mxfp4Weight(S((256, width, depth // 2), jnp.uint8), S((256, width, depth // 32), jnp.uint8))
    shapes = (S((rows, depth), dtype), weight, S((256,), jnp.int32))
    [module] = triton_modules(monkeypatch, lambda *args: pallas_kernels.grouped_matmul_mxfp4(
        *args, out_dtype=jnp.bfloat16, backend="triton", interpret=False), *shapes)
    assert len(re.findall(r"tt\.load %\d+ : tensor<\d+x\d+x!tt\.ptr<i8>>", module)) == 2  # packed, scales
    assert "tt.join" in module and "arith.shrui" in module and module.count("tt.dot") == 1


def test_the_ptx_unpacking_lowers_to_two_dots_of_split_inputs(monkeypatch):
    """unpack="split_ptx" at GLM-5.2's decode shape: inline PTX turns codes and scales into the low and the high
    nibbles' bf16 values (no join), two dots a step; refused for f32 x and in interpret mode (PTX runs on a GPU)."""
    weight = Mxfp4Weight(S((256, 2048, 3072), jnp.uint8), S((256, 2048, 192), jnp.uint8))
    shapes = (S((512, 6144), jnp.bfloat16), weight, S((256,), jnp.int32))
    [module] = triton_modules(monkeypatch, lambda *args: pallas_kernels.grouped_matmul_mxfp4(
        *args, out_dtype=jnp.bfloat16, backend="triton", interpret=False, unpack="split_ptx"), *shapes)
    assert module.count("tt.elementwise_inline_asm") == 2 and "fma.rn.bf16x2" in module
    assert "tt.join" not in module and module.count("tt.dot") == 2
    x, w, sizes = _case(1, [3, 0, 5], rows=8, depth=64, width=32, dtype=jnp.float32)
    for dtype, interpret in ((jnp.float32, False), (jnp.bfloat16, True)):
        with pytest.raises(ValueError, match="inline PTX for bf16 x, compiled on a GPU"):
            pallas_kernels.grouped_matmul_mxfp4(x.astype(dtype), w, sizes, out_dtype=jnp.float32, backend="triton",
                                                interpret=interpret, unpack="split_ptx")


def _per_row_reference(x, w: Mxfp4Weight, sizes, chunk=32):
    """f32 [rows, out]: each row times its own group's dequantized weights, `chunk` rows at a time (XLA's GPU
    ragged_dot of the reference would materialize every group's masked rows)."""

    @jax.jit
    def rows_times_weights(rows, groups):
        weights = formats.dequantize_mxfp4(w.packed[groups], w.scales[groups], jnp.float32)  # [chunk, out, in]
        return jnp.einsum("ri,roi->ro", rows.astype(jnp.float32), weights, precision=jax.lax.Precision.HIGHEST)

    group_of_row = np.repeat(np.arange(len(sizes)), sizes)
    pad = -len(group_of_row) % chunk
    groups = np.concatenate([group_of_row, np.zeros(pad, group_of_row.dtype)])
    rows = jnp.pad(x, ((0, pad), (0, 0)))
    return np.concatenate([np.asarray(rows_times_weights(rows[i:i + chunk], groups[i:i + chunk]))
                           for i in range(0, len(groups), chunk)])[:len(group_of_row)]


@pytest.mark.gpu
@pytest.mark.parametrize("depth, width", [(6144, 2048), (2048, 6144)], ids=["gate-up", "down"])
@pytest.mark.parametrize("rows", [64 * 8, 256 * 8], ids=["decode-64", "decode-256"])
@pytest.mark.parametrize("unpack", ["interleave", "split_ptx"])
def test_grouped_matmul_mxfp4_compiled_glm_experts(rows, depth, width, unpack):
    """GLM-5.2-MXFP4's routed experts (256, 8 a row) at 64 and 256 rows of a decode, compiled, against each row
    times its group's dequantized weights."""
    rng = np.random.default_rng(3)
    sizes = np.bincount(rng.integers(0, 256, rows), minlength=256)
    keys = jax.random.split(jax.random.key(4), 3)
    weight = Mxfp4Weight(jax.random.randint(keys[0], (256, width, depth // 2), 0, 256, jnp.int32).astype(jnp.uint8),
                         jax.random.randint(keys[1], (256, width, depth // 32), 118, 124, jnp.int32).astype(jnp.uint8))
    x = jax.random.normal(keys[2], (rows, depth), jnp.bfloat16)
    out = np.asarray(pallas_kernels.grouped_matmul_mxfp4(x, weight, jnp.asarray(sizes, jnp.int32),
                                                         out_dtype=jnp.float32, backend="triton", interpret=False,
                                                         unpack=unpack))
    ref = _per_row_reference(x, weight, sizes)
    assert np.linalg.norm(out - ref) <= 1e-4 * np.linalg.norm(ref)
