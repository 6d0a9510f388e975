"""The OpenAI-compatible server (dcp_jax/serving/server.py, openai_api.py, protocol.py) on loopback: the real
`openai` client, raw HTTP and raw sockets. vLLM's fields, refusals and validation; the bad-input battery (each a
4xx with an OpenAI-shaped JSON body); HEAD, OPTIONS (CORS), chunked and truncated bodies; idle connections; the
concurrency limit; API key; Prometheus metrics."""

import json
import math
import socket
import threading

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dcp_jax.serving.chat_template import PLAIN_CHAT_TEMPLATE, apply_chat_template, render_chat
from tests.serving.serving_utils import http, raw_exchange, start_server, wait_until

MAX_MODEL_LEN = 64  # serving_utils.ENGINE_KW


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from dcp_jax.serving.openai_api import CorsOptions

    srv = start_server(tmp_path_factory, body_timeout_s=1.0, cors=CorsOptions(allowed_origins=["http://ok"]))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0, timeout=60)


def post(server, path, body, **kw):
    status, headers, data = http(server, "POST", path, body, **kw)
    return status, json.loads(data)


def assert_openai_error(status, headers, data, *, status_range=(400, 500)):
    """A 4xx (or the given range) whose body is `{"error": {"message", "type", "param", "code"}}` JSON."""
    assert status_range[0] <= status < status_range[1], (status, data[:300])
    assert headers.get("content-type", "").startswith("application/json"), headers
    error = json.loads(data)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def completion_tokens(client, **kw):
    kw = dict(model="tiny", temperature=0) | kw
    return client.completions.create(**kw)


