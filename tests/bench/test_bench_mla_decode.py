"""The paged dense MLA decode benchmark (bench/bench_mla_decode.py, `dcp-jax bench mla_decode`) on CPU: a tiny grid
end to end through the CLI (interpreted kernels, checked against the reference, with the same-run ceilings), its
grid and byte counts. No timing is asserted."""

import argparse
import contextlib
import io
import json

import pytest

from bench.bench_mla_decode import causal_lens, grid, main, token_bytes
from dcp_jax import cli


def test_mla_decode_bench_reports_each_point_against_the_ceilings(tmp_path):
    """S = 1 and S = 2 rows over bf16 and fp8 caches, L = 40 (not a multiple of the 16-token page), a Triton knob
    (splits=2, so the merge runs) recorded in each point's tiling."""
    out = tmp_path / "mla_decode.jsonl"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = cli.main(["bench", "mla_decode", "--batches", "2", "--contexts", "40", "--heads", "16", "--mtp-heads",
                       "16", "--page-size", "16", "--backend", "triton", "--knobs", '{"splits": 2}', "--rotate-bytes",
                       "0", "--copy-bytes", "4M", "--matmul-size", "128", "--json-out", str(out)])
    assert rc == 0, stdout.getvalue()
    run, *points = [json.loads(line) for line in out.read_text().splitlines()]
    assert run["kind"] == "run" and run["copy_tbps"] > 0 and run["matmul_tflops"] > 0 and "commit" in run
    assert [(p["cache"], p["queries"]) for p in points] == [("bf16", 1), ("bf16", 2), ("fp8", 1), ("fp8", 2)]
    for point in points:
        assert point["batch"] == 2 and point["heads"] == 16 and point["context"] == 40
        assert point["tiling"]["splits"] == 2 and point["tiling"]["block_r"] == 16 * point["queries"]
        assert point["us"] > 0 and point["copy_fraction"] > 0 and point["matmul_fraction"] > 0
        assert point["finite"] and point["rel_error"] < 1e-2 and point["lse_error"] < 1e-3
        cache_bytes = 2 * 40 * token_bytes(point["cache"] == "fp8")
        assert cache_bytes < point["bytes"] < cache_bytes + 2 * point["queries"] * 16 * (576 * 2 + 513 * 4) + 64
        # 2 sequences' attended tokens: S = 2 rows attend 39 and 40 (causal).
        attended = 2 * (40 if point["queries"] == 1 else 79)
        assert point["flops"] == 2 * 16 * (576 + 512) * attended
    assert "| fp8 | 2 | 2 | 16 | 40 | 1 x 2 |" in stdout.getvalue()


def test_mla_decode_bench_refuses_knobs_without_the_triton_backend():
    with contextlib.redirect_stderr(io.StringIO()) as stderr, pytest.raises(SystemExit):
        main(["--knobs", '{"splits": 2}'])
    assert "need --backend triton" in stderr.getvalue()
    with contextlib.redirect_stderr(io.StringIO()) as stderr, pytest.raises(SystemExit):
        main(["--caches", "bf16,int4"])
    assert "unknown ['int4']" in stderr.getvalue()


def test_grid_bytes_and_lens():
    """The default grid: per cache, S = 1 at H 128 and 16, then S = 2 at H 128, each over B x L; the fp8 latent
    cache's 656 bytes a token; causal MTP lens."""
    args = argparse.Namespace(batches=(1, 8), contexts=(4096,), heads=(128, 16), mtp_heads=(128,),
                              caches=("bf16", "fp8"))
    points = grid(args)
    assert len(points) == 2 * 3 * 2
    assert points[:3] == [("bf16", 1, 1, 128, 4096), ("bf16", 8, 1, 128, 4096), ("bf16", 1, 1, 16, 4096)]
    assert points[4:6] == [("bf16", 1, 2, 128, 4096), ("bf16", 8, 2, 128, 4096)]
    assert token_bytes(False) == 1152 and token_bytes(True) == 656
    assert causal_lens(2, 3, 10).tolist() == [[8, 9, 10], [8, 9, 10]]
