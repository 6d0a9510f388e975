"""The serving engine (dcp_jax/engine.py) driven directly: warm-up, greedy parity with the offline LLM, seeds,
prompt logprobs, async streaming, aborts and per-request failure isolation."""

import asyncio
import queue

import numpy as np
import pytest

from dcp_jax.sampling import SamplingParams
from serving_utils import ENGINE_KW, make_engine


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = make_engine(tmp_path_factory).start()
    yield eng
    eng.stop()


def run(engine, prompt, **params):
    events = list(engine.generate(prompt, SamplingParams(**params)))
    return [t for e in events for t in e.token_ids], events[-1]


def test_every_bucket_and_prefill_length_compiled_at_start(engine):
    lengths = engine.runner.prefill_lengths
    assert engine.num_programs == len(engine.config.buckets) + 2 * len(lengths)
    assert engine.runner.decode_step.num_compiled == len(engine.config.buckets) == 4
    assert engine.compiles_after_warmup == 0


def test_greedy_matches_offline_llm(engine):
    from dcp_jax.llm import LLM

    prompts = [[5, 6, 7], [100, 200, 300, 400, 500, 3, 4], list(range(10, 40))]
    kw = {k: ENGINE_KW[k] for k in ("dcp", "interleave", "page_size", "num_pages", "max_num_seqs", "max_model_len")}
    llm = LLM("tiny", seed=0, **kw)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    offline = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    for prompt, out in zip(prompts, offline):
        tokens, last = run(engine, prompt, max_tokens=10, temperature=0, ignore_eos=True)
        assert tokens == out.token_ids and last.finish_reason == "length"


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


def test_a_failing_request_fails_only_itself(engine, monkeypatch):
    import dcp_jax.engine as engine_module

    real = engine_module.sample

    def flaky(logits, params, rng):
        if params.seed == 666:
            raise RuntimeError("injected sampling fault")
        return real(logits, params, rng)

    monkeypatch.setattr(engine_module, "sample", flaky)
    sinks = {seed: queue.Queue() for seed in (1, 666, 2)}
    for seed, sink in sinks.items():
        engine.add_request([4, 5, 6], SamplingParams(max_tokens=6, temperature=0.5, seed=seed, ignore_eos=True), sink)
    finals = {}
    for seed, sink in sinks.items():
        while (event := sink.get(timeout=60)).finish_reason is None:
            pass
        finals[seed] = event
    assert finals[666].finish_reason == "error" and "injected" in finals[666].error
    assert finals[1].finish_reason == finals[2].finish_reason == "length"
    assert engine.is_alive and engine.scheduler.allocator.num_used == 0


def test_validation_rejects_before_queueing(engine):
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request([3] * 60, SamplingParams(max_tokens=10), queue.Queue())
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([3, 99999], SamplingParams(max_tokens=1), queue.Queue())
    assert engine.scheduler.num_waiting == 0
    assert np.isfinite(engine.metrics.tokens_per_second())
