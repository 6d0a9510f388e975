"""dcp_jax/host/sampling.py: the sampling parameters' validation, the requests' seeds and the logprobs the host
builds from the device's outputs. (The sampler runs on the device: tests/runtime/test_sampler.py.)"""

import pytest

from dcp_jax.host.sampling import MAX_LOGPROBS, SamplingParams, TokenLogprob, request_seed, seed_words


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(seed=-1), "seed"),
    (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=MAX_LOGPROBS + 1), "logprobs"),
    (dict(stop=[""]), "stop"),
    (dict(stop=["s"] * 65), "stop takes at most 64 strings"),
    (dict(stop=["s" * 513]), "of at most 512 characters"),
    (dict(stop_token_ids=[-3]), "stop_token_ids"),
    (dict(temperature=2.5), "temperature"),
    (dict(n=0), "n must"),
    (dict(n=2, temperature=0), "greedy"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=17, max_tokens=16), "min_tokens"),
])
def test_bad_params_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_each_of_n_choices_draws_from_seed_plus_its_index():
    params = SamplingParams(n=3, temperature=1.0, seed=7)
    assert [params.for_choice(i).seed for i in range(3)] == [7, 8, 9]
    assert {params.for_choice(i).n for i in range(3)} == {1}
    assert SamplingParams(n=2).for_choice(1).seed is None


def test_stop_is_normalized():
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop_token_ids=[3]).stop_token_ids == (3,)


def test_a_request_draws_from_its_own_seed_else_one_of_the_engine_and_its_number():
    seeded = SamplingParams(seed=2**40 + 5)
    assert request_seed(seeded, engine_seed=0, number=1) == request_seed(seeded, engine_seed=9, number=7) == 2**40 + 5
    unseeded = SamplingParams()
    seeds = {request_seed(unseeded, engine_seed=0, number=n) for n in range(1000)}
    assert len(seeds) == 1000 and all(0 <= s < 2**64 for s in seeds)
    assert request_seed(unseeded, 0, 3) == request_seed(unseeded, 0, 3) != request_seed(unseeded, 1, 3)
    assert seed_words(2**40 + 5) == (5, 2**8)


def test_token_logprob_keeps_the_token_first_then_the_top_n():
    lp = TokenLogprob.of(7, -1.5, top_ids=[3, 7, 9, 1], top_logprobs=[-0.2, -1.5, -2.0, -3.0], top_n=2,
                         text_offset=4)
    assert lp.token_id == 7 and lp.logprob == -1.5 and lp.text_offset == 4
    assert list(lp.top) == [7, 3] and lp.top[3] == pytest.approx(-0.2)  # the top 2 are 3 and 7 (itself)
    assert list(TokenLogprob.of(9, -2.0, [3, 7, 9], [-0.2, -1.5, -2.0], top_n=0).top) == [9]