# ---- the basics through the openai client ---------------------------------------------------------------------
def test_models_health_and_prometheus_metrics(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"] and models[0].max_model_len == MAX_MODEL_LEN
    assert http(server, "GET", "/health")[0] == 200
    completion_tokens(client, prompt="metrics", max_tokens=3)
    status, headers, data = http(server, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(data.decode())}
    kinds = {"dcp_jax_time_to_first_token_seconds": "histogram", "dcp_jax_time_per_output_token_seconds": "histogram",
             "dcp_jax_e2e_request_latency_seconds": "histogram", "dcp_jax_prompt_tokens": "counter",
             "dcp_jax_generation_tokens": "counter", "dcp_jax_requests_finished": "counter",
             "dcp_jax_preemptions": "counter", "dcp_jax_compiles": "counter",
             "dcp_jax_compiles_after_warmup": "counter", "dcp_jax_running_requests": "gauge",
             "dcp_jax_waiting_requests": "gauge", "dcp_jax_kv_pages_used": "gauge", "dcp_jax_kv_pages_free": "gauge",
             "dcp_jax_generation_tokens_per_second": "gauge"}
    for name, kind in kinds.items():
        assert families[name].type == kind, name
    samples = {s.name: s.value for f in families.values() for s in f.samples if not s.labels.get("le")}
    assert samples["dcp_jax_compiles_after_warmup_total"] == 0 and samples["dcp_jax_generation_tokens_total"] >= 3
    assert samples["dcp_jax_e2e_request_latency_seconds_count"] >= 1
    # Only counters end in _total.
    assert all(f.type == "counter" for f in families.values() if f.name.endswith("_total") or
               any(s.name.endswith("_total") for s in f.samples))


def test_string_prompt_gets_bos_token_id_prompt_does_not(server, client):
    ids = server.tokens.encode("Hello")
    assert ids[0] == server.engine.model_config.bos_token_id
    r = completion_tokens(client, prompt="Hello", max_tokens=4)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 4
    assert completion_tokens(client, prompt=ids[1:], max_tokens=4).usage.prompt_tokens == len(ids) - 1
    assert completion_tokens(client, prompt=ids, max_tokens=4).choices[0].text == r.choices[0].text
    no_bos = completion_tokens(client, prompt="Hello", max_tokens=4, extra_body={"add_special_tokens": False})
    assert no_bos.usage.prompt_tokens == len(ids) - 1


def test_echo_logprobs_cover_the_whole_prompt(server, client):
    ids = [300, 301, 302, 303, 304, 305]
    r = completion_tokens(client, prompt=[ids], max_tokens=1, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x < 0 and math.isfinite(x) for x in lp.token_logprobs[1:])
    assert lp.tokens[: len(ids)] == [server.tokens.token_text(t) for t in ids]
    nxt = completion_tokens(client, prompt=[ids], max_tokens=1, logprobs=0)
    assert lp.tokens[-1] == nxt.choices[0].logprobs.tokens[0]
    assert lp.token_logprobs[-1] == pytest.approx(nxt.choices[0].logprobs.token_logprobs[0], abs=1e-5)
    assert lp.token_logprobs[-1] == pytest.approx(max(lp.top_logprobs[-1].values()), abs=1e-9)
    assert r.choices[0].text.startswith(server.tokens.decode(ids))


def test_echo_with_max_tokens_0_returns_the_prompt_and_its_logprobs_alone(server, client):
    ids = [300, 301, 302, 303, 304, 305]
    full = completion_tokens(client, prompt=[ids], max_tokens=1, echo=True, logprobs=1)
    alone = completion_tokens(client, prompt=[ids], max_tokens=0, echo=True, logprobs=1)
    choice = alone.choices[0]
    assert choice.text == server.tokens.decode(ids) and choice.finish_reason == "length"
    assert alone.usage.completion_tokens == 0 and alone.usage.prompt_tokens == len(ids)
    assert choice.logprobs.tokens == full.choices[0].logprobs.tokens[: len(ids)]
    assert choice.logprobs.token_logprobs == full.choices[0].logprobs.token_logprobs[: len(ids)]
    body = dict(model="tiny", prompt=[ids], max_tokens=0, echo=True, logprobs=1, stream=True)
    chunks = [json.loads(line[6:]) for line in http(server, "POST", "/v1/completions", body)[2].decode()
              .split("\n\n") if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice.text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks) == len(ids)
    status, reply = post(server, "/v1/completions", dict(model="tiny", prompt=[ids], max_tokens=0))
    assert status == 400 and reply["error"]["param"] == "max_tokens" and "echo" in reply["error"]["message"]


def test_prompt_logprobs_are_vllms_and_agree_with_the_echo(server, client):
    ids = [300, 301, 302, 303, 304, 305]
    body = dict(model="tiny", prompt=[ids], max_tokens=1, temperature=0, prompt_logprobs=2)
    status, reply = post(server, "/v1/completions", body | dict(echo=True, logprobs=1))
    assert status == 200, reply
    entries, echo = reply["choices"][0]["prompt_logprobs"], reply["choices"][0]["logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for position, entry in enumerate(entries[1:], start=1):
        token = entry[str(ids[position])]
        assert token["logprob"] == pytest.approx(echo["token_logprobs"][position], abs=1e-6)
        assert token["decoded_token"] == server.tokens.token_text(ids[position])
        ranked = sorted(entry.values(), key=lambda e: -e["logprob"])
        assert 2 <= len(entry) <= 3 and all(e["rank"] in (place + 1, None) for place, e in enumerate(ranked))
        assert len(echo["top_logprobs"][position]) <= 2  # the echo keeps its own logprobs=1
    streamed = [json.loads(line[6:]) for line in http(server, "POST", "/v1/completions", body | dict(stream=True))[2]
                .decode().split("\n\n") if line.startswith("data: {")]
    assert streamed[0]["choices"][0]["prompt_logprobs"] == entries
    status, chat = post(server, "/v1/chat/completions", dict(messages=[{"role": "user", "content": "hi"}],
                                                             max_tokens=1, prompt_logprobs=0))
    assert status == 200 and chat["choices"][0]["prompt_logprobs"][0] is None
    assert len(chat["choices"][0]["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


def test_return_tokens_as_token_ids_and_max_tokens_null(server, client):
    ids = [300, 301, 302]
    r = completion_tokens(client, prompt=[ids], max_tokens=2, logprobs=1, echo=True,
                          extra_body=dict(return_tokens_as_token_ids=True, ignore_eos=True))
    lp = r.choices[0].logprobs
    assert lp.tokens[:3] == [f"token_id:{t}" for t in ids] and all(t.startswith("token_id:") for t in lp.tokens)
    assert all(k.startswith("token_id:") for top in lp.top_logprobs[1:] for k in top)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                          logprobs=True, extra_body=dict(return_tokens_as_token_ids=True))
    assert chat.choices[0].logprobs.content[0].token.startswith("token_id:")
    # max_tokens null: each prompt's rest of the context.
    status, reply = post(server, "/v1/completions", dict(prompt=[ids, ids * 3], max_tokens=None, ignore_eos=True,
                                                         temperature=0))
    assert status == 200 and [c["finish_reason"] for c in reply["choices"]] == ["length", "length"]
    assert reply["usage"]["completion_tokens"] == (MAX_MODEL_LEN - 3) + (MAX_MODEL_LEN - 9)


def test_version_and_ping(server):
    status, _, data = http(server, "GET", "/version")
    assert status == 200 and json.loads(data)["version"]
    assert http(server, "GET", "/ping")[0] == 200 and http(server, "POST", "/ping")[0] == 200


def test_streaming_matches_non_streaming_with_continuous_usage(client):
    kw = dict(prompt="Stream me", max_tokens=12, extra_body={"ignore_eos": True})
    full = completion_tokens(client, **kw)
    chunks = list(completion_tokens(client, stream=True, **kw,
                                    stream_options={"include_usage": True, "continuous_usage_stats": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks if c.choices[0].finish_reason] == ["length"]
    running = [c.usage.completion_tokens for c in text_chunks]
    assert running == sorted(running) and running[-1] == 12  # every chunk: the usage so far
    assert all(c.usage.prompt_tokens == full.usage.prompt_tokens for c in text_chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    plain = list(completion_tokens(client, stream=True, **kw))
    assert all(c.usage is None for c in plain)


def test_usage_counts_each_prompt_once_whatever_n(client, server):
    prompts = ["a b", "cde"]
    want = sum(len(server.tokens.encode(p)) for p in prompts)
    kw = dict(prompt=prompts, n=3, max_tokens=2, temperature=1.0)
    assert completion_tokens(client, **kw).usage.prompt_tokens == want
    assert list(completion_tokens(client, stream=True, stream_options={"include_usage": True},
                                  **kw))[-1].usage.prompt_tokens == want
    chat = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=2, temperature=1.0)
    single = client.chat.completions.create(**(chat | dict(n=1))).usage.prompt_tokens
    assert client.chat.completions.create(**chat).usage.prompt_tokens == single
    streamed = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **chat))
    assert streamed[-1].usage.prompt_tokens == single


def test_n_with_a_seed_gives_distinct_reproducible_choices(client):
    """vLLM's n: choice j draws from seed + j, so the choices differ, and each equals a request of that seed."""
    kw = dict(prompt=["a", "b"], n=3, max_tokens=6, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    r = completion_tokens(client, **kw)
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert len(texts) == 6 and len(set(texts[:3])) == 3
    assert [c.text for c in sorted(completion_tokens(client, **kw).choices, key=lambda c: c.index)] == texts
    for j in range(3):
        alone = completion_tokens(client, prompt="a", max_tokens=6, temperature=1.0, seed=7 + j,
                                  extra_body={"ignore_eos": True})
        assert alone.choices[0].text == texts[j]


def greedy_text(client, prompt="abc", max_tokens=10):
    return completion_tokens(client, prompt=prompt, max_tokens=max_tokens, extra_body={"ignore_eos": True}).choices[0]


def test_stop_strings_stop_reason_and_include_stop_str_in_output(client):
    full = greedy_text(client).text
    visible = [ch for ch in full if ch != "\ufffd"]
    assert visible, f"the greedy text {full!r} has no character to stop on"
    stop = visible[len(visible) // 2]
    cut = completion_tokens(client, prompt="abc", max_tokens=10, stop=[stop], extra_body={"ignore_eos": True})
    choice = cut.choices[0]
    assert choice.finish_reason == "stop" and choice.text == full[: full.index(stop)]
    assert choice.model_extra["stop_reason"] == stop
    kept = completion_tokens(client, prompt="abc", max_tokens=10, stop=[stop],
                             extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == choice.text + stop
    streamed = list(completion_tokens(client, prompt="abc", max_tokens=10, stop=[stop], stream=True,
                                      extra_body={"ignore_eos": True, "include_stop_str_in_output": True}))
    assert "".join(c.choices[0].text for c in streamed) == choice.text + stop


def test_min_tokens_holds_stop_tokens_back_until_past_it(server, client):
    """vLLM's min_tokens: the token greedy decoding gives third, made a stop token id, ends a plain request there,
    and is not sampled among the first 4 tokens of one with min_tokens 4 (the device holds it back)."""
    tokens = server.tokens.encode("abc", add_special_tokens=False)
    plain = completion_tokens(client, prompt=tokens, max_tokens=8, logprobs=0, extra_body={"ignore_eos": True})
    third = plain.choices[0].logprobs.tokens[2]
    if third.startswith("<id:"):  # `TokenizerView.token_text`: an id past the byte tokens
        stop_id = int(third[len("<id:"):-1])
    elif third.startswith("bytes:"):
        stop_id = int(third[len("bytes:\\x"):], 16) + server.engine.tokenizer.offset
    else:
        stop_id = server.tokens.encode(third, add_special_tokens=False)[0]
    stopped = completion_tokens(client, prompt=tokens, max_tokens=8,
                                extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]})
    assert stopped.usage.completion_tokens == 3 and stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].model_extra["stop_reason"] == stop_id
    held = completion_tokens(client, prompt=tokens, max_tokens=8, logprobs=0,
                             extra_body={"ignore_eos": True, "stop_token_ids": [stop_id], "min_tokens": 4})
    assert held.usage.completion_tokens > 4 and third not in held.choices[0].logprobs.tokens[:4]
    with pytest.raises(openai.BadRequestError, match="min_tokens"):
        completion_tokens(client, prompt="abc", max_tokens=3, extra_body={"min_tokens": 4})
    with pytest.raises(openai.BadRequestError, match="holds back at most"):
        completion_tokens(client, prompt="abc", max_tokens=8, extra_body={"min_tokens": 1,
                                                                        "stop_token_ids": list(range(100, 120))})


def test_chat_defaults_to_the_rest_of_the_context_and_takes_every_role(server, client):
    messages = [{"role": "developer", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]},
                {"role": "assistant", "content": None}, {"role": "tool", "content": "4", "tool_call_id": "call-1"}]
    r = client.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                       response_format={"type": "text"}, extra_body={"ignore_eos": True})
    prompt = server.tokens.encode(apply_chat_template([
        {"role": "developer", "content": "hi"}, {"role": "assistant", "content": None},
        {"role": "tool", "content": "4"}]))
    assert r.usage.prompt_tokens == len(prompt)
    assert r.usage.completion_tokens == MAX_MODEL_LEN - len(prompt)  # vLLM: max_model_len - prompt
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "length"


def test_chat_stream_echo_and_continue_final_message(server, client):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well"}]
    kw = dict(model="tiny", messages=messages, max_tokens=5, temperature=0,
              extra_body={"ignore_eos": True, "continue_final_message": True, "add_generation_prompt": False})
    r = client.chat.completions.create(**kw)
    prompt = server.tokens.encode(apply_chat_template(messages, add_generation_prompt=False,
                                                      continue_final_message=True))
    assert r.usage.prompt_tokens == len(prompt)
    echoed = client.chat.completions.create(**(kw | {"extra_body": kw["extra_body"] | {"echo": True}}))
    assert echoed.choices[0].message.content == "Well" + r.choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_the_plain_chat_template_renders_as_its_python_twin():
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None},
                {"role": "tool", "content": "y"}]
    for kw in (dict(add_generation_prompt=True), dict(add_generation_prompt=False, continue_final_message=True)):
        assert render_chat(PLAIN_CHAT_TEMPLATE, messages, bos_token="<s>", **kw) == \
            "<s>" + apply_chat_template(messages, **kw)


