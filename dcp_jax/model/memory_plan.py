"""The memory plan of a model on a mesh: weight bytes per rank (in the weights' format), KV and index-key bytes per
cached token in each cache format, and the KV pool that fits what is left of a device's memory. `dcp-jax plan`
prints it; the engine sizes its pool at start-up with the same `pool_pages` (`serving/loading.py`).

Arithmetic only, on the abstract model (nothing is allocated): runs on any machine, for any size of model.
A DCP group of W ranks holds one copy of the KV, each rank 1/W of every request's tokens; the tp/W groups hold
copies of it.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from dcp_jax.config import WEIGHT_FORMATS, ModelConfig, ParallelConfig, kv_layers
from dcp_jax.model import architecture, fp8_linear
from dcp_jax.model.attention.variant import CacheFormats
from dcp_jax.model.kv_cache import pool_layers

FP8_BLOCK = 128
# The leaves an AMD Quark MXFP4 checkpoint keeps in MXFP4 (`mxfp4.EXPERT_LEAVES`): the routed experts, at 0.5 bytes
# of e2m1 codes plus one e8m0 byte a 32 weights.
MXFP4_LEAVES = frozenset({"experts_gate", "experts_up", "experts_down"})
MXFP4_BYTES = 0.5 + 1 / 32
MX_BLOCK = 32
# The leaves that DeepSeek's fp8 release stores in e4m3 (their HF tensors carry a weight_scale_inv).
BLOCK_FP8_LEAVES = frozenset({
    "wqkv_a", "wq_b", "w_uk", "w_uv", "wo", "index_wq", "index_wk",  # attention and the indexer
    "gate_up", "down", "experts_gate", "experts_up", "experts_down",  # dense MLP, shared and routed experts
})
# What start-up keeps back from the pool: a tenth of the budget for the compiled programs' workspace, and one
# layer's pools (on the H200 the prefill program allocated a buffer of one layer's latent pool: seen 2026-12-01,
# cause open, docs/performance.md).
WORKSPACE_FRACTION = 0.1


def shards(spec, parallel: ParallelConfig) -> int:
    """Ranks one copy of a leaf placed with PartitionSpec `spec` is split over on a (tp/dcp, dcp) mesh."""
    from dcp_jax.model.mesh import DCP, DCP_GROUP

    sizes = {DCP_GROUP: parallel.dcp_groups, DCP: parallel.dcp}
    names = [n for entry in spec if entry is not None for n in (entry if isinstance(entry, tuple) else (entry,))]
    return math.prod(sizes[n] for n in names)


def leaf_bytes(name: str, shape: tuple[int, ...], itemsize: int, weight_format: str) -> float:
    """Bytes of one weight leaf in `weight_format`: e4m3 plus an f32 scale per FP8_BLOCK^2 elements for the block
    fp8 leaves (exact when the dims are multiples of the block, as DeepSeek-V3.2's nearly all are), MXFP4_BYTES a
    weight for the MXFP4 leaves (exact: their input width is whole blocks of 32), else `itemsize` per element."""
    numel = math.prod(shape)
    if weight_format == "fp8" and name in BLOCK_FP8_LEAVES:
        return numel * (1 + 4 / FP8_BLOCK**2)
    if weight_format == "mxfp4" and name in MXFP4_LEAVES:
        return numel * MXFP4_BYTES
    return numel * itemsize


def weight_bytes_per_rank(abstract_params: dict, specs: dict, parallel: ParallelConfig, weight_format: str,
                          channel_fp8: bool = False) -> int:
    """Bytes of the weights one rank holds: each leaf of the abstract model (ShapeDtypeStructs) in `weight_format`
    over the ranks its spec splits it across; with `channel_fp8` (ptpc_fp8) the leaves it quantizes
    (`fp8_linear.quantize_channels_params`) in per-channel fp8 (`channel_fp8_bytes`)."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format={weight_format!r} must be one of {WEIGHT_FORMATS}")
    if channel_fp8 and weight_format == "fp8":
        raise ValueError("ptpc_fp8 quantizes unquantized linear weights; weight_format='fp8' is block fp8 already")

    def per_rank(path, leaf, spec):
        names = [getattr(key, "key", "") for key in path]
        if channel_fp8 and fp8_linear.channel_quantized(names):
            return channel_fp8_bytes(names[-1], leaf.shape, spec, parallel)
        return leaf_bytes(names[-1], leaf.shape, np.dtype(leaf.dtype).itemsize, weight_format) / shards(spec,
                                                                                                         parallel)

    return int(sum(jax.tree.leaves(jax.tree_util.tree_map_with_path(per_rank, abstract_params, specs))))


