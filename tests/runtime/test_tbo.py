"""Two-batch overlap (TBO, `enable_tbo`): each layer's attention runs as two micro-batches of the step's rows, views
of the one metadata the host built (`arrays.rows_view`). Its outputs equal the plain step's at every DCP size
and interleave, with odd row counts, a micro-batch of pad rows only and ranks owning none of a row's top-k; a
micro-batch reading the other's rows is caught; its programs hold two chains of collectives per layer, derive no
length and compile once."""

import jax
import numpy as np
import pytest

from dcp_jax.config import TINY, EngineConfig, ParallelConfig
from dcp_jax.host.step_plan import ScheduledRows
from dcp_jax.host import arrays
from dcp_jax.model.attention import mla_dcp
from dcp_jax.model.deepseek_v32 import init_params
from dcp_jax.model.mesh import make_mesh
from dcp_jax.runtime.forward import GREEDY
from dcp_jax.runtime.runner import ModelRunner
from dcp_jax.runtime import oracle

# Buckets 3 (odd), 4 and 32: decode rows run in bucket 3, split 1 + 2 (2 rows: one real, one pad; 1 row: the
# second micro-batch all pads); 3 prompts of 5, 9 and 23 tokens (past index_topk 16) prefill one at a time in
# bucket 32, split 16 + 16 (the second all pads for the first two).
ENGINE = EngineConfig(page_size=4, num_pages=48, max_num_seqs=4, max_model_len=48, bucket_ladder=(3, 4),
                      max_num_batched_tokens=32)
PROMPTS = [np.random.default_rng(i).integers(2, TINY.vocab_size, n).tolist() for i, n in enumerate([5, 9, 23])]


def outputs(dcp: int, interleave: int, *, enable_tbo: bool, decodes: int):
    """Prefill PROMPTS, then one decode step of the first `decodes` of them: (prefill logits at every position,
    selected ids, first tokens, decode logits, selected, tokens), host arrays."""
    parallel = ParallelConfig(tp=dcp, dcp=dcp, interleave=interleave)
    runner = ModelRunner(TINY, init_params(TINY, seed=4), parallel, ENGINE, make_mesh(parallel), "reference",
                         enable_tbo=enable_tbo)
    blocks = ENGINE.max_blocks_per_seq(dcp)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(len(PROMPTS))]
    logits, selected, first = oracle.prefill(runner, PROMPTS, tables, all_logits=True, return_selected=True)
    decoded = oracle.decode(runner, first[:decodes], [len(p) + 1 for p in PROMPTS[:decodes]], tables[:decodes],
                            return_selected=True)
    return (logits, selected, first, *decoded)


def assert_same(got, want):
    for a, b in zip(got, want):
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype.kind == "f":
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0, equal_nan=True)
        else:
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dcp, interleave, decodes", [
    (2, 2, 2),  # bucket 3: micro-batches of 1 and 2 rows, the second holding a pad
    # Ranks owning none of a 5-token prompt's keys; bucket 3 split 1 + 2, all real.
    pytest.param(8, 1, 3, marks=pytest.mark.slow),
    pytest.param(4, 1, 2, marks=pytest.mark.slow),
    pytest.param(4, 2, 3, marks=pytest.mark.slow),
    pytest.param(2, 1, 1, marks=pytest.mark.slow),
])
def test_tbo_outputs_equal_the_plain_steps(dcp, interleave, decodes):
    assert_same(outputs(dcp, interleave, enable_tbo=True, decodes=decodes),
                outputs(dcp, interleave, enable_tbo=False, decodes=decodes))


def test_a_micro_batch_reading_the_other_ones_rows_is_caught(monkeypatch):
    """The review's bug: the second micro-batch's metadata taken at the first one's offset. Wired in, the outputs
    differ from the plain step's (so the equality test above would fail)."""
    want = outputs(2, 2, enable_tbo=False, decodes=2)

    def first_rows(md, rows):
        return real_view(md, slice(0, rows.stop - rows.start))

    real_view = arrays.rows_view
    monkeypatch.setattr(arrays, "rows_view", first_rows)
    got = outputs(2, 2, enable_tbo=True, decodes=2)
    assert not all(np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True) for a, b in zip(got, want))


def test_micro_batches_are_consecutive_static_row_ranges():
    assert mla_dcp.micro_batch_rows(7, 2) == [slice(0, 3), slice(3, 7)]
    assert mla_dcp.micro_batch_rows(1, 2) == [slice(0, 1)]
    assert mla_dcp.micro_batch_rows(8, 1) == [slice(0, 8)]


def collectives(runner, rows: int) -> dict[str, int]:
    """Counts of the DCP / TP collectives in the greedy program of a bucket (inside every sub-jaxpr)."""
    counts: dict[str, int] = {}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("all_gather", "psum", "all_to_all", "ppermute"):
                counts[eqn.primitive.name] = counts.get(eqn.primitive.name, 0) + 1
            for value in eqn.params.values():
                for item in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(item, jax.extend.core.ClosedJaxpr):
                        walk(item.jaxpr)
                    elif isinstance(item, jax.extend.core.Jaxpr):
                        walk(item)

    walk(runner.steps[GREEDY.name].jaxpr(runner.params, runner.state, rows).jaxpr)
    return counts


def test_tbo_programs_run_two_chains_derive_no_length_and_compile_once():
    parallel = ParallelConfig(tp=2, dcp=2, interleave=2)
    runners = {tbo: ModelRunner(TINY, init_params(TINY, seed=4), parallel, ENGINE, make_mesh(parallel), "reference",
                                enable_tbo=tbo) for tbo in (False, True)}
    plain, split = collectives(runners[False], 4), collectives(runners[True], 4)
    # Each micro-batch has its own candidate exchange and query all-gather (and TP all-reduce of its output).
    assert split["all_gather"] > plain["all_gather"] and split["psum"] > plain["psum"], (plain, split)
    runner = runners[True]
    for variant, step in runner.steps.items():
        for rows in step.buckets:
            assert step.length_derivations(runner.params, runner.state, rows) == [], (variant, rows)
    programs = runner.programs([GREEDY])  # greedy steps: the greedy program, or the drawing one past the decode widths
    runner.compile_all(programs)
    compiled = {name: step.num_compiled for name, step in runner.steps.items()}
    blocks = ENGINE.max_blocks_per_seq(2)
    tables = np.arange(2 * blocks, dtype=np.int32).reshape(2, blocks)
    for rows in (ScheduledRows.decode([0, 1], [5, 9], tables, tokens=[7, 8]),  # bucket 3
                 ScheduledRows.verify([0, 1], [6, 10], [0, 0], tables)):  # the same, as verify groups of none
        for _ in range(2):
            jax.block_until_ready(runner.dispatch(rows, GREEDY))
    assert {name: step.num_compiled for name, step in runner.steps.items()} == compiled
    assert sum(compiled.values()) == len(programs) == len(ENGINE.buckets)


def test_llm_with_tbo_generates_the_plain_engines_greedy_tokens():
    from dcp_jax.host.sampling import SamplingParams
    from dcp_jax.serving.llm import LLM

    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    got = [LLM("tiny", dcp=2, interleave=2, max_model_len=48, max_num_seqs=4, page_size=4, dtype="float32",
               enable_tbo=tbo).generate(prompt_token_ids=PROMPTS, sampling_params=params) for tbo in (False, True)]
    assert [o.outputs[0].token_ids for o in got[0]] == [o.outputs[0].token_ids for o in got[1]]
