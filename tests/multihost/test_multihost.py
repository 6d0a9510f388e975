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
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # each process: dcp / num_processes devices
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
    llm = LLM("tiny", dcp=dcp, max_model_len=64, max_num_seqs=4, page_size=4, dtype="float32", kernels="reference")
    outputs = llm.generate(prompt_token_ids=PROMPTS,
                           sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return [out.outputs[0].token_ids for out in outputs]


@pytest.mark.parametrize("num_processes, dcp", [(2, 4), pytest.param(2, 2, marks=pytest.mark.slow),
                                                pytest.param(4, 8, marks=pytest.mark.slow)])
def test_greedy_output_of_a_deployment_is_one_process(num_processes, dcp):
    results = finish(start(num_processes, dcp))
    for rc, out, err in results:
        assert rc == 0, err[-3000:]
    expected = single_process_greedy(dcp)
    for _, out, _ in results:  # every process returns the leader's outputs
        assert json.loads(out.strip().splitlines()[-1]) == expected


@pytest.mark.parametrize("killed", [1, 0], ids=["follower", "leader"])
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
