"""The serving engine (dcp_jax/serving/engine.py, over serving/core.py) driven directly: warm-up, greedy parity
with the offline LLM, seeds, prompt logprobs (through a preemption too), async streaming, aborts, duplicate ids,
per-request failure isolation, a fault that consumes the donated KV cache, and stopping with streams still open."""

import asyncio
import queue
import threading

import numpy as np
import pytest

from dcp_jax.serving.engine import EngineStoppedError
from dcp_jax.host.sampling import SamplingParams
from tests.serving.serving_utils import ENGINE_KW, make_engine

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = make_engine(tmp_path_factory).start()
    yield eng
    eng.stop()


def run(engine, prompt, **params):
    events = list(engine.generate(prompt, SamplingParams(**params)))
    return [t for e in events for t in e.token_ids], events[-1]


def drain(sink, timeout=60):
    """All events of one request from its sink."""
    events = []
    while not events or events[-1].finish_reason is None:
        events.append(sink.get(timeout=timeout))
    return events


def test_every_bucket_compiled_at_start(engine):
    buckets = engine.engine_config.buckets
    assert buckets == (1, 2, 4, 8, 32)  # the ladder's decode widths, then the token budget (prefill chunks)
    # Every bucket drawing; greedy only the decode widths (max_num_seqs = 8): a wider bucket holds prefill chunks,
    # and its greedy steps run the drawing program; prompt logprobs only past them (such a step runs in one).
    assert engine.num_programs == 2 * len(buckets)
    assert engine.runner.steps["greedy"].num_compiled == 4
    assert engine.runner.steps["sampled"].num_compiled == len(buckets)
    assert engine.runner.steps["prompt_logprobs"].num_compiled == 1
    # The counter is live: the warm-up itself was counted (a compile or a persistent-cache load per program).
    assert engine.compile_count >= engine.num_programs
    assert engine.compiles_after_warmup == 0


def test_greedy_matches_offline_llm(engine):
    from dcp_jax.serving.llm import LLM

    prompts = [[5, 6, 7], [100, 200, 300, 400, 500, 3, 4], list(range(10, 40))]
    kw = {k: ENGINE_KW[k] for k in ("dtype", "dcp", "interleave", "page_size", "num_pages", "max_num_seqs",
                                     "max_model_len", "max_num_batched_tokens")}
    llm = LLM("tiny", seed=0, **kw)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    offline = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    for prompt, out in zip(prompts, offline):
        tokens, last = run(engine, prompt, max_tokens=10, temperature=0, ignore_eos=True)
        assert tokens == out.outputs[0].token_ids and last.finish_reason == "length"


