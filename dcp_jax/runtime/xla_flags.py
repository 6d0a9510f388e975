"""XLA options the step programs compile with, given to each compile: they hold whenever JAX's backend started.

The layers run under `jax.lax.scan` over stacked weights (`forward._layers`). With XLA's defaults on the H200 each
iteration copies its slice of the stacked weights before the GEMM reads it (+260 us a layer of DeepSeek-V3.2's
dense MLP); with dynamic-slice fusion on and cuBLAS for every GEMM (no Triton GEMM fusions, which cannot take the
slice in place) the scan reads the weights where they lie and equals the unrolled loop under the same flags, still
18% slower than the unrolled loop under XLA's defaults, whose Triton GEMMs beat cuBLAS on these shapes
(docs/performance.md, "Layers compiled once"). As compile options they need no XLA_FLAGS (read once, when the
backend starts); an option the user sets in XLA_FLAGS stays as set.
"""

from __future__ import annotations

import os

# XLA debug options of GPU compiles (other platforms' compiles take and ignore them).
GPU_OPTIONS = {"xla_gpu_enable_dynamic_slice_fusion": True, "xla_gpu_enable_triton_gemm": False}


def step_compiler_options() -> dict[str, bool]:
    """GPU_OPTIONS but those XLA_FLAGS sets: the `compiler_options` of the step programs' and the training step's
    `jax.jit`."""
    current = os.environ.get("XLA_FLAGS", "")
    return {name: value for name, value in GPU_OPTIONS.items() if f"--{name}=" not in current}
