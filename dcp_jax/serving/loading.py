"""Build a ready model runner from a preset name, a shipped checkpoint's name or an HF checkpoint directory (shared
by LLM and Engine)."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence

from dcp_jax.config import (DEFAULT_BUCKETS, DEFAULT_MAX_NUM_BATCHED_TOKENS, KERNEL_CHOICES, ONLINE_FP8_BLOCK, PRESETS,
                            QUANTIZATION_CHOICES, EngineConfig, ModelConfig, ParallelConfig, kv_layers,
                            model_directory, num_speculative_tokens, preset, resolve_dtype, unknown_model)
from dcp_jax.host.layout import DcpLayout
from dcp_jax.runtime.multihost import Distributed, initialize
from dcp_jax.runtime.xla_flags import apply_gpu_flags, flags_not_applied
from dcp_jax.serving.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

log = logging.getLogger(__name__)
# JAX's GPU allocator takes this share of each GPU's memory (its default when unset).
MEM_FRACTION, DEFAULT_MEM_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION", 0.75


def use_cpu_devices(count: int) -> None:
    """Ask for at least `count` simulated CPU devices when jax has not started (no effect on GPUs or afterwards;
    a larger count asked for before stays)."""
    import jax

    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    try:
        jax.config.update("jax_num_cpu_devices", max(count, 1, jax.config.jax_num_cpu_devices))
    except RuntimeError:  # backends already initialized: keep what is there
        pass


def deployment_devices(tp: int, processes: int) -> list:
    """The mesh's devices: tp / processes of each process's, in process order (a host's own devices are the mesh's
    fastest axis); ValueError when a process has fewer."""
    import jax

    per_process = tp // processes
    devices = [[d for d in jax.devices() if d.process_index == p][:per_process] for p in range(processes)]
    short = [p for p, mine in enumerate(devices) if len(mine) < per_process]
    if short:
        raise ValueError(f"tp={tp} over {processes} processes needs {per_process} devices in each; process {short[0]} "
                         f"has {len(devices[short[0]])}")
    return [d for mine in devices for d in mine]


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    name: str
    cfg: ModelConfig
    parallel: ParallelConfig
    engine: EngineConfig
    tokenizer: ByteTokenizer | HFTokenizer
    runner: object  # dcp_jax.runtime.runner.ModelRunner
    backend: str
    dtype: str


def resolve_max_model_len(cfg: ModelConfig, layout: DcpLayout, max_model_len: int | None,
                          num_pages: int | None) -> int:
    """The longest request (prompt + output tokens): `max_model_len` when given, checked against the model's
    max_position_embeddings and the KV pool; else the model's max_position_embeddings, capped by what `num_pages`
    hold (one request on every page)."""
    pool_tokens = None if num_pages is None else num_pages * layout.tokens_per_block
    if max_model_len is None:
        max_model_len = cfg.max_position_embeddings
        if pool_tokens is not None and pool_tokens < max_model_len:
            log.info("max_model_len %d (the model's max_position_embeddings) capped to %d: the %d KV pages hold no "
                     "more", max_model_len, pool_tokens, num_pages)
            max_model_len = pool_tokens
        return max_model_len
    if max_model_len < 1:
        raise ValueError(f"{max_model_len=} must be >= 1")
    if max_model_len > cfg.max_position_embeddings:
        raise ValueError(f"{max_model_len=} exceeds the model's max_position_embeddings={cfg.max_position_embeddings}")
    if pool_tokens is not None and max_model_len > pool_tokens:
        raise ValueError(f"{max_model_len=} does not fit the KV pool: {num_pages=} pages of {layout.tokens_per_block} "
                         f"tokens (page_size x dcp) hold {pool_tokens} tokens")
    return max_model_len


def device_budget(stats: dict, gpu_memory_utilization: float) -> float:
    """Bytes of a GPU that gpu_memory_utilization (of its whole memory, vLLM's meaning) leaves after what is in use.
    JAX's allocator limit (`bytes_limit`) is XLA_PYTHON_CLIENT_MEM_FRACTION (default 0.75) of the memory;
    `load_model` sets that fraction to gpu_memory_utilization when the user has not."""
    fraction = float(os.environ.get(MEM_FRACTION, DEFAULT_MEM_FRACTION))
    total = stats["bytes_limit"] / fraction
    return min(stats["bytes_limit"], gpu_memory_utilization * total) - stats.get("bytes_in_use", 0)


def pool_pages_from_memory(cfg: ModelConfig, layout: DcpLayout, *, dtype: str, index_cache: str, latent_cache: str,
                           gpu_memory_utilization: float, max_num_seqs: int, layers: int | None = None) -> int | None:
    """KV pages that fit a device's memory after what is in use (the placed weights), by the memory plan's
    arithmetic (`memory_plan.pool_pages`). None when the device reports no memory statistics (CPU)."""
    import jax
    import numpy as np

    from dcp_jax.model.memory_plan import kv_bytes_per_token, pool_pages

    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    budget = device_budget(stats, gpu_memory_utilization)
    itemsize = np.dtype(dtype).itemsize
    pages = pool_pages(budget, cfg, page_size=layout.page_size, latent_cache=latent_cache, index_cache=index_cache,
                       itemsize=itemsize, max_num_seqs=max_num_seqs, layers=layers)
    if pages < 1:
        raise ValueError(f"no KV page fits: {budget / 2**30:.1f} GiB left at gpu_memory_utilization="
                         f"{gpu_memory_utilization} after the weights")
    per_token = sum(kv_bytes_per_token(cfg, latent_cache=latent_cache, index_cache=index_cache, itemsize=itemsize,
                                       layers=layers).values())
    log.info("KV pool from memory: %d pages = %d tokens over dcp=%d (%.1f GiB per rank)", pages,
             pages * layout.tokens_per_block, layout.dcp_size, pages * layout.page_size * per_token / 2**30)
    return pages


def apply_hf_overrides(cfg: ModelConfig, overrides: dict | None) -> ModelConfig:
    """`cfg` with the HF config.json fields of `overrides` replaced (read as config.json is: `rope_scaling` and
    `rope_parameters` alike replace the RoPE parameters); ValueError for a field the model config does not have or
    a value of the wrong type."""
    if overrides is None:
        return cfg
    if not isinstance(overrides, dict):
        raise ValueError(f"hf_overrides must be a JSON object of config.json fields, got {overrides!r}")
    fields = {f.name for f in dataclasses.fields(ModelConfig)} | {"rope_parameters"}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"hf_overrides: unknown config fields {unknown}; known: {sorted(fields)}")
    base = cfg.to_hf_dict()
    for name, value in overrides.items():
        if name in base and base[name] is not None and type(value) is not type(base[name]) and not (
                isinstance(base[name], float) and type(value) is int):
            raise ValueError(f"hf_overrides: {name} must be a {type(base[name]).__name__}, got {value!r}")
    overrides = dict(overrides)
    rope = overrides.pop("rope_parameters", None) or overrides.pop("rope_scaling", None)
    if rope is not None:  # config.json's RoPE block, read before any top-level rope_theta
        base["rope_parameters"] = {"rope_theta": base["rope_theta"]} | rope
    if "rope_theta" in overrides:
        base["rope_parameters"] = base["rope_parameters"] | {"rope_theta": overrides["rope_theta"]}
    return ModelConfig.from_dict(base | overrides)


def load_model(model: str = "tiny", *, dcp: int = 1, interleave: int = 1, tp: int | None = None,
               page_size: int = 16, num_pages: int | None = None, max_num_seqs: int = 8,
               max_model_len: int | None = None, bucket_ladder: Sequence[int] = DEFAULT_BUCKETS,
               kernels: str = "auto", seed: int = 0, num_layers: int | None = None, index_cache: str = "exact",
               latent_cache: str = "exact", dtype: str = "auto", gpu_memory_utilization: float = 0.9,
               max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
               enable_expert_parallel: bool = False, quantization: str = "auto",
               unroll_layers: bool = False, hf_overrides: dict | None = None,
               speculative_config: dict | None = None, enable_tbo: bool = False,
               distributed: Distributed | None = None) -> LoadedModel:
    """Validate the arguments, then load weights (an HF directory) or draw random ones (a preset), placed on a
    (tp/dcp, dcp) mesh; on CPU `tp` simulated devices are used. `dtype` (`config.DTYPE_CHOICES`): the weights',
    activations' and exact caches' dtype; auto is the checkpoint's (bfloat16 for presets). `max_model_len` None:
    the model's max_position_embeddings, capped by the pool (`resolve_max_model_len`). `num_pages` None: what fits
    gpu_memory_utilization of a GPU's memory after the weights (`pool_pages_from_memory`), else (no memory
    statistics: CPU) max_num_seqs requests of max_model_len. Index keys in format `index_cache`
    (`config.INDEX_CACHE_FORMATS`), latents in format `latent_cache` (`config.LATENT_CACHE_FORMATS`). `num_layers`
    keeps only the first decoder layers (of a preset or of the checkpoint); `max_num_batched_tokens` the rows (decode
    rows and prefill-chunk tokens) of a step at most (`EngineConfig`); `enable_expert_parallel` splits the routed
    experts whole over the tp ranks instead of along their width (`ParallelConfig`). `quantization`
    (`config.QUANTIZATION_CHOICES`): auto keeps a block fp8 checkpoint's fp8 weights in fp8 (`dtype` stays the
    activations' and the rest's), none dequantizes them into `dtype`, fp8 also quantizes an unquantized checkpoint's
    or a preset's linear weights to block fp8 on load. `hf_overrides` (vLLM's name): config.json
    fields replaced before anything loads (`apply_hf_overrides`), e.g. {"index_topk": 16384} attends densely up
    to 16K tokens. `speculative_config` (vLLM's): {"method": "mtp", "num_speculative_tokens": N} drafts with the
    model's MTP layer (`config.num_speculative_tokens`; a checkpoint's, or a preset's random one). `enable_tbo`
    (two-batch overlap): each layer's attention runs as two micro-batches of the step's rows, one's collectives
    beside the other's compute (`sparse_dcp.sparse_dcp_attention`). `distributed` (`multihost.Distributed`): this
    process is one of a multi-host deployment, the mesh over every process's devices (tp / num_processes each)."""
    parallel = ParallelConfig(tp=dcp if tp is None else tp, dcp=dcp, interleave=interleave,
                              enable_expert_parallel=enable_expert_parallel)
    layout = DcpLayout(parallel.dcp, parallel.interleave, page_size)
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"unknown kernels {kernels!r}; choose from {KERNEL_CHOICES}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization} must be in (0, 1]")
    drafts = num_speculative_tokens(speculative_config)
    if not max_num_seqs * (drafts + 1) <= max_num_batched_tokens:
        raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} must be >= max_num_seqs={max_num_seqs} x "
                         f"{drafts + 1} (every running request may decode in one step, with its drafts)")
    directory = model_directory(model)
    is_dir = directory is not None
    if not is_dir and model not in PRESETS:
        raise ValueError(unknown_model(model))
    cfg = ModelConfig.from_hf(directory) if is_dir else preset(model, num_layers=num_layers)
    cfg = apply_hf_overrides(cfg, hf_overrides)
    if is_dir and num_layers is not None:
        if not 1 <= num_layers <= cfg.num_hidden_layers:
            raise ValueError(f"{num_layers=} must be in [1, {cfg.num_hidden_layers}] (the checkpoint's layers)")
        cfg = dataclasses.replace(cfg, num_hidden_layers=num_layers)
    if drafts and cfg.num_nextn_predict_layers < 1:
        raise ValueError(f"speculative_config: model {model!r} has no MTP layer (num_nextn_predict_layers is 0)")
    if drafts and is_dir and num_layers is not None:
        raise ValueError("speculative_config: a checkpoint cut to num_layers has no MTP layer after its last layer")
    dtype = resolve_dtype(dtype, cfg)
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization={quantization!r} must be one of {QUANTIZATION_CHOICES}")
    if num_pages is not None:
        resolve_max_model_len(cfg, layout, max_model_len, num_pages)  # refuse a bad length before any load
    processes = 1 if distributed is None else distributed.num_processes
    if parallel.tp % processes:
        raise ValueError(f"tp={parallel.tp} must split evenly over num_processes={processes} (each process holds "
                         f"tp / num_processes devices of the mesh)")
    use_cpu_devices(parallel.tp // processes)
    initialize(distributed)
    import jax
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():  # the allocator reads its share when the backend starts
        os.environ.setdefault(MEM_FRACTION, str(gpu_memory_utilization))
    if not apply_gpu_flags() and (why := flags_not_applied(jax.default_backend(), unroll_layers=unroll_layers)):
        log.warning(why)
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from dcp_jax.model.attention.cache_formats import check_latent_format
    from dcp_jax.model.attention.sparse_dcp import kernel_backend
    from dcp_jax.model.deepseek_v32 import abstract_model, check_divisible, init_params, param_specs
    from dcp_jax.model.fp8_linear import is_fp8, quantize_params
    from dcp_jax.model.mesh import make_mesh, sharding
    from dcp_jax.model.mtp import abstract_mtp, init_mtp_params
    from dcp_jax.model.weights import check_fp8_shardable, load_hf_params, load_mtp_params, loaded_fp8_block
    from dcp_jax.runtime.runner import ModelRunner

    check_divisible(cfg, parallel.tp, expert_parallel=enable_expert_parallel)
    check_latent_format(latent_cache, cfg)
    # The block of the fp8 weights the load gives (a preset's random weights are quantized under "fp8").
    block = loaded_fp8_block(directory, quantization) if is_dir else ONLINE_FP8_BLOCK if quantization == "fp8" else None
    mesh = make_mesh(parallel, deployment_devices(parallel.tp, processes) if processes > 1 else None)
    abstract = nnx.to_pure_dict(abstract_model(cfg, jnp.dtype(dtype), block)[1])
    specs = param_specs(abstract, expert_parallel=enable_expert_parallel)
    check_fp8_shardable(abstract, specs, mesh)  # before anything is read or drawn
    if is_dir:
        params = load_hf_params(cfg, directory, mesh, dtype=jnp.dtype(dtype), expert_parallel=enable_expert_parallel,
                                quantization=quantization)
    else:
        params = init_params(cfg, seed, jnp.dtype(dtype), block)
        if processes > 1:  # host values, each process placing its own shards of them
            params = jax.tree.map(np.asarray, params)
    params = jax.device_put(params, jax.tree.map(lambda spec: sharding(mesh, spec), specs))
    mtp_params = None
    if drafts:  # placed split as the decoder layers are, before the pool is sized by what is left
        if is_dir:
            mtp_params = load_mtp_params(cfg, directory, quantization)
        else:
            mtp_params = init_mtp_params(cfg, seed + 1, jnp.dtype(dtype))
            mtp_params = mtp_params if block is None else quantize_params(mtp_params, block)
        mtp_abstract = nnx.to_pure_dict(abstract_mtp(cfg, jnp.dtype(dtype), block)[1])
        mtp_params = jax.tree.map(  # fp8 weights as they are, each other leaf in its abstract leaf's dtype
            lambda a, want: a if is_fp8(a) else np.asarray(a).astype(want.dtype), mtp_params, mtp_abstract,
            is_leaf=is_fp8)
        mtp_specs = param_specs(mtp_abstract, expert_parallel=enable_expert_parallel)
        check_fp8_shardable(mtp_abstract, mtp_specs, mesh)
        mtp_params = jax.device_put(mtp_params, jax.tree.map(lambda spec: sharding(mesh, spec), mtp_specs))
    if num_pages is None:
        num_pages = pool_pages_from_memory(cfg, layout, dtype=dtype, index_cache=index_cache,
                                           latent_cache=latent_cache, gpu_memory_utilization=gpu_memory_utilization,
                                           max_num_seqs=max_num_seqs,
                                           layers=kv_layers(cfg, drafts))
        if num_pages is not None and processes > 1:  # one pool size everywhere: the least any process holds
            from jax.experimental import multihost_utils

            num_pages = int(np.min(multihost_utils.process_allgather(np.int32(num_pages))))
    max_model_len = resolve_max_model_len(cfg, layout, max_model_len, num_pages)
    if num_pages is None:
        num_pages = max_num_seqs * int(layout.virtual_blocks(max_model_len))
    engine = EngineConfig(page_size=page_size, num_pages=num_pages, max_num_seqs=max_num_seqs,
                          max_model_len=max_model_len, bucket_ladder=tuple(bucket_ladder),
                          max_num_batched_tokens=max_num_batched_tokens, index_cache=index_cache,
                          latent_cache=latent_cache, num_speculative_tokens=drafts)
    log.info("max_model_len %d, %d KV pages (%d tokens), dtype %s", max_model_len, num_pages,
             num_pages * layout.tokens_per_block, dtype)
    return LoadedModel(
        name=os.path.basename(os.path.normpath(directory)) if is_dir else model,
        cfg=cfg,
        parallel=parallel,
        engine=engine,
        tokenizer=load_tokenizer(directory, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id),
        runner=ModelRunner(cfg, params, parallel, engine, mesh, kernel_backend(kernels), dtype=jnp.dtype(dtype),
                           unroll_layers=unroll_layers, mtp_params=mtp_params, enable_tbo=enable_tbo),
        backend=jax.default_backend(),
        dtype=dtype,
    )
