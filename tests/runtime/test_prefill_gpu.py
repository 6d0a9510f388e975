"""Chunked prefill with the Pallas kernels compiled on a CUDA GPU: the tiny model with DeepSeek-V3.2's indexer shape
(64 heads of 128) and pages of 64 (so the fp8 index cache runs the Mosaic GPU indexer) prefills prompts longer than
index_topk in one step and in chunks (each chunk's rows attending to the prefix earlier steps cached), against one
step with the reference kernels. f32, matmul precision highest. The exact index cache must agree on every row's
selected set; the fp8 one orders near-ties as its tensor cores accumulate (0.05-0.1% of rows on an H200,
docs/performance.md, "TTFT and the decodes' latency")."""

import numpy as np
import pytest

from dcp_jax.config import TINY, EngineConfig, ParallelConfig
from dcp_jax.model.deepseek_v32 import init_params
from dcp_jax.model.mesh import make_mesh
from dcp_jax.runtime import oracle
from dcp_jax.runtime.runner import ModelRunner

CFG = TINY.with_indexer(heads=64, head_dim=128)
LENGTHS, PAGE_SIZE = (256, 768), 64
# f32 logits of one step against chunks (seen: 4.5e-6 on an H200).
TOL = 1e-4


def _prefill(index_cache: str, kernels: str, prompts, chunk: int):
    budget = max(LENGTHS)
    engine = EngineConfig(page_size=PAGE_SIZE, num_pages=4 * len(prompts) * (budget // PAGE_SIZE + 2), max_num_seqs=4,
                          max_model_len=budget + 8, max_num_batched_tokens=budget, index_cache=index_cache)
    parallel = ParallelConfig(tp=1, dcp=1)
    runner = ModelRunner(CFG, init_params(CFG, 0), parallel, engine, make_mesh(parallel), kernels)
    blocks = engine.max_blocks_per_seq(1)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(len(prompts))]
    logits, selected, _ = oracle.prefill(runner, prompts, tables, chunk_size=chunk, all_logits=True,
                                         return_selected=True)
    return logits, selected


@pytest.mark.gpu
@pytest.mark.parametrize("index_cache", ["exact", "fp8"])
@pytest.mark.parametrize("chunk", [max(LENGTHS), 128])
def test_chunked_prefill_with_the_pallas_kernels_equals_one_reference_step(index_cache, chunk, record_property):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, CFG.vocab_size, n).tolist() for n in LENGTHS]
    want, want_selected = _prefill(index_cache, "reference", prompts, max(LENGTHS))
    got, selected = _prefill(index_cache, "pallas", prompts, chunk)
    differ = total = 0
    for i, n in enumerate(LENGTHS):
        a, b = np.sort(selected[:, i, :n], -1), np.sort(want_selected[:, i, :n], -1)
        differ += int(np.any(a != b, axis=-1).sum())
        total += a.shape[0] * n
    error = max(float(np.nanmax(np.abs(got[i, :n] - want[i, :n]))) for i, n in enumerate(LENGTHS))
    record_property("max_abs_err", error)
    record_property("rows_whose_sets_differ", differ / total)
    if index_cache == "exact":
        assert differ == 0 and error < TOL
    else:
        assert differ / total < 0.01
