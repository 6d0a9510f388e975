"""bench_sparse_mla.py --plot draws the committed H200 run (no measurement, any machine)."""

import runpy
import sys

import pytest


def test_plot_from_saved_run(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    path = tmp_path / "sparse_mla.png"
    monkeypatch.setattr(sys, "argv", ["bench_sparse_mla.py", "--plot", "docs/data/sparse_mla_mosaic_h200_run1.json",
                                      str(path)])
    runpy.run_path("bench/bench_sparse_mla.py", run_name="__main__")
    assert path.stat().st_size > 10_000
