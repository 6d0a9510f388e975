"""GLM-5.2's IndexShare in the house: layers of another structure grouped into repeating scan blocks, shared layers
that run no indexer and no candidate exchange (the program shows it), index-key pools with an entry for the full
layers only (the memory plan counts it), and the tiny GLM model's scanned layers equal to its unrolled ones."""

import dataclasses

import numpy as np
import pytest
from jax.extend import core as jax_core

from dcp_jax.config import GLM52, ParallelConfig, EngineConfig, TINY_GLM, preset
from dcp_jax.model.attention.variant import CacheFormats
from dcp_jax.model.deepseek_v32 import _periodic_runs, init_params, scan_groups
from dcp_jax.model.kv_cache import allocate_kv_cache, entry_table, pool_layers
from dcp_jax.model.memory_plan import kv_bytes_per_token
from dcp_jax.model.mesh import make_mesh
from dcp_jax.runtime import oracle
from dcp_jax.runtime.runner import ModelRunner
from dcp_jax.serving.engine_args import EngineArgs
from dcp_jax.serving.loading import load_model

ENGINE = EngineConfig(page_size=4, num_pages=32, max_num_seqs=2, max_model_len=64, bucket_ladder=(2,),
                      max_num_batched_tokens=32)


def test_periodic_runs_take_the_fewest_layer_bodies():
    assert _periodic_runs(list("FFFF")) == [(1, 4)]
    assert _periodic_runs(list("SSSF" * 18 + "SSS")) in ([(4, 18), (1, 3)], [(1, 3), (4, 18)])
    assert _periodic_runs(list("FSFSF")) in ([(1, 1), (2, 2)], [(2, 2), (1, 1)])
    assert sum(p * n for p, n in _periodic_runs(list("FSSFSFFS"))) == 8


def test_glm52_scans_six_stacks_in_three_groups():
    groups = scan_groups(GLM52)
    layers = [layer for group in groups for layer in sorted(
        layer for stack in group for layer in stack.layers)]
    assert layers == list(range(78))  # every layer once, in order
    assert [len(group) for group in groups] == [1, 1, 4]
    assert [(s.name, s.first, s.count, s.stride) for s in groups[2]] == [
        ("moe_layers_1", 6, 18, 4), ("moe_layers_2", 7, 18, 4), ("moe_layers_3", 8, 18, 4),
        ("moe_layers_4", 9, 18, 4)]
    for group in groups:  # a stack holds one structure
        for stack in group:
            assert len({GLM52.shares_index_selection(layer) for layer in stack.layers}) == 1


def test_index_pool_entries_are_the_full_layers_and_the_memory_plan_counts_them():
    full = [layer for layer in range(78) if not GLM52.shares_index_selection(layer)]
    assert len(full) == 21 and full[:4] == [0, 1, 2, 6]
    assert pool_layers(GLM52, "index_k", 79) == full + [78]  # the MTP layer runs its own indexer
    assert pool_layers(GLM52, "latent", 79) == list(range(79))
    table = entry_table(GLM52, "index_k", 78)
    assert table[6] == 3 and table[3] == -1
    formats = CacheFormats("fp8", "fp8")
    shared = kv_bytes_per_token(GLM52, formats, itemsize=2)
    every = kv_bytes_per_token(preset("glm-5"), formats, itemsize=2)
    assert shared["latent"] == every["latent"] == 78 * 656
    assert shared["index_k"] == 21 * 132 and every["index_k"] == 78 * 132


def test_the_tiny_glm_pools_and_weights_follow_the_layer_kinds():
    parallel = ParallelConfig(tp=2, dcp=2)
    cache = allocate_kv_cache(TINY_GLM, dataclasses.replace(ENGINE, num_speculative_tokens=1), 2, make_mesh(parallel))
    assert cache.entries("latent") == 6 and cache.entries("index_k") == 4  # layers 0, 2, 4 and the MTP layer
    params = init_params(TINY_GLM, seed=0)
    assert "index_wq" in params["dense_layers"]["attention"] and "index_wq" in params["moe_layers_1"]["attention"]
    assert "index_wq" not in params["moe_layers"]["attention"]  # layers 1 and 3


def _name_stacks(jaxpr, out: list[str]) -> list[str]:
    """Every equation's name stack, inside every sub-jaxpr too."""
    out.extend(str(eqn.source_info.name_stack) for eqn in jaxpr.eqns)
    for sub in jax_core.subjaxprs(jaxpr):
        _name_stacks(sub, out)
    return out


def test_shared_layers_run_no_indexer_and_no_exchange_in_the_program():
    """The greedy program of tiny-glm: the full layers' stacks (dense_layers: layer 0; moe_layers_1: 2 and 4) score
    with the indexer and exchange candidates; the shared layers' (moe_layers: 1 and 3) only take their share of
    the selection carried from the full layer before them."""
    runner = load_model(EngineArgs(model="tiny-glm", dcp=2, max_num_seqs=2, max_model_len=64,
                                   max_num_batched_tokens=4, kernels="reference")).runner
    step = next(iter(runner.steps.values()))
    stacks = _name_stacks(step.jaxpr(runner.params, runner.state, step.buckets[0]).jaxpr, [])

    def scopes(stack_name):
        return {scope for names in stacks if f"/{stack_name}/" in f"/{names}/" for scope in names.split("/")}

    for full in ("dense_layers", "moe_layers_1"):
        assert {"indexer_topk", "exchange"} <= scopes(full), full
    assert "owner_filter" in scopes("moe_layers")
    assert not {"indexer_topk", "exchange"} & scopes("moe_layers")


@pytest.mark.parametrize("micro_batches", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_scanned_index_share_layers_equal_unrolled_ones(micro_batches):
    """tiny-glm at DCP 2: the scan of its repeating block gives the unrolled layers' logits and selections, and
    each shared layer's selection is the full layer's before it; with two micro-batches (TBO) too."""
    parallel = ParallelConfig(tp=2, dcp=2, interleave=2)
    mesh = make_mesh(parallel)
    params = init_params(TINY_GLM, seed=5)
    blocks = ENGINE.max_blocks_per_seq(2)
    tables = [list(range(blocks)), list(range(blocks, 2 * blocks))]
    prompts = [list(range(3, 30)), list(range(40, 61))]
    outputs = []
    for unroll in (False, True):
        runner = ModelRunner(TINY_GLM, params, parallel, ENGINE, mesh, "reference", unroll_layers=unroll,
                             enable_tbo=micro_batches == 2)
        logits, selected, first = oracle.prefill(runner, prompts, tables, all_logits=True, return_selected=True)
        outputs.append((logits, selected, first))
    (logits, selected, first), (logits_u, selected_u, first_u) = outputs
    np.testing.assert_allclose(np.asarray(logits), np.asarray(logits_u), atol=1e-5, rtol=0)
    np.testing.assert_array_equal(selected, selected_u)
    np.testing.assert_array_equal(first, first_u)
    np.testing.assert_array_equal(selected[1], selected[0])
    np.testing.assert_array_equal(selected[3], selected[2])
    assert not np.array_equal(selected[2], selected[0])
