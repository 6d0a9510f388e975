"""pallas_kernels.topk (the Triton kernel) against reference.topk (interpreted on CPU, compiled on GPU).

Columns at or past a row's length hold NaN, +-inf and huge values, so any read of them shows up; the interpreter
fills unwritten outputs with NaN, so exact equality with the reference proves every slot was written.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import pallas_kernels
from pallas_kernels import _topk_triton as topk
from pallas_kernels import reference

KNOBS = ("sorted", "interpret", "num_groups", "tile", "capacity", "coarse_bits", "splits", "candidate_splits",
         "sort_in_kernel", "num_warps", "floor_warps", "candidate_warps", "select_warps", "num_stages",
         "maxima_unroll", "separate_floor")
_topk = jax.jit(functools.partial(pallas_kernels.topk, backend="triton"), static_argnames=("k", *KNOBS))
_reference = jax.jit(reference.topk, static_argnames=("k", "sorted"))

# Small buffers: all-equal rows overflow the 64-slot candidate buffer and take the exact whole-row path.
SMALL = dict(num_groups=64, tile=64, capacity=64, coarse_bits=8)


def _scores(seed, rows, cols, lens, fill):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    if fill == "ties":  # few distinct values: long runs of exact ties, also at the k-th place
        x = np.round(x * 2) / 2
    elif fill == "negative":
        x = -np.abs(x) - 1.0
    elif fill == "signed_zeros":  # -0.0 ranks below 0.0 (the f32 total order, as lax.top_k on CPU)
        x = np.where(rng.random((rows, cols)) < 0.8, np.copysign(0.0, x), x).astype(np.float32)
    elif fill == "equal":
        x[:] = 0.25
    garbage = np.array([np.nan, np.inf, -np.inf, 3e38, -np.nan], np.float32)
    for r, length in enumerate(lens):
        x[r, length:] = rng.choice(garbage, size=max(cols - length, 0))
    return jnp.asarray(x), jnp.asarray(np.asarray(lens, np.int32))


def _check(scores, lens, k, interpret=True, **knobs):
    values, indices = _topk(scores, lens, k=k, interpret=interpret, **knobs)
    # The reference runs on the CPU: the GPU's lax.top_k put a higher column first among ties at some shapes.
    cpu = jax.devices("cpu")[0]
    want_values, want_indices = _reference(jax.device_put(scores, cpu), jax.device_put(lens, cpu), k=k,
                                           sorted=knobs.get("sorted", True))
    assert values.shape == indices.shape == (scores.shape[0], k)
    assert values.dtype == jnp.float32 and indices.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(indices), np.asarray(want_indices))
    # Bitwise: the sign of zero must survive too.
    np.testing.assert_array_equal(np.asarray(values).view(np.int32), np.asarray(want_values).view(np.int32))


FILLS = ["normal", "ties", "negative", "signed_zeros", "equal"]


@pytest.mark.parametrize("fill", FILLS)
def test_default_knobs(fill):
    # Lengths 0, < k, == k, full, and not multiples of any tile.
    scores, lens = _scores(0, 6, 300, [0, 3, 7, 300, 129, 255], fill)
    _check(scores, lens, 7)


@pytest.mark.parametrize(("splits", "candidate_splits", "maxima_unroll", "separate_floor"),
                         [(1, 1, 4, True), (2, 2, 1, False), (8, 8, 4, True), (1, 8, 2, False), (8, 2, 1, True)])
@pytest.mark.parametrize("fill", FILLS)
def test_small_buffers(fill, splits, candidate_splits, maxima_unroll, separate_floor):
    # With 8 chunks of 64 columns, rows of length 63, 64 and 200 leave chunks with no valid column; lengths that
    # end inside a 4-column run load it whole.
    scores, lens = _scores(1, 6, 512, [0, 63, 64, 512, 201, 511], fill)
    _check(scores, lens, 64, splits=splits, candidate_splits=candidate_splits, maxima_unroll=maxima_unroll,
           separate_floor=separate_floor, **SMALL)


@pytest.mark.parametrize("fill", ["normal", "ties", "equal"])
def test_column_order(fill):
    """sorted=False: the same top-k entries, in column order, pads last (both candidate and whole-row paths)."""
    scores, lens = _scores(10, 5, 512, [512, 16, 0, 333, 70], fill)
    _check(scores, lens, 64, sorted=False, splits=4, candidate_splits=2, **SMALL)


@pytest.mark.parametrize("splits", [2, 8])
@pytest.mark.parametrize("capacity", [64, 128])
def test_candidates_in_one_chunk(splits, capacity):
    """Ascending rows put every candidate in the last chunks: 128 slots hold them (gathered from the regions in
    column order), 64 overflow and take the whole-row path."""
    scores = jnp.asarray(np.tile(np.linspace(-3, 3, 512, dtype=np.float32), (3, 1)))
    lens = jnp.array([512, 500, 90], jnp.int32)
    _check(scores, lens, 64, splits=splits, candidate_splits=splits, **(SMALL | dict(capacity=capacity,
                                                                                      coarse_bits=4)))


@pytest.mark.parametrize("ties", [24, topk.BUCKET_SLOTS - 1, topk.BUCKET_SLOTS, topk.BUCKET_SLOTS + 1, 300])
def test_threshold_bucket(ties):
    """The select's last search steps run over at most BUCKET_SLOTS candidates: `ties` copies of the k-th value
    (40 larger values before it) fill that bucket up to, at, and past the limit, where the search runs over all
    candidates to the last bit. A row of values 1 ulp apart shares its floor's top bits, so every column is a
    candidate: they overflow `capacity` and the whole row is searched."""
    rng = np.random.default_rng(11)
    rows = []
    for _ in range(2):
        row = np.concatenate([rng.uniform(2, 3, 40), np.ones(ties), rng.uniform(-2, 0.5, 1024 - 40 - ties)])
        rows.append(rng.permutation(row).astype(np.float32))
    rows.append(np.float32(1) + np.arange(1024, dtype=np.float32) * np.finfo(np.float32).eps)
    scores, lens = jnp.asarray(np.stack(rows)), jnp.array([1024, 1000, 1024], jnp.int32)
    for sorted_ in (True, False):
        _check(scores, lens, 64, sorted=sorted_, num_groups=256, tile=256, capacity=512)


@pytest.mark.parametrize("fill", ["normal", "ties"])
def test_xla_sort(fill):
    scores, lens = _scores(2, 5, 512, [512, 16, 0, 333, 17], fill)
    _check(scores, lens, 16, sort_in_kernel=False, tile=128)


@settings(max_examples=12, deadline=None)
@given(rows=st.integers(1, 4), cols=st.integers(1, 300), k=st.integers(1, 70), splits=st.sampled_from([1, 2, 4, 8]),
       candidate_splits=st.sampled_from([1, 2, 4, 8]), maxima_unroll=st.sampled_from([1, 2, 4]),
       separate_floor=st.booleans(), sorted=st.booleans(), fill=st.sampled_from(FILLS),
       seed=st.integers(0, 2**16), data=st.data())
def test_random_shapes_and_chunkings(rows, cols, k, splits, candidate_splits, maxima_unroll, separate_floor, sorted,
                                     fill, seed, data):
    """Any rows x columns (odd ones load element-wise, not whole runs), k below or above the row lengths, 1-8
    chunks of 32 columns in either streaming pass, 64-slot regions (ties overflow them into the whole-row path);
    lengths anywhere in [0, cols]."""
    lens = data.draw(st.lists(st.integers(0, cols), min_size=rows, max_size=rows))
    scores, lens = _scores(seed, rows, cols, lens, fill)
    _check(scores, lens, k, splits=splits, candidate_splits=candidate_splits, maxima_unroll=maxima_unroll,
           separate_floor=separate_floor, sorted=sorted, num_groups=32, tile=32, capacity=64, coarse_bits=8)


def test_k_one():
    scores, lens = _scores(3, 4, 200, [200, 1, 0, 77], "ties")
    _check(scores, lens, 1)


def test_k_above_columns_pads():
    scores, lens = _scores(4, 3, 20, [20, 3, 0], "normal")
    _check(scores, lens, 37)


def test_lens_clipped_to_columns():
    scores, _ = _scores(5, 2, 40, [40, 40], "normal")
    lens = jnp.array([1000, -5], jnp.int32)
    values, indices = _topk(scores, lens, k=7, interpret=True)
    want_values, want_indices = _reference(scores, jnp.clip(lens, 0, 40), k=7)
    np.testing.assert_array_equal(np.asarray(indices), np.asarray(want_indices))
    np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))


@pytest.mark.parametrize("k", [7, 37])
def test_reference_clips_lens_like_the_kernel(k):
    """lens > N (and < 0) given to both unclipped: k > N pads with (-inf, -1) in both, never a pad column id."""
    scores, _ = _scores(8, 5, 20, [20] * 5, "normal")
    _check(scores, jnp.array([1000, 25, -3, 20, 5], jnp.int32), k)


def test_sort_rows():
    values = jnp.array([[1.0, -0.0, 0.0, -np.inf, 1.0, 2.0]], jnp.float32)
    indices = jnp.array([[5, 3, 4, -1, 2, 0]], jnp.int32)
    got_values, got_indices = topk.sort_rows(values, indices)
    np.testing.assert_array_equal(np.asarray(got_indices), [[0, 2, 5, 4, 3, -1]])
    np.testing.assert_array_equal(np.asarray(got_values).view(np.int32),
                                  np.array([[2.0, 1.0, 1.0, 0.0, -0.0, -np.inf]], np.float32).view(np.int32))


def _group_maxima(scores, lens, group):
    """Keys of the largest valid score of each run of `group` columns (-inf's key where a run has none)."""
    rows, cols = scores.shape
    valid = np.arange(cols)[None, :] < np.asarray(lens)[:, None]
    x = np.where(valid, np.asarray(scores), -np.inf).reshape(rows, cols // group, group).max(axis=2)
    return topk._to_key(jnp.asarray(x, jnp.float32))


@pytest.mark.parametrize("fill", FILLS)
@pytest.mark.parametrize("lowered", [False, True], ids=["maxima", "lower-bounds"])
def test_given_group_maxima(fill, lowered):
    """Maxima of contiguous groups from the caller (as the Mosaic indexer emits them) skip the maxima pass; lower
    values (here all -inf) still give the exact result, through more candidates or the whole-row path."""
    scores, lens = _scores(2, 6, 1024, [0, 63, 64, 1024, 201, 1000], fill)
    maxima = _group_maxima(scores, lens, 16)  # 64 groups
    if lowered:
        maxima = jnp.full_like(maxima, topk._to_key(jnp.float32(-jnp.inf)))
    for sorted_ in (True, False):
        _check(scores, lens, 64, group_maxima=maxima, sorted=sorted_, **{**SMALL, "num_groups": 8})


def test_group_maxima_validation():
    scores, lens = jnp.zeros((2, 256)), jnp.zeros(2, jnp.int32)
    for bad in (jnp.zeros((2, 16), jnp.int32), jnp.zeros((2, 48), jnp.int32), jnp.zeros((2, 64)),
                jnp.zeros((3, 64), jnp.int32)):
        with pytest.raises(ValueError, match="group_maxima"):
            pallas_kernels.topk(scores, lens, k=20, backend="triton", group_maxima=bad)


@pytest.mark.parametrize(
    ("scores", "lens", "k", "knobs", "match"),
    [
        (jnp.zeros((2, 8, 1)), jnp.zeros(2, jnp.int32), 1, {}, "scores"),
        (jnp.zeros((2, 8), jnp.bfloat16), jnp.zeros(2, jnp.int32), 1, {}, "scores"),
        (jnp.zeros((2, 0)), jnp.zeros(2, jnp.int32), 1, {}, "columns"),
        (jnp.zeros((2, 8)), jnp.zeros(3, jnp.int32), 1, {}, "lens"),
        (jnp.zeros((2, 8)), jnp.zeros(2, jnp.float32), 1, {}, "lens"),
        (jnp.zeros((2, 8)), jnp.zeros(2, jnp.int32), 0, {}, "k"),
        (jnp.zeros((2, 8)), jnp.zeros(2, jnp.int32), 2.0, {}, "k"),
        (jnp.zeros((2, 8)), jnp.zeros(2, jnp.int32), True, {}, "k"),
        (jnp.zeros((2, 8)), jnp.zeros(2, jnp.int32), 1, {"tile": 96}, "tile"),
        (jnp.zeros((2, 8)), jnp.zeros(2, jnp.int32), 1, {"capacity": 0}, "capacity"),
        (jnp.zeros((2, 8)), jnp.zeros(2, jnp.int32), 1, {"coarse_bits": 33}, "coarse_bits"),
        (jnp.zeros((2, 8)), jnp.zeros(2, jnp.int32), 1, {"splits": 3}, "splits"),
        (jnp.zeros((2, 8)), jnp.zeros(2, jnp.int32), 1, {"candidate_splits": 0}, "candidate_splits"),
        (jnp.zeros((2, 8)), jnp.zeros(2, jnp.int32), 1, {"num_warps": 6}, "num_warps"),
        (jnp.zeros((2, 8)), jnp.zeros(2, jnp.int32), 1, {"floor_warps": 3}, "floor_warps"),
        (jnp.zeros((2, 8)), jnp.zeros(2, jnp.int32), 1, {"candidate_warps": True}, "candidate_warps"),
        (jnp.zeros((2, 8)), jnp.zeros(2, jnp.int32), 1, {"select_warps": 12}, "select_warps"),
        (jnp.zeros((2, 8)), jnp.zeros(2, jnp.int32), 1, {"maxima_unroll": 0}, "maxima_unroll"),
    ],
)
def test_input_validation(scores, lens, k, knobs, match):
    with pytest.raises(ValueError, match=match):
        pallas_kernels.topk(scores, lens, k=k, backend="triton", **knobs)


@pytest.mark.gpu
@pytest.mark.parametrize(("rows", "cols", "fill"), [(8, 65536, "normal"), (4, 4096, "ties"), (3, 16384, "equal"),
                                                  (2, 8192, "negative")])
def test_compiled_real_shapes(rows, cols, fill):
    lens = np.random.default_rng(6).integers(cols - 1000, cols + 1, rows)
    lens[0] = 1000  # shorter than k
    scores, lens = _scores(7, rows, cols, lens, fill)
    check = functools.partial(_check, scores, lens, 2048)
    check(interpret=False)
    check(interpret=False, splits=1, candidate_splits=8, separate_floor=True, floor_warps=4, candidate_warps=4)
    check(interpret=False, splits=4, candidate_splits=2, maxima_unroll=1)
    check(interpret=False, sort_in_kernel=False)
    check(interpret=False, sorted=False, select_warps=8)