# DeepSeek-V3's form, shortened: HF's environment (trim_blocks, lstrip_blocks) drops the newlines after the tags.
DEEPSEEK_LIKE = """{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}
{% set ns = namespace(system_prompt='') %}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}{% set ns.system_prompt = message['content'] %}{%- endif %}
{%- endfor %}
{{ bos_token }}{{ ns.system_prompt }}
{%- for message in messages %}
    {%- if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}
    {%- elif message['role'] == 'assistant' %}{{ '<｜Assistant｜>' + message['content'] + eos_token }}
    {%- elif message['role'] != 'system' %}{{ raise_exception('roles are system, user and assistant') }}
    {%- endif %}
{%- endfor %}
{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% if not thinking %}{{ '</think>' }}{% endif %}{% endif %}"""


@pytest.fixture(scope="module")
def templated(server, tmp_path_factory):
    """A server on the same engine with --chat-template DEEPSEEK_LIKE, --trust-request-chat-template and two
    served names."""
    srv = start_server(tmp_path_factory, engine=server.engine, chat_template=DEEPSEEK_LIKE,
                       trust_request_chat_template=True, served_model_name=["deepseek-like", "alias"])
    yield srv
    srv.stop(stop_engine=False)


def test_the_chat_template_given_is_rendered_as_hf_renders_it(templated, server):
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "yo"}, {"role": "user", "content": "again"}]
    expected = "<s>Be brief.<｜User｜>hi<｜Assistant｜>yo</s><｜User｜>again<｜Assistant｜></think>"
    tokens = post(templated, "/tokenize", {"messages": conversation})[1]["tokens"]
    assert tokens == templated.tokens.encode(expected, add_special_tokens=False)
    assert tokens[0] == server.engine.model_config.bos_token_id and tokens.count(tokens[0]) == 1  # one BOS
    thinking = post(templated, "/tokenize", {"messages": conversation, "chat_template_kwargs": {"thinking": True}})
    assert thinking[1]["tokens"] == templated.tokens.encode(expected.removesuffix("</think>"),
                                                            add_special_tokens=False)
    assert json.loads(http(templated, "GET", "/tokenizer_info")[2])["chat_template"] == DEEPSEEK_LIKE
    status, refused = post(templated, "/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]})
    assert status == 400 and "roles are system, user and assistant" in refused["error"]["message"]
    short = [{"role": "user", "content": "hi"}]  # within max_model_len (each ｜ is 3 bytes)
    status, reply = post(templated, "/v1/chat/completions", {"messages": short, "max_tokens": 2})
    assert status == 200, reply
    assert reply["usage"]["prompt_tokens"] == len(post(templated, "/tokenize", {"messages": short})[1]["tokens"])


def test_every_served_name_is_listed_and_taken_and_replies_carry_the_first(templated):
    status, _, data = http(templated, "GET", "/v1/models")
    assert [card["id"] for card in json.loads(data)["data"]] == ["deepseek-like", "alias"]
    status, reply = post(templated, "/v1/completions", {"model": "alias", "prompt": "x", "max_tokens": 1})
    assert status == 200 and reply["model"] == "deepseek-like"
    assert post(templated, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1})[0] == 404


