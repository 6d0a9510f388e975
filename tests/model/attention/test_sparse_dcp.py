"""The sharded sparse DCP attention step (dcp_jax/model/attention/sparse_dcp.py) equals the single-device unsharded
computation.

Schedules mix batch sizes (pad rows in every bucket), contexts below and above index_topk, contexts that
are not multiples of dcp, and early steps where most ranks own none of a row's tokens.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dcp_jax.config import TINY, EngineConfig, ParallelConfig
from dcp_jax.demo import Schedule, make_stack_step, run_comparison
from dcp_jax.host.step_metadata import build_step_metadata
from dcp_jax.demo import decode_stack_unsharded, empty_history, init_stack_params
from dcp_jax.model.kv_cache import allocate_kv_cache
from dcp_jax.model.mesh import make_mesh
from pallas_kernels import Fp8LatentCache

ENGINE = EngineConfig(page_size=4, num_pages=48, max_num_seqs=4, max_model_len=40, max_num_batched_tokens=4)
# 3 active rows (one pad row) at steps 2-4 and after step 12; contexts reach 27 > index_topk = 16.
SCHEDULE = Schedule(start=(0, 0, 2, 5), stop=(27, 12, 27, 27))
TOL = 2e-5
# Between the step and its twin with an fp8 latent cache: see test_dcp_step_with_fp8_latent_cache_equals_unsharded_fp8.
FP8_FLIP_TOL = 2e-3


@pytest.mark.parametrize("dcp, interleave", [(1, 1), (2, 1), pytest.param(4, 1, marks=pytest.mark.slow),
                                             pytest.param(8, 1, marks=pytest.mark.slow), (2, 2), (8, 2),
                                             pytest.param(1, 2, marks=pytest.mark.slow),
                                             pytest.param(4, 2, marks=pytest.mark.slow)])
def test_dcp_step_equals_unsharded(dcp, interleave):
    report = run_comparison(TINY, ParallelConfig(tp=dcp, dcp=dcp, interleave=interleave), ENGINE, SCHEDULE)
    assert report.max_context > TINY.indexer.topk
    assert report.buckets_compiled == len(ENGINE.buckets)
    assert report.max_abs_err < TOL


# Slow at every size: the oracle tests run the whole model under the Pallas kernels against HF every suite.
@pytest.mark.slow
@pytest.mark.parametrize("dcp, interleave", [(2, 2), (4, 1)])
def test_dcp_step_with_pallas_kernels_equals_unsharded(dcp, interleave):
    """The Pallas indexer, top-k and sparse MLA kernels (interpreted on CPU) wired into the DCP step."""
    parallel = ParallelConfig(tp=dcp, dcp=dcp, interleave=interleave)
    report = run_comparison(TINY, parallel, ENGINE, SCHEDULE, kernels="pallas")
    assert report.max_abs_err < TOL
    tied = run_comparison(TINY, parallel, ENGINE, SCHEDULE, kernels="pallas", params=tied_index_params(3))
    assert tied.max_abs_err < TOL


# The fp8 kernels meet their references every suite in tests/kernels (interpreted): their model-level runs are slow.
@pytest.mark.parametrize("dcp, interleave, kernels",
                         [pytest.param(2, 2, "pallas", marks=pytest.mark.slow), (4, 1, "reference"),
                          pytest.param(8, 2, "reference", marks=pytest.mark.slow)])
def test_dcp_step_with_fp8_index_cache_equals_unsharded_fp8(dcp, interleave, kernels):
    """fp8 index cache on both sides: the DCP step (fp8 keys and scales written per rank, fp8 queries scored by
    the indexer) equals the single-device computation on the same quantized keys and queries."""
    engine = dataclasses.replace(ENGINE, index_cache="fp8")
    report = run_comparison(TINY, ParallelConfig(tp=dcp, dcp=dcp, interleave=interleave), engine, SCHEDULE,
                            kernels=kernels)
    assert report.max_context > TINY.indexer.topk
    assert report.max_abs_err < TOL


@pytest.mark.parametrize("dcp, interleave, kernels",
                         [pytest.param(2, 2, "pallas", marks=pytest.mark.slow), (4, 1, "reference"),
                          pytest.param(8, 2, "reference", marks=pytest.mark.slow)])
def test_dcp_step_with_fp8_latent_cache_equals_unsharded_fp8(dcp, interleave, kernels):
    """fp8 latent cache (and fp8 index cache) on both sides: the DCP step writes each rank's e4m3 latents, tile
    scales and bf16 rope, and attends over them; the single-device twin attends over the same quantized
    latents. The Pallas kernel rounds the queries and probabilities to bf16 and returns bf16: one layer, so
    that this rounding cannot flip the next layer's top-k, and a bf16 tolerance. With the references: the step
    and its twin are different XLA programs, whose f32 latents may differ in the last bit (they do on some CPUs, not
    on others); e4m3 keeps 3 mantissa bits, so such a bit can move a latent across a rounding boundary, one e4m3
    step (6%) of one element. FP8_FLIP_TOL holds a few of those (3.3e-4 measured); a wrong owner, slot or merge
    errs by O(10) here (a merge without its rescale: 11 at dcp=4, 21 at dcp=8)."""
    cfg, tol = (dataclasses.replace(TINY, num_hidden_layers=1), 2e-2) if kernels == "pallas" else (TINY, FP8_FLIP_TOL)
    engine = dataclasses.replace(ENGINE, index_cache="fp8", latent_cache="fp8")
    report = run_comparison(cfg, ParallelConfig(tp=dcp, dcp=dcp, interleave=interleave), engine, SCHEDULE,
                            kernels=kernels)
    assert report.max_context > cfg.indexer.topk
    assert report.max_abs_err < tol


def test_fp8_latent_cache_changes_the_output_only_by_its_quantization():
    """The unsharded twin on exact and on fp8 latents: the outputs differ (the latents are quantized), by about
    what e4m3's 3 mantissa bits allow, not more."""
    params = init_stack_params(TINY, jax.random.key(0))
    histories = {fmt: empty_history(TINY, 2, 24, latent_cache=fmt) for fmt in ("exact", "fp8")}
    rng = np.random.default_rng(0)
    for length in range(1, 21):
        hidden = jnp.asarray(rng.standard_normal((2, TINY.hidden_size)), jnp.float32)
        outs = {}
        for fmt, history in histories.items():
            outs[fmt], histories[fmt], _ = decode_stack_unsharded(
                params, history, hidden, jnp.full((2,), length - 1), jnp.full((2,), length), cfg=TINY)
        change = np.linalg.norm(outs["fp8"] - outs["exact"]) / np.linalg.norm(outs["exact"] - hidden)
        assert 0 < change < 0.1, (length, change)
    assert isinstance(histories["fp8"].latents, Fp8LatentCache)


