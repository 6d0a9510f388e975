"""The start-up benchmark (bench/bench_startup.py, `dcp-jax bench startup`) on CPU through the CLI: `compile` lowers
and compiles the serving programs from abstract block-fp8 weights; `step` times the real decode step with the layers
scanned and unrolled. No timing is asserted."""

import contextlib
import io
import json

from dcp_jax import cli

SMALL_ENGINE = ["--preset", "tiny", "--quantization", "fp8", "--page-size", "16", "--num-pages", "16", "--max-num-seqs",
                "2", "--max-model-len", "64", "--max-num-batched-tokens", "8"]


def _run(tmp_path, what: str, *extra: str) -> list[dict]:
    out = tmp_path / f"{what}.jsonl"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = cli.main(["bench", "startup", what, *SMALL_ENGINE, *extra, "--out", str(out)])
    assert rc == 0, stdout.getvalue()
    run, *rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert run["backend"] == "cpu"
    return rows


def test_compile_counts_the_serving_programs(tmp_path):
    """Scanned layers only (the step test below compiles the unrolled form too)."""
    rows = _run(tmp_path, "compile", "--layers", "1", "--unrolled-layers", "--workers", "2")
    assert [(r["layers"], r["layers_mode"]) for r in rows] == [(1, "scan")]
    assert rows[0]["weights"] == "fp8" and rows[0]["programs"] > 0 and rows[0]["seconds"] > 0 and not rows[0]["cache"]


def test_step_times_the_decode_step_both_ways_without_recompiles(tmp_path):
    rows = _run(tmp_path, "step", "--layers", "1", "--batch", "2", "--context", "32", "--steps", "1", "--warmup", "1",
                "--kernels", "reference")
    assert [r["layers_mode"] for r in rows] == ["scan", "unrolled"]
    for row in rows:
        assert row["kind"] == "step" and row["recompiles"] == 0 and row["device_ms"] > 0
