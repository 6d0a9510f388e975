"""The MoE benchmark (bench/bench_moe.py, `dcp-jax bench moe`) on CPU: a tiny run end to end through the CLI (decode
and prefill rows against their ceilings, the dense reference skipped past its row limit), and the ceilings'
counts at DeepSeek-V3.2's shapes. No timing is asserted."""

import contextlib
import io
import json

import pytest

from bench.bench_moe import WEIGHT_BYTES, activated_flops, activated_weight_bytes
from dcp_jax import cli
from dcp_jax.config import DEEPSEEK_V32


def test_moe_bench_reports_each_computation_against_the_ceilings(tmp_path):
    out = tmp_path / "moe.jsonl"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = cli.main(["bench", "moe", "--preset", "tiny", "--decode", "1,8", "--prefill", "33", "--dense-max-rows",
                       "8", "--runs", "2", "--copy-bytes", "4M", "--matmul-size", "128", "--experts",
                       "pallas,ragged_dot,dense", "--pallas-knobs", '[{"block_m": 32}]', "--json-out", str(out)])
    assert rc == 0, stdout.getvalue()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["run", "ceiling", "point", "point", "point"]
    assert rows[1]["copy_tbps"] > 0 and rows[1]["matmul_tflops"] > 0
    decode_1, decode_8, prefill = rows[2:]
    assert (decode_1["phase"], decode_1["rows"], decode_1["distinct_experts"]) == ("decode", 1, 2)  # k = 2
    timed = ("pallas_ms", "ragged_dot_ms", "dense_ms", 'pallas {"block_m": 32}_ms')
    for row in (decode_1, decode_8):
        assert all(row[name] > 0 for name in timed) and row["ceiling_ms"] > 0 and not row["notes"]
    assert (prefill["phase"], prefill["rows"]) == ("prefill", 33) and prefill["pallas_ms"] > 0
    assert "dense_ms" not in prefill and prefill["notes"]["dense"].startswith("skipped")
    table = stdout.getvalue()
    assert "| decode | 8 |" in table and "| prefill | 33 |" in table
    assert "| ragged_dot |" in table and "skipped" in table


@pytest.mark.parametrize("weight_format", ["fp8", "mxfp4"])
def test_moe_bench_times_quantized_experts(tmp_path, weight_format):
    """Block-fp8 or MXFP4 routed experts: the Pallas kernel of the format and the dense reference (MXFP4:
    dequantized in its program) both run."""
    out = tmp_path / "moe.jsonl"
    with contextlib.redirect_stdout(io.StringIO()):
        rc = cli.main(["bench", "moe", "--preset", "tiny", "--decode", "4", "--prefill", "", "--weight-format",
                       weight_format, "--runs", "1", "--copy-bytes", "4M", "--matmul-size", "128", "--json-out",
                       str(out)])
    assert rc == 0
    point = [json.loads(line) for line in out.read_text().splitlines()][-1]
    assert point["pallas_ms"] > 0 and point["dense_ms"] > 0 and not point["notes"]


def test_ceilings_count_the_activated_experts():
    """DeepSeek-V3.2: 3 x 7168 x 2048 weights an expert; 8 routed and 1 shared a token."""
    expert = 3 * 7168 * 2048
    assert activated_flops(DEEPSEEK_V32, 2) == 2 * 2 * (9 * expert + 7168 * 256)
    assert activated_weight_bytes(DEEPSEEK_V32, 8, 2) == 9 * expert * 2 + 7168 * 256 * 4
    assert activated_weight_bytes(DEEPSEEK_V32, 8, 2) / 1e6 == pytest.approx(800, rel=0.01)
    assert activated_weight_bytes(DEEPSEEK_V32, 8, 1, 2) == 8 * expert + expert * 2 + 7168 * 256 * 4  # fp8 routed
    mxfp4 = activated_weight_bytes(DEEPSEEK_V32, 8, WEIGHT_BYTES["mxfp4"], 2)  # a byte of scale a 32 weights
    assert mxfp4 == 8 * expert * 17 / 32 + expert * 2 + 7168 * 256 * 4
