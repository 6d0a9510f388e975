"""What an attention variant is: the value an architecture names (`model/architecture.py`) for how its layers attend.

A variant declares its weights (a registered dataclass, their initializer, PartitionSpecs and HF tensors), the KV
pools a layer of it caches (`CachePool`: name, format, zeros, bytes a token) and its per-rank step function, which
reads the host-built `StepMetadata` whole and returns the layer's output, its pools and the global positions each
row attended (-1 padded; the oracle tests compare them with HF's). The sparse DSA path (`sparse_dcp.SPARSE_MLA`:
MLA, the lightning indexer, top-k, the candidate exchange) is one; a dense-MLA variant is another file of this
shape plus its kernel's row in `pallas_kernels/api.py`. An architecture names one variant; where its layers differ
(GLM-5.2's IndexShare: layers without an indexer), `layer_variant` gives each layer's, and a pool holds entries
only for the layers whose variant caches in it (`pool_names`, `kv_cache.pool_layers`).
Letters: see the legend in `dcp_jax/__init__.py`.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple


class CacheFormats(NamedTuple):
    """The formats of a layer's KV pools (`config.LATENT_CACHE_FORMATS`, `config.INDEX_CACHE_FORMATS`): 'exact' (the
    model dtype) or 'fp8'."""

    latent: str = "exact"
    index: str = "exact"


@dataclasses.dataclass(frozen=True)
class CachePool:
    """One named KV pool of a variant: every layer's entries of one kind, [W, layers, pages, B, ...] per DCP rank
    (`kv_cache.KVCache`). `zeros(leading_shape, dtype)` makes a zero pool of that leading shape (a plain array or
    a pytree in the pool's format); `token_bytes(itemsize)` is one token's bytes in one layer (`itemsize` the model
    dtype's, for an exact pool)."""

    name: str
    format: str
    zeros: Callable[[tuple[int, ...], Any], Any]
    token_bytes: Callable[[int], int]


class AttentionVariant(abc.ABC):
    """How the layers of an architecture attend, as a value (module docstring). Subclasses are stateless; the one
    instance of each is what architectures name."""

    #: A short name, e.g. "dsa".
    name: str
    #: The registered dataclass of one layer's attention weights.
    params_class: type
    #: The pools a layer of this variant caches in (names of the architecture variant's `cache_pools`).
    pool_names: tuple[str, ...]

    def layer_variant(self, cfg, layer: int) -> AttentionVariant:
        """The variant decoder layer `layer` runs (the MTP layer: `layer` = num_hidden_layers); this one unless the
        architecture's layers differ."""
        return self

    @abc.abstractmethod
    def init_params(self, cfg, key, dtype):
        """Random weights of one layer (`params_class`), normal / sqrt(fan_in), norms random around 1."""

    @abc.abstractmethod
    def partition_specs(self):
        """A `params_class` of PartitionSpecs: how each weight splits over the TP ranks (`mesh.HEADS`)."""

    @abc.abstractmethod
    def cache_pools(self, cfg, formats: CacheFormats) -> tuple[CachePool, ...]:
        """The pools a layer caches, in `formats` (ValueError for a format the variant or the config cannot take)."""

    @abc.abstractmethod
    def attend(self, p, x, pools: dict, rope, mds: dict, *, ctx, selection):
        """Per rank (inside shard_map): one layer's attention for the step's rows x [R, D] with weights p, the folded
        pools (`kv_cache.KVCache.local_pools`, by name), rope the (cos, sin) of the rows' positions and mds, for
        each pool this layer caches in (`pool_names`), the rank's view of the step's `StepMetadata` moved to this
        layer's entry of that pool (`kv_cache.on_layer`); selection [R, K] the global positions the most recent
        layer before it selected (-1 padded; what a layer without an indexer of its own attends). Returns (output
        [R, D] summed over the TP ranks, the pools, the global positions [R, K] each row attended, -1 padded)."""

    @abc.abstractmethod
    def hf_tensor_shapes(self, cfg) -> dict[str, tuple[int, ...]]:
        """The HF tensors of one layer's attention, named relative to the layer (`self_attn.q_a_proj.weight`, ...)
        -> shape."""

    @abc.abstractmethod
    def to_ours(self, cfg, tensors: dict) -> dict:
        """One layer's HF attention tensors (numpy, names as `hf_tensor_shapes`) -> our weights (a dict of the
        `params_class` fields; views where the layouts allow)."""

    @abc.abstractmethod
    def to_hf(self, cfg, params: dict) -> dict:
        """Inverse of `to_ours`."""

    @abc.abstractmethod
    def fp8_scales_to_ours(self, cfg, scales: dict, block: tuple[int, int]) -> dict:
        """The weight_scale_inv grids of a block-fp8 layer's attention tensors (by HF name) -> the scales of our fp8
        leaves, [*batch, out blocks, in blocks] (`fp8_linear.FP8_AXES`), keyed by field."""

    @property
    @abc.abstractmethod
    def fp8_tensors(self) -> tuple[str, ...]:
        """The attention tensors (HF names relative to a layer) a block-fp8 checkpoint stores in e4m3."""

    @abc.abstractmethod
    def fp8_problems(self, cfg, block: tuple[int, int]) -> list[str]:
        """Why this config's attention weights cannot stay in block fp8 of `block` (empty: they can)."""