def channel_fp8_bytes(name: str, shape: tuple[int, ...], spec, parallel: ParallelConfig) -> float:
    """Bytes a rank holds of a per-channel fp8 leaf (`fp8_linear.Fp8ChannelWeight`): a byte a weight split as the
    plain leaf is, and an f32 scale an output channel split as its batch and output axes (a rank contracting part of
    the input keeps the scales of all its channels)."""
    in_axes = {a % len(shape) for a in fp8_linear.FP8_AXES[name][0]}
    numel, depth = math.prod(shape), math.prod(shape[a] for a in in_axes)
    axes = tuple(spec) + (None,) * (len(shape) - len(spec))
    scale_spec = tuple(None if a in in_axes else entry for a, entry in enumerate(axes))
    return numel / shards(spec, parallel) + 4 * numel / depth / shards(scale_spec, parallel)


def kv_bytes_per_token(cfg: ModelConfig, formats: CacheFormats, *, itemsize: int,
                       layers: int | None = None) -> dict[str, int]:
    """Bytes one cached token takes on the rank that holds it, all `layers` layers (default the decoder layers;
    `EngineConfig.kv_layers` with the MTP layer's), in each pool of the architecture's attention variant (DSA: its
    latent and its index key; IndexShare's shared layers hold no index key: `kv_cache.pool_layers`), the pools in
    `formats`."""
    layers = cfg.num_hidden_layers if layers is None else layers
    return {pool.name: len(pool_layers(cfg, pool.name, layers)) * pool.token_bytes(itemsize)
            for pool in architecture.of(cfg).attention.cache_pools(cfg, formats)}


def pool_pages(free_bytes: float, cfg: ModelConfig, formats: CacheFormats, *, page_size: int, itemsize: int,
               max_num_seqs: int, layers: int | None = None) -> int:
    """Pages (of `page_size` tokens per rank) of the KV pool that fit `free_bytes` of one rank's memory (what
    gpu_memory_utilization leaves after the weights): less WORKSPACE_FRACTION, the sampler state and one layer's
    pools besides. May be <= 0 (nothing fits)."""
    sampler_bytes = (max_num_seqs + 1) * cfg.vocab_size * 5  # int32 counts + bool prompt mask per slot
    free = (1 - WORKSPACE_FRACTION) * free_bytes - sampler_bytes
    layers = cfg.num_hidden_layers if layers is None else layers
    per_token = sum(kv_bytes_per_token(cfg, formats, itemsize=itemsize, layers=layers).values())
    return int(free * layers / (layers + 1) // (per_token * page_size))


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """One configuration's plan on devices of `device_bytes` each (bytes per rank unless named otherwise)."""

    parallel: ParallelConfig
    weight_format: str
    weight_bytes: int
    # Cache formats -> bytes per cached token on its rank, all layers, in each pool (by name).
    kv_bytes_per_token: dict[CacheFormats, dict[str, int]]
    device_bytes: int
    gpu_memory_utilization: float
    # Cache formats -> tokens of context the pool holds (over a DCP group: W times one rank's).
    pool_tokens: dict[CacheFormats, int]
    # Whether the MTP layer drafts (speculative decoding): its weights and its layer of KV counted.
    mtp: bool = False
    # Whether the decoder layers' linear weights but the experts are per-channel fp8 (ptpc_fp8).
    channel_fp8: bool = False


# The cache formats a plan lists: (latent, index), the pools of a variant in each.
CACHE_FORMAT_PAIRS = (CacheFormats("exact", "exact"), CacheFormats("exact", "fp8"), CacheFormats("fp8", "fp8"))


def make_plan(cfg: ModelConfig, parallel: ParallelConfig, *, dtype: str, weight_format: str, device_bytes: int,
              gpu_memory_utilization: float, page_size: int = 64, max_num_seqs: int = 256,
              mtp: bool = False, channel_fp8: bool = False) -> MemoryPlan:
    """The plan of `cfg` on `parallel` in model dtype `dtype` ('bfloat16' / 'float32') with weights in
    `weight_format`, for devices of `device_bytes`; the pool at gpu_memory_utilization as the engine sizes it. With
    `mtp` the MTP layer drafts: its weights (split as the decoder layers') and its layer of KV are counted.
    "mxfp4" is what loading an AMD Quark MXFP4 checkpoint keeps (`weights.py`): the decoder layers' routed experts
    in MXFP4, everything else (the MTP layer's experts too) in `dtype`; ValueError where tp would split an expert's
    input width into partial scale blocks (`mxfp4.check_shardable`). `channel_fp8` (ptpc_fp8): the decoder layers'
    linear leaves but the experts in per-channel fp8 (the MTP layer's stay as loaded: `loading.py`)."""
    import jax.numpy as jnp
    from flax import nnx

    model = architecture.of(cfg).model
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization} must be in (0, 1]")
    if mtp and cfg.num_nextn_predict_layers < 1:
        raise ValueError("speculative_config: the model has no MTP layer (num_nextn_predict_layers is 0)")
    model.check_divisible(cfg, parallel.tp, expert_parallel=parallel.enable_expert_parallel)
    if weight_format == "mxfp4":
        _check_mxfp4_split(cfg, parallel)
    weights, abstracts = 0, [(model.abstract_model(cfg, jnp.dtype(dtype))[1], weight_format, channel_fp8)]
    if mtp:  # an MXFP4 checkpoint's MTP layer loads dequantized
        abstracts.append((model.abstract_mtp(cfg, jnp.dtype(dtype))[1],
                          "model_dtype" if weight_format == "mxfp4" else weight_format, False))
    for abstract, leaf_format, per_channel in abstracts:
        abstract = nnx.to_pure_dict(abstract)
        specs = model.param_specs(cfg, abstract, expert_parallel=parallel.enable_expert_parallel)
        weights += weight_bytes_per_rank(abstract, specs, parallel, leaf_format, per_channel)
    itemsize, layers = np.dtype(dtype).itemsize, kv_layers(cfg, int(mtp))
    per_token, tokens, listed = {}, {}, set()
    for formats in CACHE_FORMAT_PAIRS:
        if formats.latent == "fp8" and cfg.kv_lora_rank % FP8_BLOCK:
            continue
        pools = tuple((pool.name, pool.format) for pool in architecture.of(cfg).attention.cache_pools(cfg, formats))
        if pools in listed:  # a variant without an index pool: one row per latent format
            continue
        listed.add(pools)
        per_token[formats] = kv_bytes_per_token(cfg, formats, itemsize=itemsize, layers=layers)
        pages = pool_pages(device_bytes * gpu_memory_utilization - weights, cfg, formats, page_size=page_size,
                           itemsize=itemsize, max_num_seqs=max_num_seqs, layers=layers)
        tokens[formats] = max(pages, 0) * page_size * parallel.dcp
    return MemoryPlan(parallel, weight_format, weights, per_token, device_bytes, gpu_memory_utilization, tokens, mtp,
                      channel_fp8)