def test_a_requests_own_chat_template_needs_the_servers_trust(templated, server):
    own = {"messages": [{"role": "user", "content": "hi"}], "chat_template": "[{{ messages[0]['content'] }}]"}
    status, refused = post(server, "/tokenize", own)
    assert status == 400 and refused["error"]["param"] == "chat_template"
    assert "--trust-request-chat-template" in refused["error"]["message"]
    assert post(templated, "/tokenize", own)[1]["tokens"] == templated.tokens.encode("[hi]", add_special_tokens=False)
    status, broken = post(templated, "/tokenize", own | {"chat_template": "{% for %}"})
    assert status == 400 and "does not compile" in broken["error"]["message"]


def test_sampling_extras_are_served(client):
    out = completion_tokens(client, prompt="hi", max_tokens=6, temperature=0.9, seed=3, presence_penalty=1.2,
                            frequency_penalty=0.4, extra_body=dict(repetition_penalty=1.3, min_p=0.05, top_k=20,
                                                                   ignore_eos=True))
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 6


# ---- refusals: what the server cannot honour is a 400 naming it ---------------------------------------------
@pytest.mark.parametrize("kw, match", [
    (dict(max_tokens=-1), "max_tokens"),
    (dict(max_tokens=10**9), "max_model_len"),
    (dict(prompt="x" * 200), "max_model_len"),
    (dict(temperature="hot"), "temperature"),
    (dict(temperature=2.5), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(n=0), "'n'"),
    (dict(n=2, temperature=0), "greedy"),
    (dict(prompt=[[]]), "prompt"),
    (dict(prompt=[1, 2, 10**6]), r"\[0, 512\)"),
    (dict(stop=[""]), "stop"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(extra_body=dict(repetition_penalty=0)), "repetition_penalty"),
    (dict(extra_body=dict(min_p=1.5)), "min_p"),
    (dict(extra_body=dict(stop_token_ids=[512])), "vocabulary"),
    (dict(logit_bias={"5": 1.0}), "logit_bias"),
    (dict(logprobs=21), "max allowed: 20"),
    (dict(extra_body=dict(guided_json={"type": "object"})), "structured output"),
    (dict(extra_body=dict(response_format={"type": "json_schema", "json_schema": {}})), "structured output"),
    (dict(extra_body=dict(use_beam_search=True)), "beam search"),
    (dict(extra_body=dict(frobnicate=1)), "unknown field 'frobnicate'"),
    (dict(stream_options={"include_usage": True}), "stream_options"),
    (dict(stop=["x" * 600]), "at most 512 characters"),
    (dict(prompt=["a"] * 100, n=2), "choices exceed"),
])
def test_bad_completions_are_400_in_openai_shape(server, client, kw, match):
    with pytest.raises(openai.BadRequestError, match=match) as info:
        client.completions.create(**(dict(model="tiny", prompt="hi", max_tokens=4) | kw))
    assert info.value.status_code == 400 and info.value.body["type"] == "invalid_request_error"
    assert server.engine.scheduler.num_waiting == 0


