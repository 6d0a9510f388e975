"""bench/bench_prefill_indexer.py on the CPU (kernels interpreted): every variant runs on both shapes and is
recorded (the trace has no device times off the GPU). No timing is asserted."""

import contextlib
import io
import json

from dcp_jax import cli


def test_prefill_indexer_bench_runs_every_variant(tmp_path):
    out = tmp_path / "prefill_indexer.jsonl"
    with contextlib.redirect_stdout(io.StringIO()):
        rc = cli.main(["bench", "prefill_indexer", "--chunk", "8", "--start", "60", "--decode-rows", "2",
                       "--decode-length", "64", "--tiles", "4", "--runs", "1", "--matmul-size", "64",
                       "--out", str(out)])
    assert rc == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0]["kind"] == "run" and rows[0]["matmul_tflops"] > 0
    measured = {(r["kind"], r["mode"], r["kernel"]) for r in rows[1:]}
    assert measured == {(kind, mode, kernel) for kind in ("prefill", "decode") for mode in ("bf16", "fp8")
                        for kernel in ("row kernel (triton)", "row tiles of 4, 4 warps (triton)",
                                       "row tiles of 4, 8 warps (triton)")}
    prefill = next(r for r in rows if r["kind"] == "prefill")
    assert prefill["rows"] == 8 and prefill["flops"] == 2.0 * sum(range(61, 69)) * 64 * 128
