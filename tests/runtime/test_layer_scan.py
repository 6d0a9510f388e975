"""The decoder layers run as one `jax.lax.scan` per layer stack (`runtime/forward.py`): the same outputs as the
unrolled loop, and a program whose size does not depend on the depth."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from jax.extend import core as jax_core

from dcp_jax.config import TINY, EngineConfig, ParallelConfig
from dcp_jax.host.step_metadata import StepMetadata
from dcp_jax.model.deepseek_v32 import init_params, layer_params, layer_stacks, stack_of
from dcp_jax.model.kv_cache import on_layer
from dcp_jax.model.mesh import make_mesh
from dcp_jax.runtime.forward import GREEDY
from dcp_jax.runtime import oracle
from dcp_jax.runtime.runner import ModelRunner, state_allocator, step_context, step_program

ENGINE = EngineConfig(page_size=4, num_pages=16, max_num_seqs=2, max_model_len=32, bucket_ladder=(2, 16),
                      max_num_batched_tokens=16)
PROMPTS = [[5, 9, 17, 3, 88, 41, 7, 250, 13, 2, 64], [300, 12, 6, 77, 19, 1, 45]]


def _deep(layers: int):
    return dataclasses.replace(TINY, num_hidden_layers=layers)


def test_layer_stacks_split_dense_and_moe_layers():
    cfg = _deep(5)
    assert [(s.name, s.first, s.count) for s in layer_stacks(cfg)] == [("dense_layers", 0, 1), ("moe_layers", 1, 4)]
    assert stack_of(cfg, 3).name == "moe_layers" and stack_of(cfg, 0).name == "dense_layers"
    dense_only = dataclasses.replace(cfg, n_routed_experts=0)
    assert [(s.name, s.count) for s in layer_stacks(dense_only)] == [("dense_layers", 5)]
    params = init_params(cfg, seed=0)
    assert params["moe_layers"]["attention"]["wqkv_a"].shape[0] == 4
    np.testing.assert_array_equal(layer_params(cfg, params, 3)["attention"]["wqkv_a"],
                                  params["moe_layers"]["attention"]["wqkv_a"][2])


def test_on_layer_moves_page_ids_and_slots_to_the_layers_pages_and_keeps_minus_one():
    md = StepMetadata(positions=np.array([4, 0]), context_lens=np.array([5, 0]),
                      local_context_lens=np.array([[5, 0]]), slot_mapping=np.array([[6, -1]]),
                      block_tables=np.array([[1, 0], [-1, -1]]), query_seqs=np.array([0, 1]),
                      draft_positions=np.zeros((2, 0)), draft_context_lens=np.zeros((2, 0)),
                      draft_local_context_lens=np.zeros((1, 2, 0)), draft_slot_mapping=np.zeros((1, 2, 0)),
                      draft_query_seqs=np.zeros(2))
    moved = on_layer(jax.tree.map(jax.numpy.asarray, md), 2, num_pages=3, page_size=4)
    np.testing.assert_array_equal(moved.block_tables, [[7, 6], [-1, -1]])
    np.testing.assert_array_equal(moved.slot_mapping, [[6 + 2 * 3 * 4, -1]])
    np.testing.assert_array_equal(moved.local_context_lens, md.local_context_lens)
    np.testing.assert_array_equal(moved.positions, md.positions)


# Slow: tests/model/test_index_share.py compares scanned and unrolled layers (a plain stack and a repeating
# block) every suite.
@pytest.mark.slow
@pytest.mark.parametrize("tp, dcp", [(2, 2)])
def test_scanned_layers_give_the_unrolled_loops_prefill_and_decode(tp, dcp):
    cfg = _deep(4)  # one dense layer, a stack of three MoE layers
    parallel = ParallelConfig(tp=tp, dcp=dcp)
    mesh = make_mesh(parallel)
    params = init_params(cfg, seed=3)
    blocks = ENGINE.max_blocks_per_seq(dcp)
    tables = [list(range(blocks)), list(range(blocks, 2 * blocks))]
    outputs = []
    for unroll in (False, True):
        runner = ModelRunner(cfg, params, parallel, ENGINE, mesh, "reference", unroll_layers=unroll)
        logits, selected, first = oracle.prefill(runner, PROMPTS, tables, all_logits=True, return_selected=True)
        decoded = oracle.decode(runner, first, [len(p) + 1 for p in PROMPTS], tables, return_selected=True)
        outputs.append((logits, selected, first, *decoded))
    for scanned, unrolled in zip(*outputs):
        if scanned is None:
            continue
        scanned, unrolled = np.asarray(scanned), np.asarray(unrolled)
        if scanned.dtype.kind == "f":
            np.testing.assert_allclose(scanned, unrolled, atol=1e-5, rtol=0)
        else:
            np.testing.assert_array_equal(scanned, unrolled)


def _program_size(layers: int, unroll: bool) -> tuple[int, int]:
    """(equations of the step's traced program, counted inside every sub-jaxpr; lines of its lowered StableHLO)
    for the greedy decode bucket of a `layers`-deep tiny model."""
    cfg = _deep(layers)
    parallel = ParallelConfig(tp=1, dcp=1)
    mesh = make_mesh(parallel)
    ctx = step_context(cfg, parallel, ENGINE, "reference", dtype=jax.numpy.float32, unroll_layers=unroll)
    step = step_program(ctx, GREEDY, parallel, ENGINE, mesh)
    params = step.param_shapes(nnx.to_pure_dict(ctx.model.abstract))
    state = jax.eval_shape(state_allocator(cfg, parallel, ENGINE, mesh, "float32"))

    def equations(jaxpr) -> int:
        return len(jaxpr.eqns) + sum(equations(sub) for sub in jax_core.subjaxprs(jaxpr))

    traced = equations(step.jaxpr(params, state, 2).jaxpr)
    return traced, step.lower(params, state, 2).as_text().count("\n")


def test_the_programs_size_does_not_grow_with_depth():
    """Scanned, 3 and 7 layers trace and lower to programs of one size (each stack's layer once); unrolled (the
    scan's `unroll`, so the traced program is the same) the deeper one lowers to a larger program."""
    assert _program_size(3, unroll=False) == _program_size(7, unroll=False)
    shallow, deep = _program_size(3, unroll=True), _program_size(7, unroll=True)
    assert deep[1] > shallow[1]


def test_the_cli_and_llm_take_unroll_layers(capsys):
    from dcp_jax.cli import main

    assert main(["generate", "--model", "tiny", "--unroll-layers", "--prompt", "hi", "--max-tokens", "2",
                 "--max-model-len", "32"]) == 0
    assert "tiny" in capsys.readouterr().out
