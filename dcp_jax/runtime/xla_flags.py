"""XLA flags the step programs run with on GPUs, set before the backend starts.

The layers run under `jax.lax.scan` over stacked weights (`forward._layers`). With XLA's defaults on the H200 each
iteration copies its slice of the stacked weights before the GEMM reads it (+260 us a layer of DeepSeek-V3.2's
dense MLP); with dynamic-slice fusion on and cuBLAS for every GEMM (no Triton GEMM fusions, which cannot take the
slice in place) the scan reads the weights where they lie and equals the unrolled loop under the same flags, still
18% slower than the unrolled loop under XLA's defaults, whose Triton GEMMs beat cuBLAS on these shapes
(docs/performance.md, "Layers compiled once"). A flag the user already set in XLA_FLAGS is left as set.
"""

from __future__ import annotations

import os

GPU_FLAGS = {"xla_gpu_enable_dynamic_slice_fusion": "true", "xla_gpu_enable_triton_gemm": "false"}


def apply_gpu_flags() -> bool:
    """Add GPU_FLAGS to XLA_FLAGS (the ones not set there already); False, changing nothing, when a JAX backend
    has already started (XLA reads its flags once)."""
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        return False
    current = os.environ.get("XLA_FLAGS", "")
    added = [f"--{name}={value}" for name, value in GPU_FLAGS.items() if f"--{name}=" not in current]
    os.environ["XLA_FLAGS"] = " ".join([current, *added]).strip()
    return True