def test_seeded_sampling_is_reproducible_and_independent_of_neighbours(engine):
    kw = dict(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone, _ = run(engine, [9, 8, 7], **kw)
    sinks = [queue.Queue() for _ in range(6)]
    for i, sink in enumerate(sinks):
        engine.add_request([9, 8, 7], SamplingParams(**(kw | {"seed": 1234 if i == 3 else i})), sink)
    batched = []
    for sink in sinks:
        tokens = []
        while True:
            event = sink.get(timeout=60)
            tokens += event.token_ids
            if event.finish_reason:
                break
        batched.append(tokens)
    assert batched[3] == alone
    assert len({tuple(t) for t in batched}) > 1  # other seeds draw other tokens


def test_prompt_logprobs_agree_with_next_token_logprob(engine):
    prompt = [50, 60, 70, 80]
    events = list(engine.generate(prompt, SamplingParams(max_tokens=1, temperature=0, logprobs=0)))
    first = events[-1].logprobs[0]
    echoed = list(engine.generate(prompt + [first.token_id], SamplingParams(max_tokens=1, temperature=0),
                                  prompt_logprobs=1))
    prompt_lps = echoed[0].prompt_logprobs
    assert prompt_lps[0] is None and len(prompt_lps) == len(prompt) + 1
    assert prompt_lps[-1].token_id == first.token_id
    assert prompt_lps[-1].logprob == pytest.approx(first.logprob, abs=1e-5)
    assert max(prompt_lps[-1].top.values()) == pytest.approx(first.logprob, abs=1e-5)  # greedy = top-1


def test_async_consumer_streams_deltas(engine):
    async def consume():
        got = []
        async for event in engine.generate_async([11, 12, 13], SamplingParams(max_tokens=8, temperature=0,
                                                                              ignore_eos=True)):
            got.append(event)
        return got

    events = asyncio.run(consume())
    assert sum(len(e.token_ids) for e in events) == 8 and events[-1].finish_reason == "length"
    assert all(e.finish_reason is None for e in events[:-1])


def test_a_loop_sink_hands_a_whole_step_to_the_asyncio_loop_in_one_call(engine):
    """4 requests decoding together through one LoopSink: each turn of the engine loop wakes the asyncio loop once
    with every request's event, and the events reach their own queues in order."""
    from dcp_jax.serving.streams import LoopSink

    async def consume():
        sink = LoopSink(asyncio.get_running_loop())
        batches, deliver = [], sink._deliver
        sink._deliver = lambda batch: (batches.append(len(batch)), deliver(batch))
        queues = {}
        for i in range(4):
            queues[f"batched-{i}"] = asyncio.Queue()
            sink.route(f"batched-{i}", queues[f"batched-{i}"])
            engine.add_request([30 + i, 31, 32], SamplingParams(max_tokens=8, **GREEDY), sink,
                               request_id=f"batched-{i}")
        tokens = {}
        for rid, q in queues.items():
            events = []
            while not events or events[-1].finish_reason is None:
                events.append(await asyncio.wait_for(q.get(), 60))
            tokens[rid] = [t for e in events for t in e.token_ids]
        return batches, tokens

    batches, tokens = asyncio.run(consume())
    assert all(len(t) == 8 for t in tokens.values())
    assert sum(batches) >= 4 * 2 and max(batches) == 4  # a decode step's 4 events in one call
    assert len(batches) < sum(batches)


def test_abort_frees_pages(engine):
    sink = queue.Queue()
    rid = engine.add_request([1, 2, 3], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True), sink)
    sink.get(timeout=60)
    engine.abort(rid)
    while (event := sink.get(timeout=60)).finish_reason is None:
        pass
    assert event.finish_reason == "abort"
    deadline = 0
    while engine.num_free_pages != engine.num_pages and deadline < 200:
        deadline += 1
        asyncio.run(asyncio.sleep(0.01))
    assert engine.num_free_pages == engine.num_pages
    # The gauges see the cancellation though the idle loop steps no more.
    assert "dcp_jax_running_requests 0" in engine.metrics.render()
    assert "dcp_jax_waiting_requests 0" in engine.metrics.render()


def test_a_failing_request_fails_only_itself(engine, monkeypatch):
    """A fault while one request's token is applied on the host (its detokenization, say) fails it alone."""
    real = engine.scheduler.append_token

    def flaky(request, token):
        if request.params.seed == 666:
            raise RuntimeError("injected token fault")
        return real(request, token)

    monkeypatch.setattr(engine.scheduler, "append_token", flaky)
    sinks = {seed: queue.Queue() for seed in (1, 666, 2)}
    for seed, sink in sinks.items():
        engine.add_request([4, 5, 6], SamplingParams(max_tokens=6, temperature=0.5, seed=seed, ignore_eos=True), sink)
    finals = {}
    for seed, sink in sinks.items():
        while (event := sink.get(timeout=60)).finish_reason is None:
            pass
        finals[seed] = event
    assert finals[666].finish_reason == "error" and "injected" in finals[666].error
    monkeypatch.undo()
    assert finals[1].finish_reason == finals[2].finish_reason == "length"
    assert engine.is_alive and engine.scheduler.allocator.num_used == 0


def test_validation_rejects_before_queueing(engine):
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request([3] * 60, SamplingParams(max_tokens=10), queue.Queue())
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([3, 99999], SamplingParams(max_tokens=1), queue.Queue())
    assert engine.scheduler.num_waiting == 0
    assert np.isfinite(engine.metrics.tokens_per_second())


def test_duplicate_request_id_is_refused_before_touching_the_live_stream(engine):
    sink = queue.Queue()
    engine.add_request([7, 8, 9], SamplingParams(max_tokens=12, **GREEDY), sink, request_id="dup")
    other = queue.Queue()
    with pytest.raises(ValueError, match="duplicate request_id"):
        engine.add_request([7, 8, 9], SamplingParams(max_tokens=2), other, request_id="dup")
    events = drain(sink)
    assert events[-1].finish_reason == "length" and sum(len(e.token_ids) for e in events) == 12
    assert other.empty()
    # Finished: the id is free again.
    again = queue.Queue()
    engine.add_request([7, 8, 9], SamplingParams(max_tokens=1, **GREEDY), again, request_id="dup")
    assert drain(again)[-1].finish_reason == "length"


