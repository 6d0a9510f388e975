"""The seed's deployment line on a tiny GLM checkpoint: ATOM's `-tp 4 -dcp 4 --kv_cache_dtype fp8
--online_quant_config ptpc_fp8 --max-num-seqs 128 --max-num-batched-tokens 16384` is, in this CLI, `serve DIR -tp 4
-dcp 4 --kv-cache-dtype fp8 --quantization ptpc_fp8 --max-num-seqs 128 --max-num-batched-tokens 16384`; the
checkpoint (tiny-glm's shapes with IndexShare, written in HF's layout) ships a chat template in GLM's format
(`tests/fixtures/glm_chat/chat_template.jinja`: `[gMASK]<sop>`, then `<|role|>` turns), and lm-eval's
`local-chat-completions --apply_chat_template` runs against the server, as the seed's gsm8k check does (here on the
offline generate task of tests/serving/lm_eval_tasks: the random model's answers are not scored, the run is).

The line exactly, in a `serve` process, with lm-eval: slow (its 30 programs up to 16,384 rows compile in about two
minutes on this machine's CPUs). The same flags in process with a step budget of 128 rows and one bucket (so three
programs compile): every run of the suite."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from tests.child_env import child_env
from tests.serving.serving_utils import http, start_server

REPO = pathlib.Path(__file__).resolve().parents[2]
SEED_FLAGS = ["-tp", "4", "-dcp", "4", "--kv-cache-dtype", "fp8", "--quantization", "ptpc_fp8", "--max-num-seqs",
              "128", "--max-num-batched-tokens", "16384"]


@pytest.fixture(scope="module")
def glm_checkpoint(tmp_path_factory):
    """tiny-glm's random weights as a HF directory (f32), with GLM's chat template."""
    from dcp_jax.config import TINY_GLM
    from dcp_jax.model.deepseek_v32 import init_params
    from dcp_jax.model.weights import save_hf

    path = tmp_path_factory.mktemp("glm_tiny")
    save_hf(TINY_GLM, init_params(TINY_GLM, seed=0), path)
    shutil.copy(REPO / "tests/fixtures/glm_chat/chat_template.jinja", path)
    return path


def test_the_seed_flags_serve_glm_with_its_chat_template(glm_checkpoint, tmp_path_factory):
    """The seed's flags (parsed by the serve command) with a 128-row step budget in one bucket: per-channel fp8
    linear layers, fp8 caches at tp 4 x dcp 4, and a chat request rendered through the checkpoint's GLM template."""
    from dcp_jax import cli
    from dcp_jax.model import fp8_linear
    from dcp_jax.serving.engine import Engine
    from dcp_jax.serving.engine_args import EngineArgs

    flags = SEED_FLAGS[:-1] + ["128"]
    args = EngineArgs.from_cli_args(cli.parse_args(["serve", str(glm_checkpoint), *flags]))
    assert (args.tp, args.dcp, args.quantization, args.max_num_seqs) == (4, 4, "ptpc_fp8", 128)
    engine = Engine(**{name: getattr(args, name) for name in ("model", "tp", "dcp", "quantization", "max_num_seqs",
                                                               "max_num_batched_tokens", "kv_cache_dtype")},
                    max_model_len=128, bucket_ladder=(128,), progress=False)
    assert isinstance(engine.runner.params["dense_layers"]["attention"]["wo"], fp8_linear.Fp8ChannelWeight)
    assert engine.engine_config.latent_cache == engine.engine_config.index_cache == "fp8"
    server = start_server(tmp_path_factory, engine)
    try:
        messages = [{"role": "user", "content": "hi"}]
        model = glm_checkpoint.name
        status, _, body = http(server, "POST", "/tokenize", {"model": model, "messages": messages,
                                                             "return_token_strs": True})
        assert status == 200, body
        text = "".join(json.loads(body)["token_strs"])
        assert text.endswith("[gMASK]<sop><|user|>\nhi<|assistant|>\n"), text
        status, _, body = http(server, "POST", "/v1/chat/completions", {"model": model, "messages": messages,
                                                                        "max_tokens": 4})
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 4, body
    finally:
        server.stop()
    assert engine.num_free_pages == engine.num_pages


@pytest.mark.slow
def test_the_seed_command_line_serves_lm_evals_chat_client(glm_checkpoint, tmp_path):
    pytest.importorskip("lm_eval")
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "dcp_jax.cli", "serve", str(glm_checkpoint), *SEED_FLAGS,
                             "--port", "0"], cwd=REPO, env=child_env(), stdout=log, stderr=subprocess.STDOUT,
                            text=True)
    try:
        url = _wait_ready(tmp_path / "serve.log", proc)
        env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   HF_HOME=str(tmp_path / "hf"), TOKENIZERS_PARALLELISM="false")
        env.pop("XLA_FLAGS", None)
        run = subprocess.run(
            [sys.executable, "-m", "lm_eval", "run", "--model", "local-chat-completions", "--model_args",
             f"model={glm_checkpoint.name},base_url={url}/v1/chat/completions,num_concurrent=4,max_retries=1,"
             f"timeout=120", "--tasks", "dcp_tiny_generate", "--include_path",
             str(REPO / "tests/serving/lm_eval_tasks"), "--output_path", str(tmp_path / "out"), "--log_samples",
             "--apply_chat_template"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())["results"]
        assert any(k.startswith("exact_match") for k in results["dcp_tiny_generate"])
    finally:
        proc.terminate()
        proc.wait(timeout=120)
        log.close()


def _wait_ready(log_path, proc, timeout: float = 900.0) -> str:
    """The server's URL once its log says it is ready (a hang guard, not a timer)."""
    import re
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log_path.read_text()
        if "dcp-jax serve: ready" in text:
            return re.search(r"listening on (http://127\.0\.0\.1:\d+)", text).group(1)
        assert proc.poll() is None, text[-3000:]
        time.sleep(1)
    raise TimeoutError(log_path.read_text()[-3000:])