def test_fp8_latent_cache_refuses_a_latent_it_cannot_tile():
    mesh = make_mesh(ParallelConfig(tp=1, dcp=1))
    with pytest.raises(ValueError, match="kv_lora_rank a multiple of 128"):
        allocate_kv_cache(dataclasses.replace(TINY, kv_lora_rank=64), dataclasses.replace(ENGINE, latent_cache="fp8"),
                          1, mesh)
    with pytest.raises(ValueError, match="latent_cache='bf16' must be one of"):
        dataclasses.replace(ENGINE, latent_cache="bf16")


@pytest.mark.parametrize("tp, dcp", [(4, 2), pytest.param(8, 4, marks=pytest.mark.slow), (8, 1)])
def test_tp_larger_than_dcp(tp, dcp):
    report = run_comparison(TINY, ParallelConfig(tp=tp, dcp=dcp, interleave=2), ENGINE, SCHEDULE)
    assert report.max_abs_err < TOL


def tied_index_params(seed):
    """Index keys identical for every token (no key projection, zero bias on the roped part), so all
    index scores tie and the top-k boundary is decided by position alone."""
    params = init_stack_params(TINY, jax.random.key(seed))
    e = TINY.qk_rope_head_dim

    def tie(layer):
        att = layer.attention
        att = dataclasses.replace(
            att, index_wk=jnp.zeros_like(att.index_wk), index_k_norm_bias=att.index_k_norm_bias.at[:e].set(0.0)
        )
        return dataclasses.replace(layer, attention=att)

    return [tie(layer) for layer in params]


