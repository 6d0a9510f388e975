"""Which implementation runs each sparse-attention op: the Pallas kernels or the pure-jnp references."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from pallas_kernels import reference


@dataclasses.dataclass(frozen=True)
class Kernels:
    indexer_logits: Callable
    topk: Callable
    indexer_top_k: Callable  # topk of indexer_logits, fused where the kernels allow
    sparse_mla_decode: Callable


REFERENCE = Kernels(reference.indexer_logits, reference.topk, reference.indexer_top_k, reference.sparse_mla_decode)


KERNEL_CHOICES = ("auto", "pallas", "reference")


def select_kernels(name: str) -> Kernels:
    """'reference' (plain XLA, any backend), 'pallas' (Pallas kernels; interpreted on CPU) or 'auto' (Pallas
    on a GPU, the references elsewhere)."""
    if name == "auto":
        import jax

        name = "pallas" if jax.default_backend() == "gpu" else "reference"
    if name == "reference":
        return REFERENCE
    if name == "pallas":
        from pallas_kernels.indexer import indexer_logits
        from pallas_kernels.indexer_topk import indexer_top_k
        from pallas_kernels.sparse_mla import sparse_mla_decode
        from pallas_kernels.topk import topk

        return Kernels(indexer_logits, topk, indexer_top_k, sparse_mla_decode)
    raise ValueError(f"unknown kernels {name!r}; choose from {KERNEL_CHOICES}")
