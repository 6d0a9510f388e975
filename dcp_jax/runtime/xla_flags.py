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
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *missing_gpu_flags()]).strip()
    return True


def missing_gpu_flags() -> list[str]:
    """The GPU_FLAGS that XLA_FLAGS does not set."""
    current = os.environ.get("XLA_FLAGS", "")
    return [f"--{name}={value}" for name, value in GPU_FLAGS.items() if f"--{name}=" not in current]


def flags_not_applied(backend: str, *, unroll_layers: bool) -> str | None:
    """Why a model loaded now runs a slower step, or None: the layer scan on a GPU whose backend started without
    GPU_FLAGS (`apply_gpu_flags` came too late). Reads XLA_FLAGS as it is now: flags added after the backend
    started, which XLA never read, hide the warning."""
    missing = missing_gpu_flags()
    if backend != "gpu" or unroll_layers or not missing:
        return None
    return (f"JAX started before the model loaded, without {' '.join(missing)}: each layer of the scan copies its "
            f"weights (a slower step). Set them in XLA_FLAGS, load before using JAX, or unroll_layers=True.")