def test_only_sampled_tokens_cross_to_the_host(engine, monkeypatch):
    """Serving runs the programs that return sampled tokens and their logprobs, packed in one int32 array: no
    logits, no selected ids."""
    from dcp_jax.runtime import sampler

    real, seen = engine.runner.dispatch, []

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(out)
        return out

    monkeypatch.setattr(engine.runner, "dispatch", spy)
    run(engine, [3, 4, 5], max_tokens=3, **GREEDY)
    assert seen and all(out.dtype == np.int32 and out.shape[1] == 2 + 2 * sampler.TOP_LOGPROBS for out in seen)
    assert all(sampler.unpack(out).top_ids.shape[1] == 20 for out in seen)


def test_preempted_request_keeps_its_prompt_logprobs(engine, monkeypatch):
    """8 requests of 21-token contexts fill the 24-page pool (3 pages each); growing to a 4th page preempts the
    youngest, which asked for prompt logprobs: it gets them once, equal to a run alone, and its greedy tokens
    do not change through the recompute."""
    prompts = [[10 + i] * 20 for i in range(8)]
    alone = drain_one(engine, prompts[-1], max_tokens=30, prompt_logprobs=2)
    real, preempted = engine.scheduler.schedule, []

    def spy():
        plan = real()
        preempted.extend(r.request_id for r in plan.preempted)
        return plan

    monkeypatch.setattr(engine.scheduler, "schedule", spy)
    sinks = [queue.Queue() for _ in prompts]
    rids = [engine.add_request(p, SamplingParams(max_tokens=30, **GREEDY), sink,
                               prompt_logprobs=2 if i == len(prompts) - 1 else None)
            for i, (p, sink) in enumerate(zip(prompts, sinks))]
    events = [drain(sink) for sink in sinks]
    assert rids[-1] in preempted
    last = events[-1]
    assert [e.prompt_logprobs is not None for e in last] == [True] + [False] * (len(last) - 1)
    assert [t for e in last for t in e.token_ids] == [t for e in alone for t in e.token_ids]
    for got, want in zip(last[0].prompt_logprobs[1:], alone[0].prompt_logprobs[1:]):
        assert got.token_id == want.token_id and got.top.keys() == want.top.keys()
        assert got.logprob == pytest.approx(want.logprob, abs=1e-5)
    assert all(e[-1].finish_reason == "length" for e in events)


def drain_one(engine, prompt, **kw):
    sink = queue.Queue()
    prompt_logprobs = kw.pop("prompt_logprobs", None)
    engine.add_request(prompt, SamplingParams(**kw, **GREEDY), sink, prompt_logprobs=prompt_logprobs)
    return drain(sink)


def test_a_failing_prefill_that_kept_the_kv_cache_fails_only_itself(engine, monkeypatch):
    """A fault while one request's prefill chunk is built fails it alone; the step runs the others' rows."""
    real = engine.core._chunk_rows

    def flaky(request, n):
        if request.prompt_ids[0] == 77:
            raise RuntimeError("injected prefill fault")
        return real(request, n)

    monkeypatch.setattr(engine.core, "_chunk_rows", flaky)
    resets = engine.metrics.kv_cache_resets
    long = queue.Queue()
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=20, **GREEDY), long)
    first = long.get(timeout=60)  # running
    bad = drain_one(engine, [77, 1, 2], max_tokens=4)
    assert bad[-1].finish_reason == "error" and "injected prefill fault" in bad[-1].error
    rest = [first] + drain(long)
    assert rest[-1].finish_reason == "length" and sum(len(e.token_ids) for e in rest) == 20
    assert engine.metrics.kv_cache_resets == resets


