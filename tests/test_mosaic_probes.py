"""The Mosaic GPU probes in bench/ (issue 4) still lower for CUDA: Mosaic GPU kernels lower without a GPU."""

import runpy
import sys

import pytest

PROBES = ["bench/probe_mgpu_row_gather.py", "bench/probe_mgpu_union_view.py", "bench/probe_mgpu_sparse_mla.py"]


@pytest.mark.parametrize("path", PROBES)
def test_probe_lowers(path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [path, "--lower"])
    runpy.run_path(path, run_name="__main__")
    assert "lowers" in capsys.readouterr().out
