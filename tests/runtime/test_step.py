"""dcp_jax/runtime/step.py and the jaxpr check of runtime/jaxpr_check.py: one compile per bucket, no tracing
afterwards, no device-side derivation of local lengths in any step program (decode rows and prefill chunks run the
same programs; and the check catches one wired in), and metadata errors before anything is traced."""


import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax.sharding import NamedSharding, PartitionSpec as P

from dcp_jax.config import TINY, EngineConfig, ParallelConfig
from dcp_jax.demo import decode_stack_body, init_stack_params, make_stack_step
from dcp_jax.host.layout import DcpLayout
from dcp_jax.host.sampling import SamplingParams
from dcp_jax.host.step_metadata import build_step_metadata
from dcp_jax.model.kv_cache import allocate_kv_cache
from dcp_jax.model.mesh import DCP, make_mesh
from dcp_jax.runtime.forward import GREEDY, PROMPT_LOGPROBS, SAMPLED
from dcp_jax.runtime.jaxpr_check import host_syncs, length_derivations, local_context_lens_on_device
from dcp_jax.runtime.runner import step_kind
from dcp_jax.runtime.step import Placed
from dcp_jax.serving.engine_args import EngineArgs
from dcp_jax.serving.loading import load_model

ENGINE = EngineConfig(page_size=4, num_pages=64, max_num_seqs=8, max_model_len=64, max_num_batched_tokens=8)
PARALLEL = ParallelConfig(tp=4, dcp=4, interleave=2)
MAX_BLOCKS = ENGINE.max_blocks_per_seq(PARALLEL.dcp)
LAYOUT = DcpLayout(PARALLEL.dcp, PARALLEL.interleave, ENGINE.page_size)


class CountingBody:
    """decode_stack_body that counts its traces."""

    def __init__(self):
        self.traces = 0

    def __call__(self, *args, **kwargs):
        self.traces += 1
        return decode_stack_body(*args, **kwargs)


def fallback_body(params, kv_cache, hidden, md, **kwargs):
    """The failure mode guarded against: local lengths re-derived on device from the global ones."""
    derived = local_context_lens_on_device(
        md.context_lens, jax.lax.axis_index(DCP), dcp=kwargs["layout"].dcp_size, interleave=kwargs["layout"].interleave
    )
    return decode_stack_body(params, kv_cache, hidden, md._replace(local_context_lens=derived), **kwargs)


