"""bench/bench_train_step.py runs its stages (a CPU smoke run of a tiny one) and writes its table as JSON."""

import json

from bench.bench_train_step import main


def test_it_times_each_stage_and_writes_the_rows(tmp_path, capsys):
    out = tmp_path / "steps.json"
    assert main(["--stages", "sparse:1:48:2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["context"], r["batch"]) for r in rows] == [("sparse", 48, 2)]
    assert all(r["step_ms"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    assert "tokens/s" in capsys.readouterr().out
