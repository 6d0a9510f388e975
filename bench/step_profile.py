"""The step-efficiency profile of `dcp-jax bench decode --profile` (issue 56): the roofline of one decode step, the
device time of a profiler trace of it by kernel category, and their table.

The roofline of a step of B decode rows of L tokens, on one rank (TP = DCP = W, as bench_decode runs it; W splits
each row's tokens and the weights, every rank attends with all heads):
- bytes: every weight read once except the embedding table (a gather of B rows), at its stored size (block-fp8
  values and their scales); the routed experts at the share that B rows touch, 1 - (1 - k/X)^B under uniform
  routing (every expert from B = 256 on, k of X at B = 1); per layer, the index keys of B x L/W tokens and the
  K' = min(L, topk)/W selected latents of each row (dense MLA: no index keys, K' = L/W, every latent a rank holds),
  in the cache formats' bytes per token (scales included);
- FLOPs: 2 B per weight element a row multiplies (the GEMMs; routed experts at k/X of theirs); per layer, the
  indexer's scores 2 B (L/W) I J (dense MLA: none) and MLA's 2 B H K' (C + E) + 2 B H K' C;
- time: max(bytes / same-run copy rate, FLOPs / same-run bf16 matmul rate) (`bench.common.copy_tbps`,
  `matmul_tflops`); both terms are kept. The matmul rate is bf16's: fp8 GEMMs may run up to twice as fast.
Letters: see the legend in `dcp_jax/__init__.py` (here B is the batch of decode rows, the bucket R).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from bench.common import (copy_tbps, kernel_durations_us, matmul_tflops, throughput_seconds, traced_device_events,
                          warm_up_clocks)
from dcp_jax.config import ModelConfig

# Kernel categories of a trace, in table order; "other" holds the names no rule matches.
CATEGORIES = ("GEMM", "fp8 GEMM", "grouped MoE", "indexer", "top-k", "sparse MLA", "dense MLA", "merge", "collectives",
              "copies", "other fusions", "sort", "other")
# (category, name fragments) in the order they are tried; names are lowercased first. The project's kernels go
# first, by the names traces show: a Pallas-Triton kernel's `name=`, a Mosaic GPU kernel's body function +
# "_mosaic_gpu_kernel". Then vendor libraries' and XLA's kernels.
_RULES = (
    ("indexer", ("indexer_logits",)),  # Triton indexer_logits_block_t_..., Mosaic indexer_logits_mosaic_...
    ("top-k", ("topk",)),  # topk_maxima_ / topk_floor_ / topk_candidates_ / topk_select_
    # Mosaic sparse MLA's body is `entry` (pallas_kernels/_sparse_mla_mosaic.py); Triton sparse_mla_decode_...
    ("sparse MLA", ("sparse_mla", "entry_mosaic_gpu")),
    ("dense MLA", ("mla_decode",)),  # Triton mla_decode_...
    ("merge", ("merge_splits",)),  # the Triton split-k combine of sparse MLA
    # Mosaic fp8_gemm_mosaic; cuBLAS and CUTLASS name fp8 kernels by their e4m3 operands. An fp8 GEMM that the
    # Mosaic kernel does not take runs as a one-group Triton grouped_matmul_fp8: counted as grouped MoE.
    ("fp8 GEMM", ("fp8_gemm", "e4m3")),
    ("grouped MoE", ("grouped_matmul", "ragged")),
    ("collectives", ("nccl", "all-gather", "all_gather", "all-reduce", "all_reduce", "reduce-scatter",
                     "reduce_scatter", "all-to-all", "all_to_all")),
    ("sort", ("sort", "radix")),  # XLA's sort_10_1, CUB's DeviceRadixSort / DeviceSegmentedRadixSort
    ("copies", ("memcpy", "memset", "copy")),
    ("GEMM", ("gemm", "nvjet", "xmma", "cutlass", "cublas")),  # XLA's Triton GEMM fusions are gemm_fusion_dot_...
    ("other fusions", ("fusion", "loop_", "input_", "wrapped_")),
)
# Top kernels' names cut to this many characters, as the kernel benches do: long names that differ only at the
# end count as one kernel.
NAME_CHARS = 60
TOP_KERNELS = 10


def kernel_category(name: str) -> str:
    """The category (one of `CATEGORIES`) of a GPU kernel named `name` in a profiler trace."""
    lowered = name.lower()
    for category, fragments in _RULES:
        if any(fragment in lowered for fragment in fragments):
            return category
    return "other"


def kernel_time(durations_us: dict[str, list[float]], *, calls: int, ranks: int,
                top: int = TOP_KERNELS) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """({category: us per step and rank}, the `top` kernels as (name cut to `NAME_CHARS`, us per step and rank),
    most first) of the durations of `calls` steps on `ranks` devices (`bench.common.kernel_durations_us`);
    categories that took no time are left out, the rest in `CATEGORIES` order."""
    by_category = dict.fromkeys(CATEGORIES, 0.0)
    by_name: dict[str, float] = {}
    for name, durations in durations_us.items():
        us = sum(durations) / (calls * ranks)
        by_category[kernel_category(name)] += us
        by_name[name[:NAME_CHARS]] = by_name.get(name[:NAME_CHARS], 0.0) + us
    ranked = sorted(by_name.items(), key=lambda item: -item[1])[:top]
    return {c: us for c, us in by_category.items() if us > 0}, ranked


def traced_kernel_time(run_step: Callable[[], object], *, calls: int, ranks: int) -> dict:
    """The row fields of a profiler trace of `calls` calls of `run_step()` (each waited for): has_device_trace,
    and with a GPU in the trace kernel_us (`kernel_time`'s categories), kernel_busy_us (their sum) and
    top_kernels ([name, us] pairs), all per step and rank. A trace without GPU lines (a CPU run) gives only
    has_device_trace = False."""
    lines = traced_device_events(run_step, (), calls)
    durations = kernel_durations_us(lines, line_prefix="Stream")
    if not durations:
        return dict(has_device_trace=False)
    categories, ranked = kernel_time(durations, calls=calls, ranks=ranks)
    return dict(has_device_trace=True, kernel_us=categories, kernel_busy_us=sum(categories.values()),
                top_kernels=[[name, us] for name, us in ranked])


def measure_ceilings(copy_bytes: int, matmul_size: int) -> tuple[float, float]:
    """Same-run (copy TB/s over `copy_bytes`, bf16 matmul TFLOP/s of `matmul_size`^3), timed back to back
    (`bench.common.throughput_seconds`) as the step's device time is; a GPU's clocks are woken first."""
    if jax.default_backend() == "gpu":
        warm_up_clocks()
    return copy_tbps(copy_bytes, throughput_seconds), matmul_tflops(throughput_seconds, n=matmul_size)


@dataclasses.dataclass(frozen=True)
class Roofline:
    """One decode step's roofline on one rank: its terms (module docstring) and the same-run rates."""

    weight_bytes: float
    index_key_bytes: int
    latent_bytes: int
    gemm_flops: float
    indexer_flops: int
    sparse_mla_flops: int
    copy_tbps: float
    matmul_tflops: float

    @property
    def bytes_ms(self) -> float:
        return (self.weight_bytes + self.index_key_bytes + self.latent_bytes) / self.copy_tbps * 1e-9

    @property
    def flops_ms(self) -> float:
        return (self.gemm_flops + self.indexer_flops + self.sparse_mla_flops) / self.matmul_tflops * 1e-9

    @property
    def ms(self) -> float:
        return max(self.bytes_ms, self.flops_ms)

    def as_row(self) -> dict:
        return dataclasses.asdict(self) | dict(bytes_ms=self.bytes_ms, flops_ms=self.flops_ms, roofline_ms=self.ms)


def routed_expert_share(cfg: ModelConfig, batch: int) -> float:
    """The expected share of the routed experts that `batch` rows touch, each row routed to k of X uniformly:
    1 - (1 - k/X)^B (k/X at B = 1; 0.87 at B = 64 and 1.00 at B = 256 for 8 of 256)."""
    return 1 - (1 - cfg.num_experts_per_tok / cfg.n_routed_experts) ** batch


def _key_name(key) -> str:
    """A pytree path entry's name: a dict key, or a dataclass field (an fp8 weight's values / scales)."""
    return str(getattr(key, "key", getattr(key, "name", key)))


def weight_traffic(params, cfg: ModelConfig, batch: int) -> tuple[float, float]:
    """(bytes one rank reads, weight elements one row multiplies on it) of the placed parameters `params` in a step
    of `batch` rows: every leaf's shard but the embedding table's, the routed experts' (`experts_*`) bytes at
    `routed_expert_share` and their elements at k/X; fp8 and MXFP4 scales count as bytes, not as elements."""
    nbytes = elements = 0.0
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        names = [_key_name(key) for key in path]
        if names[0] == "embed":
            continue
        shard = leaf.addressable_shards[0].data
        is_routed = any(name.startswith("experts_") for name in names)
        nbytes += shard.nbytes * (routed_expert_share(cfg, batch) if is_routed else 1)
        if names[-1] != "scales":  # MXFP4 codes: two weights a byte
            elements += shard.size * (2 if names[-1] == "packed" else 1) * (
                cfg.num_experts_per_tok / cfg.n_routed_experts if is_routed else 1)
    return nbytes, elements


def roofline(cfg: ModelConfig, params, *, batch: int, context: int, dcp: int, latent_token_bytes: int,
             index_token_bytes: int, copy_tbps: float, matmul_tflops: float) -> Roofline:
    """The roofline of one rank's decode step of `batch` rows of `context` tokens at DCP size `dcp` (module
    docstring), `params` placed as the step runs them, the caches' bytes per token of one layer."""
    layers, indexer = cfg.num_hidden_layers, cfg.indexer
    # The layers that score index keys: all of a DSA model's but IndexShare's shared ones.
    scoring = sum(not cfg.shares_index_selection(layer) for layer in range(layers))
    tokens = -(-context // dcp)  # a row's tokens one rank holds
    # The ones it attends: the selected (DSA), or all of them (dense MLA, which scores no index key).
    selected = tokens if indexer is None else -(-min(context, indexer.topk) // dcp)
    scored = 0 if indexer is None else tokens
    weight_bytes, weight_elements = weight_traffic(params, cfg, batch)
    return Roofline(
        weight_bytes=weight_bytes,
        index_key_bytes=scoring * batch * scored * index_token_bytes,
        latent_bytes=layers * batch * selected * latent_token_bytes,
        gemm_flops=2 * batch * weight_elements,
        indexer_flops=0 if indexer is None else scoring * 2 * batch * tokens * indexer.heads * indexer.head_dim,
        sparse_mla_flops=layers * 2 * batch * cfg.num_attention_heads * selected
        * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim),  # scores over C + E, values over C
        copy_tbps=copy_tbps, matmul_tflops=matmul_tflops)


# ---- the table -----------------------------------------------------------------------------------------------


def is_profiled(row: dict) -> bool:
    return row.get("kind") == "point" and "roofline_ms" in row


def _config(row: dict) -> str:
    weights = "block-fp8" if row["weight_format"] == "fp8" else {"bfloat16": "bf16"}.get(row["dtype"], row["dtype"])
    if row["weight_format"] == "mxfp4":
        weights = f"MXFP4 experts + {'ptpc_fp8' if row.get('channel_fp8') else weights}"
    elif row.get("channel_fp8"):
        weights = f"ptpc_fp8 (experts {weights})"
    return (f"{row['layers']} layers ({row['moe_layers']} MoE), {weights} weights, "
            f"{row['index_cache']}/{row['latent_cache']} index/latent cache, dcp {row['dcp']}")


def _context(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


HEADER = ("| config | B | L | step ms | roofline ms (bytes / FLOPs) | ratio | GB: weights + index-K + latents | "
          "copy TB/s, matmul TFLOP/s | kernel us per step (top categories) |\n|" + "---|" * 9)


def table_row(row: dict) -> str:
    """One profiled point as a row of the table under `HEADER`: step = the program alone back to back (device_ms),
    roofline = max(bytes, FLOPs) per rank, ratio = step / roofline, the same-run rates."""
    if row["has_device_trace"]:
        ranked = sorted(row["kernel_us"].items(), key=lambda item: -item[1])[:4]
        kernels = f"busy {row['kernel_busy_us']:.0f}: " + ", ".join(f"{c} {us:.0f}" for c, us in ranked)
    else:
        kernels = "no device trace"
    return (f"| {_config(row)} | {row['batch']} | {_context(row['context'])} | {row['device_ms']:.3f} | "
            f"{row['roofline_ms']:.3f} ({row['bytes_ms']:.3f} / {row['flops_ms']:.3f}) | "
            f"{row['roofline_ratio']:.2f}x | {row['weight_bytes'] / 1e9:.2f} + {row['index_key_bytes'] / 1e9:.2f} + "
            f"{row['latent_bytes'] / 1e9:.2f} | {row['copy_tbps']:.2f}, {row['matmul_tflops']:.0f} | {kernels} |")


def report(rows: list[dict]) -> str:
    """The step-efficiency table of the profiled points of `rows` (each names its own config, so rows of several
    runs merge), then each point's top kernels; empty without profiled points."""
    points = [r for r in rows if is_profiled(r)]
    if not points:
        return ""
    lines = [HEADER] + [table_row(r) for r in points]
    for r in points:
        if r["has_device_trace"]:
            lines.append(f"top kernels, us per step, {_config(r)}, B={r['batch']} L={_context(r['context'])}: "
                         + "; ".join(f"{name} {us:.0f}" for name, us in r["top_kernels"]))
    return "\n".join(lines)