def counting_mask_body(params, kv_cache, hidden, md, **kwargs):
    """A disguised fallback: count this rank's tokens below each row's position with a comparison mask."""
    layout = kwargs["layout"]
    tokens = jnp.arange(ENGINE.max_model_len)
    is_mine = (tokens // layout.interleave) % layout.dcp_size == jax.lax.axis_index(DCP)
    derived = jnp.sum(is_mine[None, :] & (tokens[None, :] <= md.positions[:, None]), axis=1).astype(jnp.int32)
    return decode_stack_body(params, kv_cache, hidden, md._replace(local_context_lens=derived), **kwargs)


def float_round_trip_body(params, kv_cache, hidden, md, **kwargs):
    """A disguised fallback (S = 1 formula, close enough to matter): floor division through a float cast."""
    layout = kwargs["layout"]
    lengths = (md.positions + 1).astype(jnp.float32)
    derived = (lengths * (1.0 / layout.dcp_size)).astype(jnp.int32)
    return decode_stack_body(params, kv_cache, hidden, md._replace(local_context_lens=derived), **kwargs)


@pytest.fixture(scope="module")
def setup():
    mesh = make_mesh(PARALLEL)
    params = init_stack_params(TINY, jax.random.key(0))
    return mesh, params


def metadata(lens, bucket):
    per_block = ENGINE.page_size * PARALLEL.dcp
    tables = [list(range(i * MAX_BLOCKS, i * MAX_BLOCKS + -(-n // per_block))) for i, n in enumerate(lens)]
    return build_step_metadata(lens, [1] * len(lens), tables, rows=bucket, seqs=bucket, layout=LAYOUT,
                               max_blocks=MAX_BLOCKS)


def test_one_compile_per_bucket_and_no_tracing_afterwards(setup):
    mesh, params = setup
    body = CountingBody()
    step = make_stack_step(TINY, PARALLEL, ENGINE, mesh, "reference", body=body)
    params = step.place_params(params)
    kv_cache = allocate_kv_cache(TINY, ENGINE, PARALLEL.dcp, mesh)
    for rows in ENGINE.buckets:
        step.compile(params, kv_cache, rows)
        step.compile(params, kv_cache, rows)  # a second request is a no-op
    assert body.traces == len(ENGINE.buckets) == step.num_compiled

    rng = np.random.default_rng(0)
    with jax.no_tracing():
        for _ in range(60):
            rows = int(rng.integers(1, ENGINE.max_num_seqs + 1))
            bucket = ENGINE.bucket_for(rows)
            md = metadata(rng.integers(1, ENGINE.max_model_len, rows).tolist(), bucket)
            hidden = rng.standard_normal((bucket, TINY.hidden_size)).astype(np.float32)
            old_cache = kv_cache
            out, kv_cache = step(params, kv_cache, hidden, md)
            assert all(pool.is_deleted() for pool in jax.tree.leaves(old_cache))  # the KV cache is donated
    assert np.all(np.isfinite(np.asarray(out)))
    assert body.traces == len(ENGINE.buckets)


def test_no_bucket_derives_local_lengths_on_device(setup):
    mesh, params = setup
    step = make_stack_step(TINY, PARALLEL, ENGINE, mesh, "reference")
    kv_cache = allocate_kv_cache(TINY, ENGINE, PARALLEL.dcp, mesh)
    for rows in ENGINE.buckets:
        assert step.length_derivations(params, kv_cache, rows) == []


@pytest.mark.parametrize(
    "body, expected_ops",
    [(fallback_body, {"floor_divide", "div", "clamp"}), (counting_mask_body, {"le", "lt", "ge", "gt"}),
     (float_round_trip_body, {"add", "convert_element_type"})],
    ids=["spec_fallback", "comparison_mask", "float_round_trip"],
)
def test_the_check_catches_a_wired_in_fallback(setup, body, expected_ops):
    mesh, params = setup
    step = make_stack_step(TINY, PARALLEL, ENGINE, mesh, "reference", body=body)
    kv_cache = allocate_kv_cache(TINY, ENGINE, PARALLEL.dcp, mesh)
    rows = ENGINE.buckets[-1]
    found = step.length_derivations(params, kv_cache, rows)
    assert expected_ops & {f.split(":")[0].split("/")[-1] for f in found}, found


def test_the_check_lets_host_rows_be_picked_but_not_computed_from():
    """A chained draft pass picks its row among host-built ones by a device count (a gather: moved, not derived);
    indexing by a global length, or arithmetic on the picked one, is still a derivation."""
    positions, count = jnp.zeros((4, 5), jnp.int32), jnp.zeros(4, jnp.int32)

    def found(f):
        return {d.split(":")[0].split("/")[-1] for d in length_derivations(jax.make_jaxpr(f)(positions, count), [0])}

    assert found(lambda p, a: jnp.cos(jnp.take_along_axis(p, a[:, None], axis=1).astype(jnp.float32))) == set()
    assert "gather" in found(lambda p, a: jnp.take(a, p[:, 0]))
    assert "add" in found(lambda p, a: jnp.take_along_axis(p, a[:, None], axis=1) + 1)


@pytest.mark.parametrize("model, kernels", [("tiny", "reference"), ("tiny", "pallas"), ("tiny-mla", "reference"),
                                           ("tiny-mla", "pallas"), ("tiny-glm", "reference")])
def test_no_program_of_the_model_derives_local_lengths(model, kernels):
    """Every bucket of every program kind (decode rows and prefill chunks alike, sampling included), with either
    kernels, of the sparse (tiny), the dense (tiny-mla) and the IndexShare model (tiny-glm: shared layers reuse the
    selection before them)."""
    # Experts twice the preset's width, so each of the 4 ranks' slice (16) is what the grouped matmul kernel takes.
    runner = load_model(EngineArgs(model=model, dcp=4, interleave=2, max_num_seqs=4, max_model_len=64,
                                   kernels=kernels, max_num_batched_tokens=16,
                                   hf_overrides={"moe_intermediate_size": 64})).runner
    assert runner.engine.buckets == (1, 2, 4, 8, 16)
    for step in runner.steps.values():  # greedy, drawing, prompt logprobs, detailed
        for rows in step.buckets:
            assert step.length_derivations(runner.params, runner.state, rows) == []


@pytest.mark.parametrize("kernels", ["reference", "pallas"])
def test_no_serving_program_waits_for_the_device_at_its_launch(kernels):
    """Asynchronous scheduling dispatches step t+1 while step t runs: no serving program may hold a traced branch
    or loop (the GPU runtime would read its predicate on the host, so the launch would wait for the device)."""
    runner = load_model(EngineArgs(model="tiny", dcp=2, max_num_seqs=4, max_model_len=64, kernels=kernels,
                                   max_num_batched_tokens=8)).runner
    for variant, rows in runner.programs((GREEDY, SAMPLED, PROMPT_LOGPROBS)):
        assert runner.steps[variant].host_syncs(runner.params, runner.state, rows) == [], (variant, rows)


def test_the_host_sync_check_finds_a_traced_branch():
    def branchy(x):
        return jax.lax.cond(x.sum() > 0, lambda v: v + 1, lambda v: v - 1, x)

    closed = jax.make_jaxpr(jax.jit(branchy))(jnp.ones(3))
    assert host_syncs(closed) == ["jit/cond"]
    assert host_syncs(jax.make_jaxpr(lambda x: jax.lax.fori_loop(0, 4, lambda i, v: v * 2, x))(jnp.ones(3))) == []


def test_the_fallback_variant_computes_the_same_step(setup):
    """The check's counter-example is a faithful fallback: same outputs as the host-length step."""
    mesh, params = setup
    rows, md = 4, metadata([1, 9, 30], 4)
    hidden = jnp.asarray(np.random.default_rng(1).standard_normal((rows, TINY.hidden_size)), jnp.float32)
    outs = []
    for body in (decode_stack_body, fallback_body):
        step = make_stack_step(TINY, PARALLEL, ENGINE, mesh, "reference", body=body)
        kv_cache = allocate_kv_cache(TINY, ENGINE, PARALLEL.dcp, mesh)
        step.compile(params, kv_cache, rows)
        outs.append(np.asarray(step(params, kv_cache, hidden, md)[0]))
    np.testing.assert_allclose(outs[0], outs[1], atol=1e-6)


def test_bad_metadata_fails_before_tracing(setup):
    mesh, params = setup
    body = CountingBody()
    step = make_stack_step(TINY, PARALLEL, ENGINE, mesh, "reference", body=body)
    kv_cache = allocate_kv_cache(TINY, ENGINE, PARALLEL.dcp, mesh)
    step.compile(params, kv_cache, 4)
    hidden = jnp.zeros((4, TINY.hidden_size))
    good = metadata([3, 5], 4)
    bad = [
        (good._replace(local_context_lens=good.local_context_lens[:2]), ValueError, "local_context_lens"),
        (good._replace(block_tables=good.block_tables.astype(np.int64)), TypeError, "block_tables"),
        (good._replace(slot_mapping=None), TypeError, "slot_mapping"),
        (metadata([3, 5], 3), ValueError, "bucket"),
        (metadata([3, 5], 2), ValueError, "not compiled"),
        (good._replace(query_seqs=good.query_seqs + 4), ValueError, "query_seqs"),
    ]
    with jax.no_tracing():
        for md, error, message in bad:
            with pytest.raises(error, match=message):
                step(params, kv_cache, hidden, md)
    assert body.traces == 1
    assert not any(pool.is_deleted() for pool in jax.tree.leaves(kv_cache))  # a rejected call consumes nothing


def test_placed_inputs_run_the_same_program(setup):
    """`pack_inputs` validates; its one buffer placed once, `run_placed` runs the bucket's program on it (the
    benchmark's device loop), giving what the validating call gives."""
    mesh, params = setup
    step = make_stack_step(TINY, PARALLEL, ENGINE, mesh, "reference")
    params = step.place_params(params)  # unplaced weights would be resharded by a jitted slice at the call
    kv_cache = allocate_kv_cache(TINY, ENGINE, PARALLEL.dcp, mesh)
    step.compile(params, kv_cache, 4)
    md = metadata([1, 9, 30], 4)
    hidden = jnp.asarray(np.random.default_rng(2).standard_normal((4, TINY.hidden_size)), jnp.float32)
    with pytest.raises(ValueError, match="block_tables has shape"):
        step.pack_inputs(hidden, md._replace(block_tables=md.block_tables[:, :1]))
    with jax.no_tracing():
        want, kv_cache = step(params, kv_cache, hidden, md)
        packed = step.pack_inputs(hidden, md)
        placed = Placed(packed.bucket, jax.device_put(packed.packed, NamedSharding(mesh, P())))
        assert isinstance(placed.packed, jax.Array) and placed.packed.ndim == 1  # one buffer: one transfer
        got, kv_cache = step.run_placed(params, kv_cache, placed)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_step_filled_into_a_packed_template_is_the_packed_step(setup):
    """`pack_filled` writes a step into a copy of a packed one through its views (the template stays as it was)
    and checks it as `pack_inputs` does: what it packs equals packing the step itself."""
    mesh, params = setup
    step = make_stack_step(TINY, PARALLEL, ENGINE, mesh, "reference")
    kv_cache = allocate_kv_cache(TINY, ENGINE, PARALLEL.dcp, mesh)
    step.compile(params, kv_cache, 4)
    hidden = np.random.default_rng(3).standard_normal((4, TINY.hidden_size)).astype(np.float32)
    md = metadata([1, 9, 30], 4)
    template = step.pack_inputs(np.zeros_like(hidden), metadata([1], 4))
    before = template.packed.copy()

    def fill(inputs, views):
        inputs[...] = hidden
        for name, value in md._asdict().items():
            getattr(views, name)[...] = value

    filled = step.pack_filled(template, fill)
    np.testing.assert_array_equal(filled.packed, step.pack_inputs(hidden, md).packed)
    np.testing.assert_array_equal(template.packed, before)

    def shared_page(inputs, views):
        fill(inputs, views)
        views.block_tables[1, 0] = views.block_tables[2, 0]  # two rows write one page

    with pytest.raises(ValueError, match="written this step are used by two blocks"):
        step.pack_filled(template, shared_page)


@pytest.mark.parametrize("model", [dict(model="dsa-tiny"),  # bf16, one stack of 4 layers
                                   dict(model="tiny", num_layers=2, speculative_config={  # two one-layer stacks, MTP
                                       "method": "mtp", "num_speculative_tokens": 1})])
def test_a_decode_step_does_no_work_the_size_of_the_kv_pool(model):
    """The serving decode program's workspace does not grow with the pool (no copy of it, no whole-pool convert):
    a decode step costs what its context costs (on a CPU a copy of the default pool once cost 0.2 s a token).
    DCP 2, reference kernels."""
    temp, pool = {}, 0
    for pages in (64, 512):
        runner = load_model(EngineArgs(**model, dcp=2, num_pages=pages, max_model_len=1024,
                                       max_num_seqs=1, max_num_batched_tokens=8, kernels="reference")).runner
        pool = sum(leaf.nbytes for leaf in jax.tree.leaves(runner.state.kv_cache)) // 2  # per rank
        compiled = runner.steps["greedy"].compile(runner.params, runner.state, 1)
        temp[pages] = compiled.memory_analysis().temp_size_in_bytes
    assert temp[512] < pool / 8 and abs(temp[512] - temp[64]) < 2**20, (temp, pool)


def vocab_top_ks(text: str, vocab: int) -> int:
    """top_k ops over a last axis of `vocab` in lowered StableHLO text."""
    shapes = re.findall(r"top_k\(.*?: tensor<([0-9x]+)x[a-z0-9]+> ->", text)
    return sum(int(shape.split("x")[-1]) == vocab for shape in shapes)


def test_only_steps_that_want_logprobs_sort_the_vocabulary():
    """The greedy program computes no top logprobs (a full-vocabulary top_k: a quarter of the greedy step at B = 64
    on an H100); a step whose greedy rows want logprobs runs the drawing program, which does: a full top_k with the
    reference kernels, the Pallas top-k kernel with the Pallas ones (no top_k op). dsa-tiny, f32."""
    args = EngineArgs(model="dsa-tiny", dcp=1, num_pages=64, max_model_len=256, max_num_seqs=2,
                      max_num_batched_tokens=8, kernels="reference")
    runner = load_model(args).runner
    vocab = runner.ctx.cfg.vocab_size
    counts = {kind: vocab_top_ks(runner.steps[kind].lower(runner.params, runner.state, 2).as_text(), vocab)
              for kind in ("greedy", "sampled")}
    assert counts["greedy"] == 0 and counts["sampled"] >= 1, counts
    pallas = load_model(dataclasses.replace(args, kernels="pallas")).runner
    assert vocab_top_ks(pallas.steps["sampled"].lower(pallas.params, pallas.state, 2).as_text(), vocab) == 0
    greedy = SamplingParams(temperature=0)
    assert step_kind([greedy, greedy], prompt_logprobs=False) is GREEDY
    assert step_kind([greedy, SamplingParams(temperature=0, logprobs=0)], prompt_logprobs=False) is SAMPLED
