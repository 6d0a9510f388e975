"""One set of engine arguments (vLLM's `EngineArgs` idea): the model, its parallel layout, its caches, the
scheduler's limits, each declared once with its one default, help, command-line flags and Python aliases. `serve`,
`generate` and `plan`, `LLM`, `Engine`, `load_model` and the benchmarks take their options from here (no jax).

Names: each field's own name (`dcp`, `tp`, `page_size`, ...) is what `LLM(...)` and `Engine(...)` take; vLLM's name
for the concept is an alias there (`decode_context_parallel_size`, `tensor_parallel_size`, `block_size`, ...), and
the command line takes vLLM's flags with the short forms the field uses (`-tp`, `-dcp`) beside the project's
(`--dcp`, `--page-size`). `--kv-cache-dtype fp8` (vLLM's and the seed's flag) puts both caches in fp8; the finer
`--latent-cache` / `--index-cache` choose each one, and win where given.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

from dcp_jax.config import (DEFAULT_BUCKETS, DEFAULT_MAX_NUM_BATCHED_TOKENS, DTYPE_CHOICES, INDEX_CACHE_FORMATS,
                            KERNEL_CHOICES, LATENT_CACHE_FORMATS, PRESETS, QUANTIZATION_CHOICES)
from dcp_jax.host.sampling import MAX_LOGPROBS

# The shipped trained retrieval model (`dcp_jax/checkpoints/dsa-tiny`, docs/training.md).
DEFAULT_MODEL = "dsa-tiny"
# vLLM's --kv-cache-dtype choices this engine runs: auto (the model dtype) or fp8 (e4m3) for both caches.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(",") if part)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not sizes or any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"sizes must be >= 1, got {text!r}")
    return sizes


def json_object(text: str) -> dict:
    """A command-line JSON object."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _arg(default, help: str, flags: Sequence[str] = (), *, aliases: Sequence[str] = (), choices=None, type=None,
         metavar=None):
    """A field of EngineArgs: its default and how the command line and the Python API name it (`flags` besides
    --the-field-name; `aliases`: vLLM's Python names)."""
    return dataclasses.field(default=default, metadata=dict(help=help, flags=tuple(flags), aliases=tuple(aliases),
                                                            choices=choices, type=type, metavar=metavar))


