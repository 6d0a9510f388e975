"""bench/bench_mtp.py times the plain and the verify step on the engine's runner (a CPU smoke run of the tiny
preset at DCP 2) and writes the break-even acceptance rate."""

import json

from bench.bench_mtp import main


def test_it_times_both_steps_and_writes_the_break_even(tmp_path, capsys):
    out = tmp_path / "mtp.json"
    assert main(["--batch", "2", "--context", "40", "--steps", "2", "--dcp", "2", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["plain_ms"] > 0 and row["verify_ms"] > 0
    assert row["breakeven_acceptance"] == row["verify_ms"] / row["plain_ms"] - 1
    assert "pays off above an acceptance rate" in capsys.readouterr().out