def test_unsharded_selection_with_exact_ties_is_lowest_positions():
    params = tied_index_params(3)
    history = empty_history(TINY, 1, 32)
    rng = np.random.default_rng(0)
    for length in range(1, 25):
        hidden = jnp.asarray(rng.standard_normal((1, TINY.hidden_size)), jnp.float32)
        _, history, selected = decode_stack_unsharded(
            params, history, hidden, jnp.array([length - 1]), jnp.array([length]), cfg=TINY
        )
    expected = np.arange(TINY.indexer.topk)
    for layer in range(TINY.num_hidden_layers):
        np.testing.assert_array_equal(np.sort(np.asarray(selected[layer, 0])), expected)


@pytest.mark.parametrize("dcp, interleave", [(2, 1), (4, 2), (8, 1)])
def test_exact_ties_at_the_topk_boundary(dcp, interleave):
    report = run_comparison(
        TINY, ParallelConfig(tp=dcp, dcp=dcp, interleave=interleave), ENGINE, SCHEDULE, params=tied_index_params(3)
    )
    assert report.max_abs_err < TOL


def test_a_rank_owning_none_of_the_top_k_with_context_above_k():
    """All index scores tie, so the top-k is positions 0..K-1; with interleave = K = 16 they all live on rank 0,
    and rank 1 owns none of them once contexts exceed K (its sparse MLA part is empty: out 0, lse -inf)."""
    engine = EngineConfig(page_size=16, num_pages=16, max_num_seqs=4, max_model_len=40, max_num_batched_tokens=4)
    parallel = ParallelConfig(tp=2, dcp=2, interleave=TINY.indexer.topk)
    report = run_comparison(TINY, parallel, engine, SCHEDULE, params=tied_index_params(3))
    assert report.max_context > TINY.indexer.topk
    assert report.max_abs_err < TOL


@pytest.mark.parametrize("latent_cache", ["exact", "fp8"])
def test_pad_rows_output_zero_and_write_no_kv(latent_cache):
    parallel = ParallelConfig(tp=2, dcp=2, interleave=2)
    mesh = make_mesh(parallel)
    engine = dataclasses.replace(ENGINE, latent_cache=latent_cache)
    step = make_stack_step(TINY, parallel, engine, mesh, "reference")
    params = step.place_params(init_stack_params(TINY, jax.random.key(0)))
    empty = allocate_kv_cache(TINY, engine, parallel.dcp, mesh)
    rng = np.random.default_rng(0)
    before = jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(a.dtype), empty)  # no zeros to hide in
    kv_cache = jax.tree.map(lambda a, like: jax.device_put(a, like.sharding), before, empty)
    step.compile(params, kv_cache, 4)
    lens, tables = [5, 9], [[3], [7, 1]]
    md = build_step_metadata(lens, [1, 1], tables, rows=4, seqs=4, layout=step.layout, max_blocks=step.max_blocks)
    hidden = np.zeros((4, TINY.hidden_size), np.float32)
    hidden[:2] = rng.standard_normal((2, TINY.hidden_size))
    out, kv_cache = step(params, kv_cache, hidden, md)
    assert np.all(np.asarray(out)[2:] == 0)
    written = {(int(w), int(md.slot_mapping[w, r])) for r in range(2) for w in range(2) if md.slot_mapping[w, r] >= 0}
    assert len(written) == 2
    for new_pool, old_pool in zip(jax.tree.leaves(kv_cache), jax.tree.leaves(before)):  # every array
        new_pool, old_pool = np.asarray(new_pool), np.asarray(old_pool)
        changed = np.any(new_pool != old_pool, axis=tuple(range(4, new_pool.ndim)))  # [W, L, pages, B]
        for layer in range(TINY.num_hidden_layers):  # each layer writes the same slots of its own pages
            ranks, pages, offsets = np.nonzero(changed[:, layer])
            assert {(int(w), int(p * engine.page_size + o)) for w, p, o in zip(ranks, pages, offsets)} == written