@dataclasses.dataclass(frozen=True)
class EngineArgs:
    """Every option of the engine (module docstring). Values are checked where they are used (`load_model`,
    `EngineConfig`, `ParallelConfig`), before anything is traced or allocated."""

    model: str = _arg(DEFAULT_MODEL, "a shipped checkpoint (dsa-tiny: trained, the default), a preset of random "
                                     f"weights ({', '.join(PRESETS)}) or a HF directory")
    tokenizer: str | None = _arg(None, "a HF directory whose tokenizer.json and chat template to use (default: the "
                                       "model's)")
    trust_remote_code: bool = _arg(False, "accepted for vLLM's launch lines: this engine runs no checkpoint code "
                                          "(the architectures it serves are built in)")
    generation_config: str = _arg("auto", "sampling defaults for what a request leaves unset: auto (the model's "
                                          "generation_config.json: temperature, top_p, top_k, min_p, "
                                          "repetition_penalty), vllm (none), or a directory holding one")
    max_logprobs: int = _arg(MAX_LOGPROBS, "most logprobs and prompt logprobs a request may ask for", type=int)
    num_layers: int | None = _arg(None, "use only the first N decoder layers (default: all)", type=int)
    seed: int = _arg(0, "weights seed of a preset; the default sampling seed", type=int)
    dtype: str = _arg("auto", "weights, activations and exact caches: auto (the checkpoint's; bfloat16 for presets)",
                      choices=DTYPE_CHOICES)
    quantization: str = _arg("auto", "auto: the checkpoint's (a block fp8 checkpoint's linear weights stay fp8); "
                                     "none: dequantize them into --dtype; fp8: also quantize an unquantized "
                                     "checkpoint's or a preset's linear weights to DeepSeek's block fp8 (128 x 128) "
                                     "on load; ptpc_fp8: the linear weights but the experts (routed and shared) to "
                                     "e4m3 with a scale per output channel, activations with one per token (vLLM's "
                                     "and ATOM's online ptpc_fp8; routed experts stay as stored, MXFP4 too)",
                             ["-q"], choices=QUANTIZATION_CHOICES)
    hf_overrides: dict | None = _arg(None, "config.json fields to replace, a JSON object (e.g. '{\"index_topk\": "
                                           "16384}')", type=json_object)
    kernels: str = _arg("auto", "auto: the Pallas kernels on a GPU, the references elsewhere; pallas (interpreted "
                                "on CPU); reference", choices=KERNEL_CHOICES)
    tp: int | None = _arg(None, "tensor-parallel ranks (default: dcp)", ["-tp", "--tensor-parallel-size"],
                          aliases=["tensor_parallel_size"], type=int)
    dcp: int = _arg(1, "decode context parallel size W: ranks that split a request's KV along tokens",
                    ["-dcp", "--decode-context-parallel-size"], aliases=["decode_context_parallel_size"], type=int)
    interleave: int = _arg(1, "DCP interleave S: consecutive tokens a rank holds in turn",
                           ["--dcp-kv-cache-interleave-size"], aliases=["dcp_kv_cache_interleave_size"], type=int)
    enable_expert_parallel: bool = _arg(False, "split the routed experts whole over the tp ranks, each running only "
                                               "the tokens routed to its experts (default: every rank runs every "
                                               "expert on its slice of their width)", ["-ep"])
    page_size: int = _arg(64, "tokens a KV page holds on each rank (a virtual block of page_size x dcp tokens)",
                          ["--block-size"], aliases=["block_size"], type=int)
    num_pages: int | None = _arg(None, "KV pages (default: what --gpu-memory-utilization leaves; CPU: max-num-seqs "
                                       "requests of max-model-len)", ["--num-gpu-blocks-override"],
                                 aliases=["num_gpu_blocks_override"], type=int)
    gpu_memory_utilization: float = _arg(0.9, "share of each GPU's memory for weights, workspace and the KV pool (the "
                                              "pool takes the rest)", type=float)
    kv_cache_dtype: str = _arg("auto", "both KV caches: auto (the model dtype) or fp8 (e4m3: the latent with an f32 "
                                       "scale per 128 columns, the index keys with one per token)",
                               choices=KV_CACHE_DTYPES)
    latent_cache: str | None = _arg(None, "MLA latent cache: exact (model dtype) or fp8 (e4m3 latent + an f32 scale "
                                          "per 128 columns, bf16 rope; kv_lora_rank a multiple of 128); default: "
                                          "--kv-cache-dtype's", choices=LATENT_CACHE_FORMATS)
    index_cache: str | None = _arg(None, "indexer key cache: exact (model dtype, HF's math) or fp8 (e4m3 keys + an "
                                         "f32 scale per token); default: --kv-cache-dtype's",
                                   choices=INDEX_CACHE_FORMATS)
    max_num_seqs: int = _arg(8, "requests decoding at once (the widest decode step)", type=int)
    max_model_len: int | None = _arg(None, "longest prompt + output (default: the model's max_position_embeddings, "
                                           "capped by the pool)", type=int)
    max_num_batched_tokens: int = _arg(DEFAULT_MAX_NUM_BATCHED_TOKENS, "rows of one step at most: its decode rows "
                                       "and prefill-chunk tokens (long prompts run in chunks); capped at "
                                       "max-num-seqs x max-model-len", type=int)
    bucket_ladder: tuple[int, ...] = _arg(DEFAULT_BUCKETS, "step widths compiled (rows), comma-separated; with "
                                          "max-num-seqs and the token budget", ["--buckets"], type=_sizes)
    enable_prefix_caching: bool = _arg(False, "reuse the KV pages of full virtual blocks a prompt shares with "
                                              "earlier requests")
    async_scheduling: bool = _arg(True, "dispatch each step before reading the previous one's tokens")
    unroll_layers: bool = _arg(False, "compile one copy of every decoder layer instead of one scan over each stack "
                                      "of layers: start-up grows with depth (docs/performance.md)")
    enable_tbo: bool = _arg(False, "two-batch overlap: each layer's attention runs as two micro-batches of the "
                                   "step's rows, one's collectives beside the other's compute")
    speculative_config: dict | None = _arg(None, "speculative decoding with the model's MTP layer, a JSON object: "
                                                 "'{\"method\": \"mtp\", \"num_speculative_tokens\": 1}' (1 to 3 "
                                                 "drafts; steps then run synchronously)", type=json_object)
    compilation_cache_dir: str | None = _arg(None, "persistent XLA compilation cache directory (default: "
                                                   "$DCP_JAX_CACHE_ROOT/xla, ~/.cache/dcp-jax/xla; "
                                                   "DCP_JAX_DISABLE_COMPILE_CACHE=1 turns it off)")
    coordinator_address: str | None = _arg(None, "multi-host: HOST:PORT of process 0 (jax.distributed's "
                                                 "coordinator; the step channel uses PORT + 1); every process runs "
                                                 "with the same arguments but --process-id")
    num_processes: int = _arg(1, "multi-host: processes of the deployment", type=int)
    process_id: int = _arg(0, "multi-host: this process (0 schedules; the others run its steps)", type=int)

    @property
    def compilation_cache(self) -> str | None:
        """The persistent compilation cache's directory: `compilation_cache_dir`, else the cache root's (vLLM's
        VLLM_CACHE_ROOT idea: $DCP_JAX_CACHE_ROOT, default ~/.cache/dcp-jax); None when
        DCP_JAX_DISABLE_COMPILE_CACHE=1 and no directory is given."""
        if self.compilation_cache_dir:
            return self.compilation_cache_dir
        if os.environ.get("DCP_JAX_DISABLE_COMPILE_CACHE", "0") not in ("", "0"):
            return None
        root = os.environ.get("DCP_JAX_CACHE_ROOT") or os.path.join(os.path.expanduser("~"), ".cache", "dcp-jax")
        return os.path.join(root, "xla")

    @property
    def tensor_parallel_size(self) -> int:
        """The TP ranks: `tp`, or `dcp` when unset."""
        return self.dcp if self.tp is None else self.tp

    @property
    def latent_cache_format(self) -> str:
        """The latent cache's format: `latent_cache`, else `kv_cache_dtype`'s."""
        return self.latent_cache or ("exact" if self.kv_cache_dtype == "auto" else "fp8")

    @property
    def index_cache_format(self) -> str:
        """The index-key cache's format: `index_cache`, else `kv_cache_dtype`'s."""
        return self.index_cache or ("exact" if self.kv_cache_dtype == "auto" else "fp8")

    def __post_init__(self):
        """ValueError naming a value outside its field's choices (the rest is checked where it is used)."""
        for f in dataclasses.fields(self):
            choices, value = f.metadata["choices"], getattr(self, f.name)
            if choices is not None and value is not None and value not in choices:
                raise ValueError(f"{f.name}={value!r} must be one of {tuple(choices)}")

    # ---- the Python API ---------------------------------------------------------------------------------------
    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineArgs:
        """EngineArgs of keyword arguments under their names or vLLM's aliases; TypeError naming an unknown one or
        a field given twice."""
        names = {f.name for f in dataclasses.fields(cls)}
        given: dict[str, Any] = {}
        for key, value in kwargs.items():
            name = key if key in names else _ALIASES.get(key)
            if name is None:
                raise TypeError(f"unknown engine argument {key!r}; the arguments are {sorted(names)} (vLLM's "
                                f"names: {sorted(_ALIASES)})")
            if name in given:
                raise TypeError(f"engine argument {name!r} given twice (as {name} and as its alias)")
            given[name] = value
        if "bucket_ladder" in given:
            given["bucket_ladder"] = tuple(given["bucket_ladder"])
        return cls(**given)

    # ---- the command line -------------------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, *, only: Iterable[str] | None = None,
                     defaults: dict[str, Any] | None = None) -> None:
        """Add the fields' flags to `parser` (`only`: those fields), each with its help and default (`defaults`
        replaces some for a command whose job differs, e.g. `plan`'s model)."""
        only = None if only is None else set(only)
        for f in dataclasses.fields(cls):
            if only is not None and f.name not in only:
                continue
            meta = f.metadata
            default = (defaults or {}).get(f.name, f.default)
            flags = ["--" + f.name.replace("_", "-"), *meta["flags"]]
            if isinstance(f.default, bool):
                parser.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                                    help=meta["help"] + f" (default: {'on' if default else 'off'})")
                continue
            parser.add_argument(*flags, dest=f.name, default=default, type=meta["type"], choices=meta["choices"],
                                help=meta["help"] + ("" if default is None else f" (default: {_shown(default)})"))

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, *, only: Iterable[str] | None = None) -> EngineArgs:
        """The EngineArgs of a parsed command line: the fields its parser has (`only`: of those, the ones it took
        from `add_cli_args`), the others at their defaults."""
        names = [f.name for f in dataclasses.fields(cls) if hasattr(args, f.name) and (only is None or f.name in only)]
        return cls(**{name: getattr(args, name) for name in names})


def _shown(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


_ALIASES = {alias: f.name for f in dataclasses.fields(EngineArgs) for alias in f.metadata["aliases"]}
