"""dcp_jax/serving/core.py through `LLM`: asynchronous scheduling gives the synchronous core's outputs; a seeded
request's tokens do not depend on its batch, its bucket, how its prompt was chunked or a preemption; the device keeps
each request's history for its penalties. A budget of 16 rows a step chunks the longer prompts."""

import pytest

from dcp_jax import LLM, SamplingParams

KW = dict(dcp=2, interleave=2, page_size=4, max_num_seqs=8, max_model_len=64, dtype="float32", seed=0,
          max_num_batched_tokens=16)
PROMPTS = [[5, 6, 7], [100, 200, 300, 400, 500, 3, 4], list(range(10, 40)), [9] * 12, [7, 7, 7, 8], [300, 2]]


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", **KW)


def _outputs(llm, prompts, params, *, async_scheduling):
    llm.core.async_scheduling = async_scheduling
    try:
        return [(c.token_ids, c.text, c.finish_reason) for o in llm.generate(prompt_token_ids=prompts,
                                                                              sampling_params=params)
                for c in o.outputs]
    finally:
        llm.core.async_scheduling = True


def test_async_scheduling_gives_the_synchronous_outputs(llm):
    """Mixed sampling in one batch, stops found a step late (EOS at random, a stop string, stop token ids) and
    stops by length: the same tokens and texts either way, and every page back."""
    params = [SamplingParams(max_tokens=12, temperature=0),
              SamplingParams(max_tokens=20, temperature=0.9, top_p=0.8, seed=11),
              SamplingParams(max_tokens=9, temperature=1.2, top_k=5, min_p=0.05, seed=12, stop_token_ids=[40, 77]),
              SamplingParams(max_tokens=16, temperature=0.7, presence_penalty=1.0, frequency_penalty=0.5, seed=13),
              SamplingParams(max_tokens=16, temperature=1.0, repetition_penalty=1.5, seed=14, stop=["a", "b"]),
              SamplingParams(max_tokens=1, temperature=0.5, seed=15)]
    sync = _outputs(llm, PROMPTS, params, async_scheduling=False)
    assert _outputs(llm, PROMPTS, params, async_scheduling=True) == sync
    assert {reason for _, _, reason in sync} >= {"length"} and llm.num_free_pages == llm.engine_config.num_pages


def test_a_seeded_request_draws_the_same_alone_in_a_batch_in_another_bucket_and_after_preemption(llm):
    params = SamplingParams(max_tokens=14, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    others = SamplingParams(max_tokens=14, temperature=1.0, ignore_eos=True)
    alone = llm.generate(prompt_token_ids=[PROMPTS[2]], sampling_params=params)[0].outputs[0].token_ids  # bucket 1
    one_chunk = LLM("tiny", **(KW | dict(max_num_batched_tokens=32)))  # its 30-token prompt in one step, not two
    assert one_chunk.generate(prompt_token_ids=[PROMPTS[2]], sampling_params=params)[0].outputs[0].token_ids == alone
    batch = llm.generate(prompt_token_ids=PROMPTS, sampling_params=[others, others, params, others, others, others])
    assert batch[2].outputs[0].token_ids == alone  # bucket 8, other neighbours
    assert len({tuple(o.outputs[0].token_ids) for o in batch}) == len(PROMPTS)  # unseeded rows draw their own streams
    tight = LLM("tiny", **(KW | dict(num_pages=12)))  # 12 pages of 8 tokens: six 30-token contexts must preempt
    preempted = tight.generate(prompt_token_ids=[PROMPTS[2]] * 6, sampling_params=params)
    assert tight.core.metrics.preemptions > 0
    assert all(o.outputs[0].token_ids == alone for o in preempted)


def test_the_device_keeps_each_requests_history_for_its_penalties(llm):
    """What the penalties read on the device (tests/runtime/test_sampler.py checks what they do with it): the
    slot's prompt tokens and generated-token counts, and its last token, after a request's run."""
    import numpy as np

    prompt = [9] * 5 + [17, 23]
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        max_tokens=10, temperature=1.0, presence_penalty=1.0, frequency_penalty=1.0, repetition_penalty=1.5,
        seed=5, ignore_eos=True))[0].outputs[0]
    state = llm.runner.state.sampler  # it ran alone, in the lowest slot: 0
    vocab = llm.model_config.vocab_size
    np.testing.assert_array_equal(np.asarray(state.output_counts[0]), np.bincount(out.token_ids, minlength=vocab))
    np.testing.assert_array_equal(np.flatnonzero(np.asarray(state.prompt_mask[0])), [9, 17, 23])
    assert int(state.last_tokens[0]) == out.token_ids[-1]


def test_prefix_cache_hits_give_the_misses_outputs_and_compute_less(llm):
    """Prompts sharing full blocks (8 tokens here) with earlier ones: with the prefix cache their tokens equal the
    uncached engine's, greedy and seeded alike, the cache counts hits, and every page comes back free."""
    cached = LLM("tiny", **(KW | dict(enable_prefix_caching=True)))
    stem = list(range(10, 40))  # 3 full blocks and 6 tokens
    prompts = [stem + [5], stem + [6, 7], stem[:17] + [8], [9] * 12]
    params = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.9, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=1.0, seed=4, ignore_eos=True)]

    def tokens(engine):
        return [o.outputs[0].token_ids for o in engine.generate(prompt_token_ids=prompts, sampling_params=params)]

    want = tokens(llm)
    assert tokens(cached) == want  # the first two blocks of the stem are shared within this batch already
    hits_before = cached.core.metrics.value("dcp_jax_prefix_cache_hits_total")
    assert tokens(cached) == want  # now every stem block is cached
    hits = cached.core.metrics.value("dcp_jax_prefix_cache_hits_total") - hits_before
    queries = sum(len(p) for p in prompts)
    assert hits >= 3 * 8 * 2 + 2 * 8 and hits < queries  # the stem's blocks twice, stem[:16] once; never everything
    assert cached.num_free_pages == cached.engine_config.num_pages and cached.core.scheduler.allocator.num_cached > 0


def test_min_tokens_holds_stop_tokens_back_on_the_device(llm):
    """vLLM's min_tokens: a greedy request whose third choice would be its stop token samples the next best token
    instead until min_tokens tokens are out (EOS is held back the same way: `metadata.build_sampling_metadata`)."""
    prompt = PROMPTS[0]
    plain = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        max_tokens=12, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
    stop = plain[2]  # the token greedy decoding reaches at its third step: make it the stop token
    held = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[stop], min_tokens=4))[0].outputs[0]
    assert held.token_ids[:2] == plain[:2] and stop not in held.token_ids[:4]
    with pytest.raises(ValueError, match="holds back at most"):
        llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
            max_tokens=4, min_tokens=1, stop_token_ids=list(range(100, 120))))