@pytest.mark.parametrize("kw, match", [
    (dict(top_logprobs=2), "logprobs must be set to true"),
    (dict(logprobs=True, top_logprobs=21), "max allowed: 20"),
    (dict(temperature=-0.5), "temperature"),
    (dict(tools=[{"type": "function", "function": {"name": "f"}}]), "tool calling"),
    (dict(tool_choice="auto"), "tool calling"),
    (dict(extra_body=dict(functions=[{"name": "f"}])), "tool calling"),
    (dict(response_format={"type": "json_object"}), "structured output"),
    (dict(messages=[{"role": "wizard", "content": "x"}]), "messages"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), "messages"),
    (dict(messages=[{"role": "user", "content": "x" * 80}]), "max_model_len"),
])
def test_bad_chat_requests_are_400(client, kw, match):
    args = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2) | kw
    with pytest.raises(openai.BadRequestError, match=match):
        client.chat.completions.create(**args)


# ---- the bad-input battery: raw bodies ------------------------------------------------------------------------
DEEP = b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", b'{"model": "tiny", "prompt": "\\ud800", "max_tokens": 2}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\udfffb"}], "max_tokens": 2}'),
    ("/tokenize", b'{"prompt": "\\ud800"}'),
    ("/tokenize", b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("/v1/completions", DEEP),
    ("/v1/completions", b'{"prompt": {"a": [1, {"b": [[[["x"]]]]}]}, "max_tokens": 2}'),
    ("/v1/completions", b"{not json"),
    ("/v1/completions", b"[1, 2]"),
    ("/v1/completions", b'"just a string"'),
    ("/v1/completions", b"\xff\xfe\x00"),
    ("/v1/completions", b""),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 1e999}'),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}'),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": "4"}'),
    ("/v1/completions", b'{"prompt": "hi", "n": true}'),
    ("/v1/completions", b'{"prompt": "hi", "seed": 99999999999999999999999}'),
    ("/v1/completions", b'{"prompt": "hi", "top_k": 99999999999999999999}'),
    ("/v1/completions", b'{"prompt": [1, -5], "max_tokens": 2}'),
    ("/v1/completions", b'{"prompt": "hi", "stop_token_ids": [1.5]}'),
    ("/v1/completions", b'{"prompt": "hi", "stream": true, "stream_options": 5}'),
    ("/v1/chat/completions", b'{"messages": []}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "max_tokens": 0}'),
    ("/detokenize", b'{"tokens": [-1]}'),
    ("/detokenize", b'{"tokens": [99999]}'),
    ("/tokenize", b'{"prompt": 5}'),
])
def test_bad_input_is_a_4xx_with_an_openai_body(server, path, body):
    status, headers, data = http(server, "POST", path, body)
    assert_openai_error(status, headers, data)
    assert server.engine.is_alive and server.engine.scheduler.num_waiting == 0


