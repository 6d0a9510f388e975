"""lm-eval's `local-completions` and `local-chat-completions --apply_chat_template` clients against the server on
loopback, on offline local tasks (tests/serving/lm_eval_tasks): one loglikelihood (multiple choice: token-id prompts,
echo + logprobs, remote tokenizer endpoints), one generate_until (stop sequences), the latter through chat too."""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from tests.serving.serving_utils import start_server

pytest.importorskip("lm_eval")
REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory)
    yield srv
    srv.stop()


def run_lm_eval(tmp_path, model: str, model_args: str, tasks: str, *extra: str) -> None:
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_HOME=str(tmp_path / "hf"), TOKENIZERS_PARALLELISM="false")
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", model, "--model_args", model_args, "--tasks", tasks,
           "--include_path", str(REPO / "tests/serving/lm_eval_tasks"), "--output_path", str(tmp_path / "out"),
           "--log_samples", *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def test_lm_eval_local_completions(server, tmp_path):
    # From the max_model_len /v1/models serves, less lm-eval's one extra context token and the generated one.
    max_length = server.engine.engine_config.max_model_len - 2
    run_lm_eval(tmp_path, "local-completions",
                f"model=tiny,base_url={server.url}/v1/completions,num_concurrent=4,max_retries=1,"
                f"tokenizer_backend=remote,tokenized_requests=True,max_length={max_length},timeout=60",
                "dcp_tiny_loglikelihood,dcp_tiny_generate")
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())["results"]
    acc = results["dcp_tiny_loglikelihood"]["acc,none"]
    assert 0.0 <= acc <= 1.0
    assert "exact_match,remove_whitespace" in results["dcp_tiny_generate"] or \
        any(k.startswith("exact_match") for k in results["dcp_tiny_generate"])
    # Every multiple-choice sample got a finite loglikelihood for each choice from the server's echoed logprobs.
    samples_file = next((tmp_path / "out").rglob("samples_dcp_tiny_loglikelihood_*.jsonl"))
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    assert len(samples) == 4
    for sample in samples:
        assert len(sample["resps"]) == len(sample["doc"]["choices"])
        for (loglikelihood, _is_greedy), in sample["resps"]:  # one [loglikelihood, is_greedy] per choice
            assert math.isfinite(float(loglikelihood)) and float(loglikelihood) < 0
    gen_file = next((tmp_path / "out").rglob("samples_dcp_tiny_generate_*.jsonl"))
    gens = [json.loads(line) for line in gen_file.read_text().splitlines()]
    assert len(gens) == 3 and all("\n" not in str(g["filtered_resps"]) for g in gens)
    assert server.engine.num_free_pages == server.engine.num_pages


def test_lm_eval_local_chat_completions_with_the_chat_template(server, tmp_path):
    run_lm_eval(tmp_path, "local-chat-completions",
                f"model=tiny,base_url={server.url}/v1/chat/completions,num_concurrent=2,max_retries=1,timeout=60",
                "dcp_tiny_generate", "--apply_chat_template")
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())["results"]
    assert any(k.startswith("exact_match") for k in results["dcp_tiny_generate"])
    gens = [json.loads(line) for line in next((tmp_path / "out").rglob("samples_dcp_tiny_generate_*.jsonl"))
            .read_text().splitlines()]
    assert len(gens) == 3 and all("\n" not in str(g["filtered_resps"]) for g in gens)
    assert server.engine.num_free_pages == server.engine.num_pages


def test_eval_retrieval_targets_a_running_server(server, tmp_path):
    """scripts/eval_retrieval.py --base-url: lm-eval's two clients against the server already running, its
    served model read from /v1/models; every page back in the pool."""
    from scripts.eval_retrieval import main

    assert main(["--model", "tiny", "--base-url", server.url, "--out", str(tmp_path), "--contexts", "64",
                 "--examples", "2", "--max-num-seqs", "2"]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    per_client = results["configs"]["server"]
    assert set(per_client) == {"completions", "chat"}
    assert all(len(per_client[client]["64"]["answers"]) == 2 for client in per_client)
    assert server.engine.num_free_pages == server.engine.num_pages
