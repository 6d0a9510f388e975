"""The OpenAI-compatible server (dcp_jax/server.py, protocol.py) through the real `openai` client, on loopback."""

import http.client
import json
import math
import urllib.error
import urllib.request

import openai
import pytest

from dcp_jax.serving import protocol
from tests.serving.serving_utils import start_server, wait_until


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0, timeout=60)


def raw(server, path, body=None, *, method=None, headers=None):
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data, method=method or ("POST" if data else "GET"),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert raw(server, "/health") == (200, json.dumps({"status": "ok"}))
    status, text = raw(server, "/metrics")
    assert status == 200
    for name in ("time_to_first_token_seconds_bucket", "time_per_output_token_seconds_count",
                 "generation_tokens_per_second", "running_requests", "waiting_requests", "kv_pages_used",
                 "kv_pages_free", "compiles_total", "compiles_after_warmup_total"):
        assert f"dcp_jax_{name}" in text, name


def test_string_prompt_gets_bos_token_id_prompt_does_not(server, client):
    text = "Hello"
    ids = server.tokens.encode(text)
    assert ids[0] == server.engine.model_config.bos_token_id
    r = client.completions.create(model="tiny", prompt=text, max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 4
    r2 = client.completions.create(model="tiny", prompt=ids[1:], max_tokens=4, temperature=0)
    assert r2.usage.prompt_tokens == len(ids) - 1  # used as given: no BOS prepended
    r3 = client.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0)
    assert r3.choices[0].text == r.choices[0].text  # the same ids as the string prompt, the same greedy text


def test_echo_logprobs_cover_the_whole_prompt(server, client):
    ids = [300, 301, 302, 303, 304, 305]
    r = client.completions.create(model="tiny", prompt=[ids], max_tokens=1, temperature=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x < 0 and math.isfinite(x) for x in lp.token_logprobs[1:])
    assert lp.tokens[: len(ids)] == [server.tokens.token_text(t) for t in ids]
    for value, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert value in top.values() and max(top.values()) >= value  # the token plus the best one
    # The generated token's logprob equals the echoed logprob of the same token one request later:
    # the all-positions prefill agrees with the last-position prefill.
    nxt = client.completions.create(model="tiny", prompt=[ids], max_tokens=1, temperature=0, logprobs=0)
    token = nxt.choices[0].logprobs.tokens[0]
    assert lp.tokens[-1] == token
    assert lp.token_logprobs[-1] == pytest.approx(nxt.choices[0].logprobs.token_logprobs[0], abs=1e-5)
    # The greedy token is the top-1 of the last position.
    assert lp.token_logprobs[-1] == pytest.approx(max(lp.top_logprobs[-1].values()), abs=1e-9)
    assert r.choices[0].text.startswith(server.tokens.decode(ids))


def test_streaming_matches_non_streaming(client):
    kw = dict(model="tiny", prompt="Stream me", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].usage.completion_tokens == 12


def test_usage_counts_each_prompt_once_whatever_n(client, server):
    """vLLM's usage: the prompts' tokens once (not once per choice), streamed or not, completions and chat."""
    prompts = ["a b", "cde"]
    want = sum(len(server.tokens.encode(p)) for p in prompts)
    kw = dict(model="tiny", prompt=prompts, n=3, max_tokens=2, temperature=1.0)
    assert client.completions.create(**kw).usage.prompt_tokens == want
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].usage.prompt_tokens == want
    chat = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=2, temperature=1.0)
    single = client.chat.completions.create(**(chat | dict(n=1))).usage.prompt_tokens
    assert client.chat.completions.create(**chat).usage.prompt_tokens == single
    streamed = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **chat))
    assert streamed[-1].usage.prompt_tokens == single