def _check_mxfp4_split(cfg: ModelConfig, parallel: ParallelConfig) -> None:
    """ValueError unless the routed experts' input widths (D for gate / up, F or F/tp for down) are whole MXFP4
    scale blocks on every rank (what the loader refuses otherwise)."""
    down_depth = cfg.moe_intermediate_size // (1 if parallel.enable_expert_parallel else parallel.tp)
    bad = {name: width for name, width in (("hidden_size", cfg.hidden_size), ("a rank's moe_intermediate_size",
                                                                              down_depth)) if width % MX_BLOCK}
    if bad:
        raise ValueError(f"weight_format='mxfp4': {bad} not a multiple of {MX_BLOCK} (an expert's input slice must "
                         f"be whole scale blocks) on tp={parallel.tp}")


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def format_plan(plan: MemoryPlan, name: str) -> str:
    """The plan as the CLI prints it: a row per cache format of the variant's pools (latent and index for DSA, the
    latent alone for dense MLA)."""
    p, mxfp4 = plan.parallel, plan.weight_format == "mxfp4"
    pool_names = list(next(iter(plan.kv_bytes_per_token.values())))
    lines = [f"{name} on tp={p.tp}{' (expert parallel)' if p.enable_expert_parallel else ''} dcp={p.dcp}, "
             f"weights in {plan.weight_format}{' (the routed experts; the rest in the model dtype)' if mxfp4 else ''}"
             f"{'; ptpc_fp8: the linear layers but the experts in per-channel fp8' if plan.channel_fp8 else ''}"
             f"{', with the MTP layer (drafting)' if plan.mtp else ''}",
             f"  weights per rank: {_size(plan.weight_bytes)}",
             f"  device memory: {_size(plan.device_bytes)} x gpu_memory_utilization {plan.gpu_memory_utilization}",
             f"  {'/'.join(pool_names) + ' cache':<20}{'B/token on its rank':>22}"
             f"{'(' + ' + '.join(pool_names) + ')':>22}"
             f"{'B/context token/rank':>22}{'context tokens fit':>20}"]
    for formats, sizes in plan.kv_bytes_per_token.items():
        total = sum(sizes.values())
        parts = "(" + " + ".join(f"{size:,}" for size in sizes.values()) + ")"
        label = "/".join(formats.latent if pool == "latent" else formats.index for pool in sizes)
        lines.append(f"  {label:<20}{total:>22,}{parts:>22}"
                     f"{total / p.dcp:>22,.0f}{plan.pool_tokens[formats]:>20,}")
    return "\n".join(lines)
