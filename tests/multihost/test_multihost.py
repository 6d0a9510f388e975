"""Multi-host serving on jax.distributed (`runtime/multihost.py`, issue 29), as several processes on 127.0.0.1 with
CPU devices each (gloo collectives): greedy output identical to one process with the same devices; a process killed
mid-generation ends the others with a clear error within a bounded time, leaving no process behind."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from dcp_jax.host.sampling import SamplingParams
from dcp_jax.serving.llm import LLM
from tests.child_env import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = [[5, 6, 7, 8, 9], list(range(3, 23))]  # 5 and 20 tokens: below and past index_topk 16
BOUND_S = 240  # a deployment's whole run, or its end after a fault


def free_port_pair() -> int:
    """A port p with p and p + 1 free (the coordinator's and the step channel's)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free pair of ports")


def start(num_processes: int, dcp: int, max_tokens: int = 8, max_model_len: int = 64) -> list[subprocess.Popen]:
    port = free_port_pair()
    env = child_env()  # each process: dcp / num_processes devices
    return [subprocess.Popen(
        [sys.executable, "-m", "tests.multihost.worker", "--coordinator-address", f"127.0.0.1:{port}",
         "--num-processes", str(num_processes), "--process-id", str(i), "--dcp", str(dcp), "--max-tokens",
         str(max_tokens), "--max-model-len", str(max_model_len), "--prompts", json.dumps(PROMPTS)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(num_processes)]


def finish(processes, timeout: float = BOUND_S) -> list[tuple[int, str, str]]:
    """Each process's (return code, stdout, stderr), killing every one left after `timeout` (then failing)."""
    deadline = time.monotonic() + timeout
    results = []
    try:
        for p in processes:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append((p.returncode, out, err))
    except subprocess.TimeoutExpired:
        pytest.fail(f"a process still ran after {timeout} s")
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def single_process_greedy(dcp: int, max_tokens: int = 8):
    """The completions of PROMPTS by one process of dcp devices."""
    llm = LLM("tiny", dcp=dcp, max_model_len=64, max_num_seqs=4, page_size=4, dtype="float32", kernels="reference")
    outputs = llm.generate(prompt_token_ids=PROMPTS,
                           sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return [out.outputs[0] for out in outputs]


# Slow: the server test below checks one process's output on two at DCP 2.
@pytest.mark.slow
@pytest.mark.parametrize("num_processes, dcp", [(2, 4), (2, 2), (4, 8)])
def test_greedy_output_of_a_deployment_is_one_process(num_processes, dcp):
    results = finish(start(num_processes, dcp))
    for rc, out, err in results:
        assert rc == 0, err[-3000:]
    expected = [c.token_ids for c in single_process_greedy(dcp)]
    for _, out, _ in results:  # every process returns the leader's outputs
        assert json.loads(out.strip().splitlines()[-1]) == expected


# A killed follower's stream is the server test's; killing one under `LLM` repeats it (slow).
@pytest.mark.parametrize("killed", [pytest.param(1, marks=pytest.mark.slow), 0], ids=["follower", "leader"])
def test_a_killed_process_ends_the_others_with_an_error(killed):
    processes = start(2, 2, max_tokens=200, max_model_len=256)
    ready = time.monotonic() + BOUND_S
    for p in processes:  # both loaded and connected
        while time.monotonic() < ready and p.stdout.readline().strip() != "ready":
            pass
    time.sleep(2)  # mid-generation
    processes[killed].send_signal(signal.SIGKILL)
    started = time.monotonic()
    results = finish(processes, timeout=120)
    survivor = results[1 - killed]
    assert survivor[0] != 0 and time.monotonic() - started < 120
    # The channel's error (the peer's connection closed), or jax.distributed's when its service saw the death first.
    assert "is gone" in survivor[2] or "another task died" in survivor[2], survivor[2][-3000:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serving(num_processes: int, dcp: int) -> tuple[list[subprocess.Popen], int]:
    """`dcp-jax serve` as a deployment; returns the processes and process 0's HTTP port once it is ready."""
    port, http_port = free_port_pair(), free_port()
    env = child_env()
    common = ["--model", "tiny", "--dcp", str(dcp), "--max-model-len", "128", "--max-num-seqs", "4", "--page-size",
              "4", "--dtype", "float32", "--kernels", "reference", "--no-prompt-logprobs", "--buckets", "4",
              "--max-num-batched-tokens", "16", "--coordinator-address", f"127.0.0.1:{port}", "--num-processes",
              str(num_processes)]
    processes = [subprocess.Popen(
        [sys.executable, "-m", "dcp_jax.cli", "serve", *common, "--process-id", str(i), "--port", str(http_port)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(num_processes)]
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        line = processes[0].stdout.readline()
        if "dcp-jax serve: ready" in line:
            return processes, http_port
        if not line:
            break
    finish(processes, timeout=5)
    pytest.fail("process 0 never served")


def test_process_0_serves_the_openai_client_and_a_killed_follower_fails_the_stream():
    """The deployment answers the real `openai` client with one process's greedy output; a follower killed while a
    completion streams ends that stream with an error (not a silent truncation) and process 0 exits, within
    bounds."""
    import openai

    processes, http_port = start_serving(2, 2)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="EMPTY", max_retries=0,
                               timeout=BOUND_S)
        expected = single_process_greedy(2)
        for prompt, completion in zip(PROMPTS, expected):
            reply = client.completions.create(model="tiny", prompt=[prompt], max_tokens=8, temperature=0,
                                              extra_body={"ignore_eos": True})
            assert reply.choices[0].text == completion.text and reply.usage.completion_tokens == 8
        stream = client.completions.create(model="tiny", prompt=[PROMPTS[1]], max_tokens=100, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        started = time.monotonic()
        with pytest.raises(openai.APIError, match="is gone"):
            for i, _ in enumerate(stream):
                if i == 2:
                    processes[1].send_signal(signal.SIGKILL)
        assert time.monotonic() - started < 60
        assert finish(processes, timeout=60)[0][0] != 0  # process 0 exits with an error
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()


def test_a_follower_whose_leader_died_exits_1_with_the_error():
    """`dcp-jax serve` process 1 after process 0 is killed: exit status 1 and the error on stderr, not an abort
    (jax.distributed's client aborts the process once it polls the dead service's error)."""
    processes, _ = start_serving(2, 2)
    ready = time.monotonic() + BOUND_S
    while time.monotonic() < ready and "following process 0" not in processes[1].stdout.readline():
        pass
    processes[0].send_signal(signal.SIGKILL)
    results = finish(processes, timeout=60)
    assert results[1][0] == 1 and "is gone" in results[1][2], (results[1][0], results[1][2][-2000:])


@pytest.mark.slow
def test_sigterm_to_process_0_drains_and_every_process_exits_0():
    processes, _ = start_serving(2, 2)
    processes[0].send_signal(signal.SIGTERM)
    results = finish(processes, timeout=120)
    assert [rc for rc, _, _ in results] == [0, 0], [err[-2000:] for _, _, err in results]
    assert "process 0 stopped" in results[1][1]
