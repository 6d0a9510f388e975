"""bench_topk.py --plot draws the committed H200 rows (no measurement, any machine)."""

import runpy
import sys

import pytest


def test_plot_from_saved_rows(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    path = tmp_path / "topk.png"
    monkeypatch.setattr(sys, "argv", ["bench_topk.py", "--plot", "docs/data/topk/kernel_vs_lax_top_k_h200.json",
                                      str(path)])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path("bench/bench_topk.py", run_name="__main__")
    assert exit_info.value.code == 0
    assert path.stat().st_size > 10_000
