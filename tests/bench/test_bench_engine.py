"""The engine benchmark (bench/bench_engine.py, `dcp-jax bench engine`) on simulated CPU devices: a tiny grid end to
end through the CLI. No timing is asserted; the test checks what the script measures and reports: every point's
row, the phases of the host step, no compile after warm-up."""

import contextlib
import io
import json

import pytest

from bench.bench_engine import PHASES
from dcp_jax import cli

SMOKE = ["bench", "engine", "--preset", "tiny", "--num-layers", "1", "--batches", "1,2", "--contexts", "24",
         "--steps", "3", "--dtype", "float32", "--kernels", "reference", "--page-size", "4", "--trace-steps", "2",
         "--max-num-batched-tokens", "32", "--quantization", "fp8", "--index-cache", "fp8",
         "--latent-cache", "fp8"]  # the fp8 weights and caches end to end


def test_engine_bench_reports_every_point_with_its_bare_step_and_host_phases(tmp_path):
    out = tmp_path / "engine.jsonl"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
        rc = cli.main(SMOKE + ["--out", str(out)])
    assert rc == 0, stdout.getvalue()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0]["kind"] == "run" and rows[0]["args"]["batches"] == [1, 2]
    assert rows[0]["args"]["quantization"] == "fp8"
    points = rows[1:]
    assert [(p["batch"], p["mode"]) for p in points] == [(1, "greedy"), (1, "sampled"), (2, "greedy"),
                                                         (2, "sampled")]
    for p in points:
        assert p["context"] == 24 and p["engine_tokens_per_s"] > 0 and p["bare_step_ms"] > 0
        assert p["ratio"] == pytest.approx(p["engine_tokens_per_s"] * p["bare_step_ms"] / 1e3 / p["batch"])
        assert set(p["phase_ms"]) == set(PHASES) and all(v >= 0 for v in p["phase_ms"].values())
        assert p["phase_ms"]["launch"] > 0 and p["phase_ms"]["apply"] > 0 and p["steps"] >= 1
        assert p["compiles_after_warmup"] == 0
        assert p["index_cache"] == p["latent_cache"] == "fp8"  # what the engine ran, not only what was asked
        assert len(p["wait_ms"]) == p["steps"] and p["host_ms_max"] >= p["host_ms_per_step"]
        assert p["device_busy"] == 0.0  # a CPU run's trace has no GPU stream to be busy
    table = [line for line in stdout.getvalue().splitlines() if line.startswith("| 24 |")]
    assert len(table) == len(points)
