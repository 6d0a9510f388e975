"""The sharded sparse DCP decode step equals the single-device unsharded computation.

Schedules mix batch sizes (pad rows in every bucket), contexts below and above index_topk, contexts that
are not multiples of dcp, and early steps where most ranks own none of a row's tokens.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dcp_jax.config import TINY, EngineConfig, ParallelConfig
from dcp_jax.demo import Schedule, run_comparison
from dcp_jax.stack import decode_stack_unsharded, empty_history, init_stack_params

ENGINE = EngineConfig(page_size=4, num_pages=48, max_num_seqs=4, max_model_len=40)
# 3 active rows (one pad row) at steps 2-4 and after step 12; contexts reach 27 > index_topk = 16.
SCHEDULE = Schedule(start=(0, 0, 2, 5), stop=(27, 12, 27, 27))
TOL = 2e-5


@pytest.mark.parametrize("dcp", [1, 2, 4, 8])
@pytest.mark.parametrize("interleave", [1, 2])
def test_dcp_step_equals_unsharded(dcp, interleave):
    report = run_comparison(TINY, ParallelConfig(tp=dcp, dcp=dcp, interleave=interleave), ENGINE, SCHEDULE)
    assert report.max_context > TINY.index_topk
    assert report.buckets_compiled == len(ENGINE.buckets)
    assert report.max_abs_err < TOL


@pytest.mark.parametrize("dcp, interleave", [(2, 2), (4, 1)])
def test_dcp_step_with_pallas_kernels_equals_unsharded(dcp, interleave):
    """The Pallas indexer, top-k and sparse MLA kernels (interpreted on CPU) wired into the DCP step."""
    parallel = ParallelConfig(tp=dcp, dcp=dcp, interleave=interleave)
    report = run_comparison(TINY, parallel, ENGINE, SCHEDULE, kernels="pallas")
    assert report.max_abs_err < TOL
    tied = run_comparison(TINY, parallel, ENGINE, SCHEDULE, kernels="pallas", params=tied_index_params(3))
    assert tied.max_abs_err < TOL


@pytest.mark.parametrize("tp, dcp", [(4, 2), (8, 4), (8, 1)])
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
    expected = np.arange(TINY.index_topk)
    for layer in range(TINY.num_hidden_layers):
        np.testing.assert_array_equal(np.sort(np.asarray(selected[layer, 0])), expected)


@pytest.mark.parametrize("dcp, interleave", [(2, 1), (4, 2), (8, 1)])
def test_exact_ties_at_the_topk_boundary(dcp, interleave):
    report = run_comparison(
        TINY, ParallelConfig(tp=dcp, dcp=dcp, interleave=interleave), ENGINE, SCHEDULE, params=tied_index_params(3)
    )
    assert report.max_abs_err < TOL
