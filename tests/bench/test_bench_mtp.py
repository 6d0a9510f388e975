"""bench/bench_mtp.py times the plain and the verify steps on the engine's runner (a CPU smoke run of the tiny
preset at DCP 2) and writes the break-even acceptance rate per draft count."""

import json

import pytest

from bench.bench_mtp import breakeven_acceptance, expected_tokens, main


def test_it_times_the_steps_and_writes_the_break_even(tmp_path, capsys):
    out = tmp_path / "mtp.json"
    assert main(["--batch", "2", "--context", "40", "--steps", "2", "--dcp", "2", "--num-speculative-tokens", "3",
                 "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["num_speculative_tokens"] == 3 and row["plain_ms"] > 0 and row["verify_ms"] > 0
    assert row["cost_ratio"] == pytest.approx(row["verify_ms"] / row["plain_ms"])
    if 1 < row["cost_ratio"] < 4:  # else the break-even is 0 or 1 (below)
        assert expected_tokens(row["breakeven_acceptance"], 3) == pytest.approx(row["cost_ratio"], rel=1e-6)
    assert "pays off above an acceptance rate" in capsys.readouterr().out


def test_it_times_block_fp8_weights_when_asked(tmp_path):
    out = tmp_path / "mtp.json"
    assert main(["--batch", "1", "--context", "24", "--steps", "1", "--num-speculative-tokens", "1",
                 "--quantization", "fp8", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["args"]["quantization"] == "fp8" and result["rows"][0]["verify_ms"] > 0


def test_the_break_even_acceptance():
    assert breakeven_acceptance(1.5, 1) == pytest.approx(0.5)  # 1 + a = 1.5
    assert breakeven_acceptance(1.0, 3) == pytest.approx(0.0, abs=1e-9)
    assert breakeven_acceptance(4.5, 3) == 1.0  # 4 tokens at best: never pays
    assert breakeven_acceptance(0.8, 3) == 0.0  # a verify step cheaper than a plain one (timing noise): always pays
