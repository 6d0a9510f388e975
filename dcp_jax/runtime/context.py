"""The frozen context of a step program: what is static about it (the model, its layout and kernels, how its layers
run), handed whole to the step body and the attention variant instead of travelling as separate arguments beside
the metadata."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from dcp_jax.config import KERNEL_CHOICES, ModelConfig
from dcp_jax.host.layout import DcpLayout
from dcp_jax.model import architecture


def kernel_backend(kernels: str) -> str:
    """The kernels' backend (`pallas_kernels.BACKENDS`) for an engine's `kernels` choice: 'reference' (plain XLA,
    any device), 'pallas' (the Pallas kernels; interpreted on CPU) or 'auto' (Pallas on a GPU, the references
    elsewhere)."""
    import jax

    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"unknown kernels {kernels!r}; choose from {KERNEL_CHOICES}")
    if kernels == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "reference"
    return kernels


@dataclasses.dataclass(frozen=True)
class ModelDef:
    """A model's (or its MTP layer's) nnx graphdef and abstract state: what turns a step's params into modules."""

    graphdef: Any
    abstract: Any


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What every program of one runner shares, static at trace time.

    cfg: the model config (its architecture names the model file and the attention variant); layout: the DCP
    layout (dcp size, interleave, page size); backend: the kernels' (`kernel_backend`); micro_batches: 2 runs each
    layer's attention as two micro-batches (two-batch overlap); unroll_layers: one copy of each layer instead of a
    scan over each stack; model / mtp: the model's and, when it drafts, its MTP layer's `ModelDef` (what a step
    body merges its params into; None where only the attention runs, and mtp None without drafting); attention:
    None (each layer runs its own variant, `attention/variant.py`), or a function of a layer's variant giving the
    one it runs instead (a benchmark's cut or fallback of it)."""

    cfg: ModelConfig
    layout: DcpLayout
    backend: str
    micro_batches: int = 1
    unroll_layers: bool = False
    model: ModelDef | None = None
    mtp: ModelDef | None = None
    attention: Callable[[Any], Any] | None = None

    @property
    def architecture(self) -> architecture.Architecture:
        return architecture.of(self.cfg)
