"""dcp_jax/serving/generation_config.py and its use: a checkpoint's generation_config.json sets the sampling
defaults of what a request leaves unset (vLLM's --generation-config auto | vllm | DIR)."""

import json

import pytest

from dcp_jax.serving import protocol
from dcp_jax.serving.generation_config import sampling_defaults


def write(directory, config):
    (directory / "generation_config.json").write_text(json.dumps(config))
    return str(directory)


def test_auto_reads_the_models_file_vllm_none_and_a_directory_its_own(tmp_path):
    model = write(tmp_path, {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "bos_token_id": 0, "do_sample": True,
                             "max_new_tokens": 10})
    assert sampling_defaults("auto", model) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert sampling_defaults("vllm", model) == {}
    assert sampling_defaults("auto", None) == {} and sampling_defaults("auto", str(tmp_path / "none")) == {}
    other = tmp_path / "other"
    other.mkdir()
    assert sampling_defaults(str(other.parent), None) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    with pytest.raises(ValueError, match="no generation_config.json"):
        sampling_defaults(str(other), model)
    greedy = tmp_path / "greedy"
    greedy.mkdir()
    assert sampling_defaults("auto", write(greedy, {"do_sample": False, "top_p": 0.9})) == {"temperature": 0.0,
                                                                                            "top_p": 0.9}


def test_the_defaults_fill_only_what_the_request_leaves_unset():
    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1}
    unset = protocol.CompletionRequest(prompt="x")
    params = unset.to_sampling_params(max_tokens=4, logprobs=None, vocab_size=300, defaults=defaults)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.6, 0.95, 20, 1.1)
    given = protocol.CompletionRequest(prompt="x", temperature=0.0, top_p=1.0, top_k=-1)
    params = given.to_sampling_params(max_tokens=4, logprobs=None, vocab_size=300, defaults=defaults)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.0, 1.0, -1, 1.1)
    plain = unset.to_sampling_params(max_tokens=4, logprobs=None, vocab_size=300)
    assert (plain.temperature, plain.top_p, plain.top_k, plain.repetition_penalty) == (1.0, 1.0, 0, 1.0)


def test_load_model_refuses_bad_launch_options_before_loading(tmp_path):
    from dcp_jax.serving.engine_args import EngineArgs
    from dcp_jax.serving.loading import load_model

    for kw, match in ((dict(tokenizer=str(tmp_path / "missing")), "not a directory"),
                      (dict(max_logprobs=21), "max_logprobs"),
                      (dict(generation_config=str(tmp_path)), "no generation_config.json")):
        with pytest.raises(ValueError, match=match):
            load_model(EngineArgs(model="tiny", **kw))
