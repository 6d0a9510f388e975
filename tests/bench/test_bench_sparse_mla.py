"""bench_sparse_mla.py without a GPU: --plot draws the committed H200 run, and the compared variants come from
--variants and --knobs (no measurement, any machine)."""

import runpy
import sys

import pytest

from bench.bench_sparse_mla import VARIANTS, compared_variants


def test_plot_from_saved_run(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    path = tmp_path / "sparse_mla.png"
    monkeypatch.setattr(sys, "argv", ["bench_sparse_mla.py", "--plot", "docs/data/sparse_mla/mosaic_bf16_h200.json",
                                      str(path)])
    runpy.run_path("bench/bench_sparse_mla.py", run_name="__main__")
    assert path.stat().st_size > 10_000


def test_compared_variants_take_named_ones_then_labelled_knobs():
    knobs = '{"r192": {"cache": "fp8_latent", "registers": [192, 64]}}'
    variants = compared_variants("fp8_latent,triton", knobs)
    assert list(variants) == ["fp8_latent", "triton", "r192"]
    assert variants["fp8_latent"] == VARIANTS["fp8_latent"]
    assert variants["r192"] == dict(cache="fp8_latent", registers=(192, 64))  # hashable
    assert list(compared_variants("", "{}")) == []
    with pytest.raises(ValueError, match=r"unknown variants \['nope'\]"):
        compared_variants("fp8_latent,nope", "{}")
