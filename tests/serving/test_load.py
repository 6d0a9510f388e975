"""Load and fault tests of the server on loopback (bounded: a fixed number of requests, each a few tokens):
256 concurrent streaming clients, page accounting, no recompiles, disconnects, batch-invariant greedy results."""

import asyncio
import http.client
import json
import random
import time

import openai
import pytest

from tests.serving.serving_utils import start_server, wait_until

CLIENTS = 256


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory)
    yield srv
    srv.stop()


def wait_idle(engine):
    return wait_until(lambda: engine.num_free_pages == engine.num_pages and not engine.scheduler.has_work)


async def stream_one(client, prompt, max_tokens, temperature):
    stream = await client.completions.create(
        model="tiny", prompt=[prompt], max_tokens=max_tokens, temperature=temperature, seed=1, stream=True,
        logprobs=0, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    tokens, usage, finish = [], None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            tokens += choice.logprobs.tokens if choice.logprobs else []
            finish = choice.finish_reason or finish
    return tokens, usage, finish


def test_concurrent_streams_pages_recompiles_and_batch_invariance(server):
    engine = server.engine
    rnd = random.Random(0)
    prompts = [[rnd.randrange(3, 512) for _ in range(rnd.randint(2, 20))] for _ in range(CLIENTS)]
    lengths = [rnd.randint(4, 24) for _ in range(CLIENTS)]
    greedy = list(range(0, CLIENTS, 32))  # these run greedy, alone first, then inside the full load

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0, timeout=120)
        alone = {i: await stream_one(client, prompts[i], lengths[i], 0.0) for i in greedy}
        loaded = await asyncio.gather(*[stream_one(client, prompts[i], lengths[i], 0.0 if i in greedy else 0.8)
                                        for i in range(CLIENTS)])
        await client.close()
        return alone, loaded

    preempted_before = engine.metrics.preemptions
    alone, loaded = asyncio.run(main())
    for i, (tokens, usage, finish) in enumerate(loaded):
        assert finish == "length" and usage.completion_tokens == lengths[i] == len(tokens), i
        assert usage.prompt_tokens == len(prompts[i])
    for i in greedy:
        assert loaded[i][0] == alone[i][0], f"greedy request {i} differs alone vs in a full batch"
    # 24 pages of 8 tokens cannot hold 8 sequences of up to 44 tokens: the pool ran dry and requests were
    # preempted and recomputed, yet every one finished with its exact length.
    assert engine.metrics.preemptions > preempted_before
    assert wait_idle(engine)
    assert engine.scheduler.allocator.num_used == 0
    assert engine.compiles_after_warmup == 0


def slow_decode_and_record_aborts(engine, monkeypatch, delay_s=0.02):
    """Slow each decode step (so a request of 60 tokens outlives its client) and record, per aborted request,
    how many tokens it had generated."""
    real_decode, real_abort, aborted = engine.runner.dispatch, engine.scheduler.abort, {}

    def slow(*args, **kwargs):
        time.sleep(delay_s)
        return real_decode(*args, **kwargs)

    def abort(request_id):
        request = real_abort(request_id)
        if request is not None:
            aborted[request_id] = len(request.output_ids)
        return request

    monkeypatch.setattr(engine.runner, "dispatch", slow)
    monkeypatch.setattr(engine.scheduler, "abort", abort)
    return aborted


def test_client_disconnect_mid_stream_frees_pages(server, monkeypatch):
    engine = server.engine
    aborted = slow_decode_and_record_aborts(engine, monkeypatch)
    host, port = server.host, server.port
    conns = []
    for k in range(4):
        conn = http.client.HTTPConnection(host, port, timeout=30)
        body = {"model": "tiny", "prompt": [[5 + k, 6, 7]], "max_tokens": 60, "temperature": 0, "stream": True,
                "ignore_eos": True}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.readline().startswith(b"data: ")  # the first chunk arrived: the request is running
        conns.append((conn, resp))
    assert engine.scheduler.allocator.num_used > 0
    for conn, resp in conns:
        resp.close()
        conn.close()
    assert wait_idle(engine), "disconnected requests kept their pages"
    # Every one of the 4 was aborted, long before its 60 tokens.
    assert len(aborted) == 4 and all(n < 30 for n in aborted.values()), aborted
    assert engine.compiles_after_warmup == 0


def test_client_disconnect_while_waiting_for_a_whole_reply_aborts(server, monkeypatch):
    """A non-streaming client that goes away is noticed while its request still runs (the server polls the
    socket), so the request is aborted instead of generating all its tokens for nobody."""
    engine = server.engine
    aborted = slow_decode_and_record_aborts(engine, monkeypatch)
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    body = {"model": "tiny", "prompt": [[9, 8, 7]], "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    assert wait_until(lambda: engine.scheduler.running), "the request never started"
    conn.close()
    assert wait_idle(engine), "the disconnected request kept its pages"
    assert len(aborted) == 1 and all(n < 40 for n in aborted.values()), aborted