def test_chunked_bodies_are_read_and_truncated_ones_time_out(server):
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": 0}).encode()
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:10], body[10:])) + b"0\r\n\r\n"
    head = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nConnection: close\r\n"
    reply = raw_exchange(server, head + b"Transfer-Encoding: chunked\r\n\r\n" + chunked)
    assert reply.startswith(b"HTTP/1.1 200") and b'"completion_tokens":2' in reply
    bad = b"{not json"
    reply = raw_exchange(server, head + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(bad), bad))
    assert reply.startswith(b"HTTP/1.1 400") and b'"error"' in reply
    # Fewer bytes than Content-Length: a 408 once the body timeout (1 s here) passes, and the connection closes.
    reply = raw_exchange(server, head + b"Content-Length: %d\r\n\r\n" % len(body) + body[:-5])
    assert reply.startswith(b"HTTP/1.1 408") and b'"error"' in reply


def test_a_web_page_cannot_drive_the_server_and_framing_is_checked(server):
    """A body a page of another origin may send without a preflight (text/plain, a form) is a 415 before
    anything is read; a Content-Length over the cap is a 413 at once; Content-Length beside chunked encoding a 400;
    each closes the connection."""
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 1}).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        status, headers, data = http(server, "POST", "/v1/completions", body, headers={"Content-Type": content_type})
        assert status == 415 and headers.get("connection") == "close", (content_type, data)
    assert http(server, "POST", "/v1/completions", body, headers={"Content-Type": "application/json; charset=utf-8"}
                )[0] == 200
    head = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
    reply = raw_exchange(server, head + b"Content-Length: %d\r\n\r\n" % (64 << 20))  # no body follows
    assert reply.startswith(b"HTTP/1.1 413") and b"connection: close" in reply.lower()
    both = head + b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (
        len(body), len(body), body)
    reply = raw_exchange(server, both)
    assert reply.startswith(b"HTTP/1.1 400") and b"connection: close" in reply.lower(), reply[:200]