def test_a_fault_that_consumed_the_kv_cache_reallocates_it(engine, monkeypatch):
    """The step program raises after its donated cache was consumed: the engine allocates a fresh cache (no
    recompile), fails the running requests (their context is gone), counts it, and serves on correctly."""
    import jax

    want, _ = run(engine, [21, 22, 23], max_tokens=6, **GREEDY)
    step = engine.runner.steps["greedy"]  # the requests are greedy
    real, faults = step.run_placed, []

    def consumed(params, state, placed):
        if not faults:
            faults.append(True)
            for leaf in jax.tree.leaves(state.kv_cache):
                leaf.delete()  # what a failure after donation leaves behind
            raise RuntimeError("injected fault after donation")
        return real(params, state, placed)

    monkeypatch.setattr(step, "run_placed", consumed)
    resets, compiles = engine.metrics.kv_cache_resets, engine.compiles_after_warmup  # (the LLM test compiles too)
    events = drain_one(engine, [21, 22, 23], max_tokens=6)
    assert events[-1].finish_reason == "error" and "KV cache was lost" in events[-1].error
    assert engine.metrics.kv_cache_resets == resets + 1
    assert f"dcp_jax_kv_cache_resets_total {resets + 1}" in engine.metrics.render()
    assert engine.is_alive and engine.runner.kv_cache_is_usable()
    assert run(engine, [21, 22, 23], max_tokens=6, **GREEDY)[0] == want
    assert engine.compiles_after_warmup == compiles
    assert engine.scheduler.allocator.num_used == 0


def test_stopping_ends_every_open_stream_and_refuses_new_requests(engine, monkeypatch):
    """The loop is held inside a step while one request runs and another waits in the inbox; stop: both streams
    end with an abort, new requests raise at once; start again: it serves."""
    real, inside, release = engine.runner.dispatch, threading.Event(), threading.Event()

    def held(*args, **kwargs):
        inside.set()
        release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "dispatch", held)
    running, queued = queue.Queue(), queue.Queue()
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=40, **GREEDY), running)
    assert inside.wait(30)
    engine.add_request([4, 5, 6], SamplingParams(max_tokens=40, **GREEDY), queued)
    stopper = threading.Thread(target=engine.stop)
    stopper.start()
    assert engine._stopping.wait(30)  # bounded: a stop that never begins fails here, not by hanging
    release.set()
    stopper.join(30)
    try:
        for sink in (running, queued):
            last = drain(sink, timeout=10)[-1]
            assert last.finish_reason == "abort" and last.error == "the engine stopped"
        assert not engine.is_alive
        with pytest.raises(EngineStoppedError):
            engine.add_request([1, 2], SamplingParams(max_tokens=1), queue.Queue())
        assert engine.scheduler.allocator.num_used == 0 and not engine.scheduler.has_work
    finally:
        monkeypatch.undo()
        engine.start()
    assert run(engine, [1, 2, 3], max_tokens=2, **GREEDY)[1].finish_reason == "length"


def test_mixed_sampling_parameters_in_one_batch_compile_nothing(engine):
    """Every parameter is a traced array: greedy, temperature, top-k / top-p / min-p and penalties side by side
    run the warm-up's programs, and each seeded request draws what it draws alone."""
    mixed = [dict(temperature=0), dict(temperature=0.8, top_p=0.9, seed=3), dict(temperature=1.3, top_k=7, seed=4),
             dict(temperature=0.6, min_p=0.1, seed=5), dict(temperature=1.0, presence_penalty=1.5, seed=6),
             dict(temperature=0.9, frequency_penalty=-0.5, repetition_penalty=1.4, seed=7)]
    compiles = engine.compiles_after_warmup
    sinks = [queue.Queue() for _ in mixed]
    for kw, sink in zip(mixed, sinks):
        engine.add_request([11, 12, 13, 14], SamplingParams(max_tokens=8, ignore_eos=True, **kw), sink)
    together = [[t for e in drain(sink) for t in e.token_ids] for sink in sinks]
    assert engine.compiles_after_warmup == compiles
    for kw, tokens in list(zip(mixed, together))[1:]:
        assert run(engine, [11, 12, 13, 14], max_tokens=8, ignore_eos=True, **kw)[0] == tokens


def test_warm_up_progress_is_log_lines_off_a_terminal(caplog, capsys):
    """Off a terminal (a log, a pipe) the warm-up writes no progress-bar frames: one log line a program."""
    import logging

    from dcp_jax.serving.engine import Engine

    with caplog.at_level(logging.INFO, logger="dcp_jax.serving.engine"):
        eng = Engine("tiny", num_layers=1, max_num_seqs=1, bucket_ladder=(1,), max_model_len=16, page_size=4,
                     max_num_batched_tokens=2, prompt_logprobs=False, progress=True)
    assert "\r" not in capsys.readouterr().err
    lines = [r.getMessage() for r in caplog.records]
    assert sum("compiled program" in line for line in lines) == eng.num_programs == 3  # greedy 1; drawing 1, 2
    assert any(line.startswith(f"compiled {eng.num_programs} programs in") for line in lines)
