"""XLA options the step programs compile with, given to each compile: they hold whenever JAX's backend started.

The layers run under `jax.lax.scan` over stacked weights (`forward._layers`). With XLA's defaults on the H200 each
iteration copies its slice of the stacked weights before the GEMM reads it (+260 us a layer of DeepSeek-V3.2's
dense MLP); with dynamic-slice fusion on and cuBLAS for every GEMM (no Triton GEMM fusions, which cannot take the
slice in place) the scan reads the weights where they lie and equals the unrolled loop under the same flags, still
18% slower than the unrolled loop under XLA's defaults, whose Triton GEMMs beat cuBLAS on these shapes
(docs/performance.md, "Layers compiled once"). XLA's dot merger is off: it joined the two GEMMs that share an input
(`wq_b` with the indexer's `index_wq`, `wqkv_a` with `index_wk`) by concatenating their weights inside the scan's
body, 132 MB a DeepSeek-V3.2 layer copied each step; off, the 3-layer greedy step at B = 64 took 3.88 ms against
4.10 (one H100, docs/performance.md, "The step against its roofline"). As compile options they need no XLA_FLAGS
(read once, when the backend starts); an option the user sets in XLA_FLAGS stays as set.
"""

from __future__ import annotations

import os

# XLA debug options of GPU compiles (other platforms' compiles take them: the GPU ones do nothing there, and CPU's
# XLA merged no dots in a check).
GPU_OPTIONS = {"xla_gpu_enable_dynamic_slice_fusion": True, "xla_gpu_enable_triton_gemm": False,
               "xla_disable_hlo_passes": "dot-merger"}


def step_compiler_options() -> dict[str, bool | str]:
    """GPU_OPTIONS but those XLA_FLAGS sets: the `compiler_options` of the step programs' and the training step's
    `jax.jit`."""
    current = os.environ.get("XLA_FLAGS", "")
    return {name: value for name, value in GPU_OPTIONS.items() if f"--{name}=" not in current}