def test_n_list_of_prompts_seed_and_stop(client):
    r = client.completions.create(model="tiny", prompt=["a", "b"], n=2, max_tokens=5, temperature=1.0, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3] and r.usage.completion_tokens <= 20
    again = client.completions.create(model="tiny", prompt=["a", "b"], n=2, max_tokens=5, temperature=1.0, seed=7)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == \
        [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    greedy = client.completions.create(model="tiny", prompt="abc", max_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
    # The stop string is a character the greedy run actually generated (the seeded model is deterministic).
    visible = [ch for ch in greedy if ch != "\ufffd"]
    assert visible, f"the greedy text {greedy!r} has no character to stop on"
    stop = visible[len(visible) // 2]
    cut = client.completions.create(model="tiny", prompt="abc", max_tokens=10, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == greedy[: greedy.index(stop)]


def test_chat_completion_and_stream(server, client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens == 6
    prompt = server.tokens.encode(protocol.apply_chat_template(messages))
    assert r.usage.prompt_tokens == len(prompt)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_template_jinja_matches_python():
    jinja2 = pytest.importorskip("jinja2")
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    rendered = jinja2.Template(protocol.CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True)
    assert rendered == protocol.apply_chat_template(messages)


def test_penalties_and_min_p_are_served(client):
    """vLLM's sampling extras reach the device sampler (400s above for values out of range)."""
    out = client.completions.create(model="tiny", prompt="hi", max_tokens=6, temperature=0.9, seed=3,
                                    presence_penalty=1.2, frequency_penalty=0.4,
                                    extra_body=dict(repetition_penalty=1.3, min_p=0.05, ignore_eos=True))
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 6


@pytest.mark.parametrize("kw, match", [
    (dict(max_tokens=-1), "max_tokens"),
    (dict(max_tokens=10**9), "max_model_len"),
    (dict(prompt="x" * 200), "max_model_len"),
    (dict(temperature="hot"), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(n=0), "'n'"),
    (dict(prompt=[[]]), "prompt"),
    (dict(prompt=[1, 2, 10**6]), r"\[0, 512\)"),
    (dict(stop=[""]), "stop"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(extra_body=dict(repetition_penalty=0)), "repetition_penalty"),
    (dict(extra_body=dict(min_p=1.5)), "min_p"),
    (dict(logit_bias={"5": 1.0}), "not supported"),
    (dict(logprobs=99), "logprobs"),
])
def test_bad_requests_are_400_in_openai_shape(server, client, kw, match):
    args = dict(model="tiny", prompt="hi", max_tokens=4) | kw
    with pytest.raises(openai.BadRequestError, match=match) as info:
        client.completions.create(**args)
    assert info.value.status_code == 400 and info.value.body["type"] == "invalid_request_error"
    assert server.engine.scheduler.num_waiting == 0


@pytest.mark.parametrize("field, value", [
    ("stream_options", 5),
    ("stream_options", {"include_usage": "yes"}),
    ("stop_token_ids", "7"),
    ("stop_token_ids", [1.5]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [True]),
])
def test_wrong_types_in_stream_options_and_stop_token_ids_are_400(server, field, value):
    status, body = raw(server, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2, "stream": True,
                                                   field: value})
    error = json.loads(body)["error"]
    assert status == 400 and error["param"] == field and error["type"] == "invalid_request_error"


def test_text_offsets_index_the_returned_text_streamed_or_not(server, client):
    """Echoed string prompt: BOS has no text (offset 0, as "H"); every offset indexes the returned text, and a
    stream carries them on across chunks (the same values as the whole reply)."""
    kw = dict(model="tiny", prompt="Hi there", max_tokens=8, temperature=0, echo=True, logprobs=0,
              extra_body={"ignore_eos": True})
    r = client.completions.create(**kw).choices[0]
    text, lp = r.text, r.logprobs
    ids = server.tokens.encode("Hi there")
    assert text.startswith("Hi there") and lp.tokens[0] == "<s>"
    assert lp.text_offset[: len(ids) + 1] == [0, 0, 1, 2, 3, 4, 5, 6, 7, 8]  # BOS, "Hi there", the first token
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(text)
    for token, offset in zip(lp.tokens, lp.text_offset):
        if len(token) == 1:  # one character of text: it is right there
            assert text[offset] == token
    chunks = list(client.completions.create(stream=True, **kw))
    assert [o for c in chunks for o in c.choices[0].logprobs.text_offset] == lp.text_offset
    assert "".join(c.choices[0].text for c in chunks) == text


def test_a_bug_while_streaming_ends_the_stream_and_aborts(server, monkeypatch):
    """After the 200 header an exception must not write a JSON error into the event stream: the stream ends
    (no [DONE]) and the request is aborted."""
    from dcp_jax.serving import server as server_module

    real, calls = server_module._Handler._completion_chunk, []

    def buggy(self, *args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected chunk bug")
        return real(self, *args)

    monkeypatch.setattr(server_module._Handler, "_completion_chunk", buggy)
    engine = server.engine
    aborted = engine.metrics.finished["abort"]
    host, port = server.httpd.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=30)
    body = {"model": "tiny", "prompt": [[5, 6, 7]], "max_tokens": 50, "temperature": 0, "stream": True,
            "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    lines = [line for line in resp.read().decode().splitlines() if line]
    conn.close()
    assert len(lines) == 1 and lines[0].startswith("data: ") and "choices" in lines[0]
    assert not any("error" in line or "[DONE]" in line for line in lines)
    assert wait_until(lambda: engine.metrics.finished["abort"] == aborted + 1)


def test_a_stopped_engine_is_a_503_not_a_hang(server, client):
    engine = server.engine
    engine.stop()
    try:
        assert raw(server, "/health")[0] == 503
        status, body = raw(server, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert status == 503 and "not running" in json.loads(body)["error"]["message"]
        with pytest.raises(openai.InternalServerError):
            list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                max_tokens=2, stream=True))
    finally:
        engine.start()
    assert raw(server, "/health")[0] == 200


def test_bad_json_unknown_model_and_routes(server, client):
    status, body = raw(server, "/v1/completions", b"{not json")
    assert status == 400 and "JSON" in json.loads(body)["error"]["message"]
    status, body = raw(server, "/v1/completions", b"[1, 2]")
    assert status == 400
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": "x"}], max_tokens=2)
    assert raw(server, "/nope")[0] == 404
    assert raw(server, "/v1/completions", method="GET")[0] == 405


def test_tokenizer_endpoints(server):
    status, body = raw(server, "/tokenizer_info")
    info = json.loads(body)
    assert status == 200 and info["eos_token"] == "</s>" and info["bos_token"] == "<s>" and info["chat_template"]
    status, body = raw(server, "/tokenize", {"prompt": "hi</s>", "add_special_tokens": False})
    tokens = json.loads(body)["tokens"]
    assert tokens[-1] == server.engine.model_config.eos_token_id and len(tokens) == 3
    with_bos = json.loads(raw(server, "/tokenize", {"prompt": "hi"})[1])["tokens"]
    assert with_bos[0] == server.engine.model_config.bos_token_id
    status, body = raw(server, "/detokenize", {"tokens": tokens[:2]})
    assert json.loads(body)["prompt"] == "hi"
    assert raw(server, "/detokenize", {"tokens": [-1]})[0] == 400


def test_api_key_guards_v1(server, tmp_path_factory):
    from dcp_jax.serving.server import OpenAIServer

    guarded = OpenAIServer(server.engine, port=0, api_key="sekret").start()
    try:
        bad = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="sekret", max_retries=0)
        assert [m.id for m in good.models.list()] == ["tiny"]
        assert raw(guarded, "/health")[0] == 200
    finally:
        guarded.stop(stop_engine=False)


def test_no_recompiles_and_no_leaked_pages(server):
    engine = server.engine
    assert engine.compiles_after_warmup == 0
    assert engine.num_free_pages == engine.num_pages