def test_head_options_and_routes_are_json(server):
    status, headers, data = http(server, "HEAD", "/health")
    assert status == 200 and data == b""
    preflight = {"Origin": "http://example.com", "Access-Control-Request-Method": "POST"}
    status, headers, _ = http(server, "OPTIONS", "/v1/completions", headers=preflight)
    assert status == 400 and "access-control-allow-origin" not in headers  # no CORS origin by default
    status, headers, _ = http(server, "OPTIONS", "/v1/completions", headers=preflight | {"Origin": "http://ok"})
    assert status == 200 and headers["access-control-allow-origin"] == "http://ok"  # --allowed-origins
    assert_openai_error(*http(server, "OPTIONS", "/v1/completions"))  # no preflight: a 405 in JSON
    error = assert_openai_error(*http(server, "GET", "/nope"))
    assert error["type"] == "NotFoundError"
    assert http(server, "GET", "/v1/completions")[0] == 405
    assert http(server, "GET", "/health")[0] == 200


def test_text_offsets_index_the_returned_text_streamed_or_not(server, client):
    kw = dict(prompt="Hi there", max_tokens=8, echo=True, logprobs=0, extra_body={"ignore_eos": True})
    r = completion_tokens(client, **kw).choices[0]
    text, lp = r.text, r.logprobs
    ids = server.tokens.encode("Hi there")
    assert text.startswith("Hi there") and lp.tokens[0] == "<s>"
    assert lp.text_offset[: len(ids) + 1] == [0, 0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(text)
    chunks = list(completion_tokens(client, stream=True, **kw))
    assert [o for c in chunks for o in c.choices[0].logprobs.text_offset] == lp.text_offset
    assert "".join(c.choices[0].text for c in chunks) == text


def test_a_bug_while_streaming_ends_the_stream_and_aborts(server, monkeypatch):
    """After the 200 header an exception must not write a JSON error into the event stream: the stream ends
    (no [DONE]) and the request is aborted."""
    from dcp_jax.serving import openai_api

    real, calls = openai_api._Completions._chunk, []

    def buggy(self, event):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected chunk bug")
        return real(self, event)

    monkeypatch.setattr(openai_api._Completions, "_chunk", buggy)
    metrics = server.engine.metrics
    aborted = metrics.requests_finished("abort")
    status, _, data = http(server, "POST", "/v1/completions", {
        "model": "tiny", "prompt": [[5, 6, 7]], "max_tokens": 50, "temperature": 0, "stream": True,
        "ignore_eos": True})
    lines = [line for line in data.decode().splitlines() if line]
    assert status == 200 and len(lines) == 1 and lines[0].startswith("data: ") and "choices" in lines[0]
    assert wait_until(lambda: metrics.requests_finished("abort") == aborted + 1)


def test_a_stopped_engine_is_a_503_not_a_hang(server, client):
    engine = server.engine
    engine.stop()
    try:
        assert http(server, "GET", "/health")[0] == 503
        error = assert_openai_error(*http(server, "POST", "/v1/completions",
                                          {"model": "tiny", "prompt": "hi", "max_tokens": 2}),
                                    status_range=(503, 504))
        assert "not running" in error["message"]
        with pytest.raises(openai.InternalServerError):
            list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                max_tokens=2, stream=True))
    finally:
        engine.start()
    assert http(server, "GET", "/health")[0] == 200


