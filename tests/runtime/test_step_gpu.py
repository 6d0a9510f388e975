"""The sharded decode step (runtime/step.py over the demo's attention stack, `dcp_jax/demo.py`) with the Pallas
kernels compiled on a CUDA GPU equals its unsharded twin (`decode_stack_unsharded`, reference ops), as tests/model/
attention/test_sparse_dcp.py checks interpreted on CPU: exact and fp8 caches (index keys, latents), padded rows,
contexts below and above index_topk, exact ties at the top-k boundary, and the tiny model with DeepSeek-V3.2's
indexer shape and pages of 64 (so the fp8 index cache runs the Mosaic GPU indexer). DCP = 2 needs 2 GPUs (skipped
on one). f32, matmul precision highest.

Each case records its worst difference (`max_abs_err`, in the junit xml that scripts/test_gpu.sh writes).
"""

import dataclasses

import jax
import pytest

from dcp_jax.config import TINY, EngineConfig, ParallelConfig
from dcp_jax.demo import Schedule, run_comparison

from tests.model.attention.test_sparse_dcp import tied_index_params

ENGINE = EngineConfig(page_size=4, num_pages=48, max_num_seqs=4, max_model_len=40, max_num_batched_tokens=4)
# 3 active rows (one pad row) at steps 2-4 and after step 12; contexts reach 27 > index_topk = 16.
SCHEDULE = Schedule(start=(0, 0, 2, 5), stop=(27, 12, 27, 27))
# f32 caches: the Triton kernels run full-precision f32 dots (the CPU bound of test_sparse_dcp.py; interpreted on
# CPU at dcp 1: 2.1e-6 exact and with fp8 index keys). TODO(issue 25): not yet measured on the H200.
TOL = 2e-5
# fp8 latent cache: the kernel computes in bf16 and returns bf16 (one layer, so that the rounding cannot flip the
# next layer's top-k; test_sparse_dcp.py's bound; interpreted on CPU at dcp 1: 5.5e-3).
FP8_LATENT_TOL = 2e-2


def _dcp(size: int, interleave: int):
    marks = [pytest.mark.skipif(jax.device_count() < size, reason=f"DCP = {size} needs {size} GPUs")]
    return pytest.param(size, interleave, marks=marks, id=f"dcp{size}-S{interleave}")


DCP_SIZES = [_dcp(1, 1), _dcp(2, 2)]


@pytest.mark.gpu
@pytest.mark.parametrize("dcp, interleave", DCP_SIZES)
@pytest.mark.parametrize("index_cache, latent_cache", [("exact", "exact"), ("fp8", "exact"), ("fp8", "fp8")])
def test_dcp_step_on_gpu_equals_unsharded(dcp, interleave, index_cache, latent_cache, record_property):
    engine = dataclasses.replace(ENGINE, index_cache=index_cache, latent_cache=latent_cache)
    is_fp8_latent = latent_cache == "fp8"
    cfg, tol = (dataclasses.replace(TINY, num_hidden_layers=1), FP8_LATENT_TOL) if is_fp8_latent else (TINY, TOL)
    report = run_comparison(cfg, ParallelConfig(tp=dcp, dcp=dcp, interleave=interleave), engine, SCHEDULE,
                            kernels="pallas")
    record_property("max_abs_err", report.max_abs_err)
    assert report.max_context > cfg.indexer.topk
    assert report.buckets_compiled == len(engine.buckets)
    assert report.max_abs_err < tol


@pytest.mark.gpu
@pytest.mark.parametrize("dcp, interleave", DCP_SIZES)
def test_dcp_step_with_deepseeks_indexer_shape_runs_the_mosaic_indexer_and_equals_unsharded(dcp, interleave,
                                                                                           record_property):
    """The tiny model with DeepSeek-V3.2's indexer (64 heads of 128) and pages of 64, the fp8 index cache: the Pallas
    side runs the Mosaic GPU indexer inside the shard_mapped step (2.2e-6 on two H200s, docs/performance.md, "The
    whole sparse DCP decode step against its single-device twin")."""
    cfg = TINY.with_indexer(heads=64, head_dim=128)
    engine = dataclasses.replace(ENGINE, page_size=64, num_pages=16, index_cache="fp8")
    report = run_comparison(cfg, ParallelConfig(tp=dcp, dcp=dcp, interleave=interleave), engine, SCHEDULE,
                            kernels="pallas")
    record_property("max_abs_err", report.max_abs_err)
    assert report.max_context > cfg.indexer.topk
    assert report.max_abs_err < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("dcp, interleave", DCP_SIZES)
def test_dcp_step_on_gpu_with_exact_ties_equals_unsharded(dcp, interleave, record_property):
    """All index scores tie: the compiled top-k must keep the lowest positions, as the reference does."""
    report = run_comparison(TINY, ParallelConfig(tp=dcp, dcp=dcp, interleave=interleave), ENGINE, SCHEDULE,
                            kernels="pallas", params=tied_index_params(3))
    record_property("max_abs_err", report.max_abs_err)
    assert report.max_abs_err < TOL