def test_a_duplicate_request_id_is_refused_and_the_live_request_runs_on(server, client):
    """The second request of a live id gets a 400; the first (streaming) is neither aborted nor unrouted: it
    generates every token it was asked for."""
    request = dict(model="tiny", prompt="duplicate", max_tokens=40, temperature=0)
    stream = client.completions.create(stream=True, extra_body=dict(request_id="dup-1", ignore_eos=True), **request)
    first = next(iter(stream))  # the first request is live
    status, refused = post(server, "/v1/completions", request | dict(request_id="dup-1", ignore_eos=True))
    assert status == 400 and "duplicate" in refused["error"]["message"] and refused["error"]["param"] == "request_id"
    chunks = [first, *stream]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert sum(len(c.choices[0].text) > 0 for c in chunks if c.choices) >= 1
    completion = completion_tokens(client, prompt="duplicate", max_tokens=40, extra_body=dict(ignore_eos=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == completion.choices[0].text


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=2)


def test_tokenizer_endpoints(server):
    status, _, data = http(server, "GET", "/tokenizer_info")
    info = json.loads(data)
    assert status == 200 and info["eos_token"] == "</s>" and info["bos_token"] == "<s>" and info["chat_template"]
    status, body = post(server, "/tokenize", {"prompt": "hi</s>", "add_special_tokens": False,
                                              "return_token_strs": True})
    assert body["tokens"][-1] == server.engine.model_config.eos_token_id and len(body["tokens"]) == 3
    assert body["token_strs"] == ["h", "i", "</s>"] and body["max_model_len"] == MAX_MODEL_LEN
    assert post(server, "/tokenize", {"prompt": "hi"})[1]["tokens"][0] == server.engine.model_config.bos_token_id
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})[1]["tokens"]
    assert chat == server.tokens.encode(apply_chat_template([{"role": "user", "content": "hi"}]))
    assert post(server, "/detokenize", {"tokens": body["tokens"][:2]})[1]["prompt"] == "hi"


# ---- connections ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tight(server, tmp_path_factory):
    """A second server on the same engine: a 3 s keep-alive, at most 4 connections, an API key."""
    srv = start_server(tmp_path_factory, engine=server.engine, timeout_keep_alive=3.0, limit_concurrency=4,
                       api_key="sekret")
    yield srv
    srv.stop(stop_engine=False)


def test_idle_connections_are_closed_after_the_keep_alive_timeout(tight):
    with socket.create_connection((tight.host, tight.port), timeout=30) as silent, \
            socket.create_connection((tight.host, tight.port), timeout=30) as partial:
        partial.sendall(b"GET /health HTTP/1.1\r\n")  # a request head that never ends
        assert silent.recv(1) == b"" and partial.recv(1) == b""  # closed, long before the 30 s guard
    with socket.create_connection((tight.host, tight.port), timeout=30) as kept:
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.endswith(b"}"):
            reply += kept.recv(4096)
        assert reply.startswith(b"HTTP/1.1 200")
        assert kept.recv(1) == b""  # kept alive, then closed when idle


def test_connections_past_the_limit_get_a_503_and_the_server_goes_on(tight):
    held = [socket.create_connection((tight.host, tight.port), timeout=30) for _ in range(4)]
    try:
        assert wait_until(lambda: http(tight, "GET", "/health")[0] == 503)
    finally:
        for sock in held:
            sock.close()
    assert wait_until(lambda: http(tight, "GET", "/health")[0] == 200)


def test_api_key_guards_v1(tight):
    with openai.OpenAI(base_url=f"{tight.url}/v1", api_key="wrong", max_retries=0) as bad, \
            pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with openai.OpenAI(base_url=f"{tight.url}/v1", api_key="sekret", max_retries=0) as good:
        assert [m.id for m in good.models.list()] == ["tiny"]
    assert http(tight, "GET", "/health")[0] == 200  # outside /v1: no key


def test_health_is_503_while_the_engine_loads_then_200(server):
    """The socket answers before the engine exists: /health and the routes are 503 until `load` returns; then
    the server serves it. (serve_forever stops the engine at its end: it is started again for the tests after.)"""
    from dcp_jax.serving.server import OpenAIServer

    release = threading.Event()

    def load():
        assert release.wait(60)
        return server.engine

    loading = OpenAIServer(port=0, uvicorn_log_level="warning", access_log=False)
    thread = threading.Thread(target=loading.serve_forever, args=(load,))
    thread.start()
    try:
        status, _, body = http(loading, "GET", "/health")
        assert status == 503 and json.loads(body) == {"status": "starting"}
        assert_openai_error(*http(loading, "POST", "/v1/completions", {"model": "tiny", "prompt": "hi"}),
                            status_range=(503, 504))
        release.set()
        assert wait_until(lambda: http(loading, "GET", "/health")[0] == 200)
        status, body = post(loading, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 200 and body["usage"]["completion_tokens"] == 2
    finally:
        release.set()
        loading.stop(stop_engine=False)
        thread.join(60)
        server.engine.start()
    assert not thread.is_alive() and http(server, "GET", "/health")[0] == 200


def test_no_recompiles_and_no_leaked_pages(server):
    engine = server.engine
    assert engine.compiles_after_warmup == 0
    assert wait_until(lambda: engine.num_free_pages == engine.num_pages)
