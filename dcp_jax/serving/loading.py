"""Build a ready model runner from a preset name, a shipped checkpoint's name or an HF checkpoint directory (shared
by LLM and Engine)."""

from __future__ import annotations

import dataclasses
import logging
import os

from dcp_jax.config import (KERNEL_CHOICES, ONLINE_FP8_BLOCK, PRESETS, QUANTIZATION_CHOICES, EngineConfig, ModelConfig,
                            ParallelConfig, kv_layers, model_directory, num_speculative_tokens, preset, resolve_dtype,
                            unknown_model)
from dcp_jax.host.layout import DcpLayout
from dcp_jax.host.sampling import MAX_LOGPROBS
from dcp_jax.model import architecture
from dcp_jax.model.attention.variant import CacheFormats
from dcp_jax.runtime.multihost import Distributed, initialize
from dcp_jax.serving.engine_args import EngineArgs
from dcp_jax.serving.generation_config import sampling_defaults
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


def pool_pages_from_memory(cfg: ModelConfig, layout: DcpLayout, formats: CacheFormats, *, dtype: str,
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
    pages = pool_pages(budget, cfg, formats, page_size=layout.page_size, itemsize=itemsize, max_num_seqs=max_num_seqs,
                       layers=layers)
    if pages < 1:
        raise ValueError(f"no KV page fits: {budget / 2**30:.1f} GiB left at gpu_memory_utilization="
                         f"{gpu_memory_utilization} after the weights")
    per_token = sum(kv_bytes_per_token(cfg, formats, itemsize=itemsize, layers=layers).values())
    log.info("KV pool from memory: %d pages = %d tokens over dcp=%d (%.1f GiB per rank)", pages,
             pages * layout.tokens_per_block, layout.dcp_size, pages * layout.page_size * per_token / 2**30)
    return pages


def load_model(args: EngineArgs, *, distributed: Distributed | None = None) -> LoadedModel:
    """Validate `args` (`EngineArgs`: every option's meaning is documented there), then load weights (an HF
    directory) or draw random ones (a preset), placed on a (tp/dcp, dcp) mesh; on CPU `tp` simulated devices are
    used. The architecture comes from config.json (`model/architecture.py`): one this engine does not run, or a
    config field it does not implement, is refused before any weight is read. `max_model_len` None: the model's
    max_position_embeddings, capped by the pool (`resolve_max_model_len`). `num_pages` None: what fits
    gpu_memory_utilization of a GPU's memory after the weights (`pool_pages_from_memory`), else (no memory
    statistics: CPU) max_num_seqs requests of max_model_len. `distributed` (`multihost.Distributed`): this process
    is one of a multi-host deployment, the mesh over every process's devices (tp / num_processes each)."""
    parallel = ParallelConfig(tp=args.tensor_parallel_size, dcp=args.dcp, interleave=args.interleave,
                              enable_expert_parallel=args.enable_expert_parallel)
    layout = DcpLayout(parallel.dcp, parallel.interleave, args.page_size)
    if args.kernels not in KERNEL_CHOICES:
        raise ValueError(f"unknown kernels {args.kernels!r}; choose from {KERNEL_CHOICES}")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization={args.gpu_memory_utilization} must be in (0, 1]")
    drafts = num_speculative_tokens(args.speculative_config)
    if not args.max_num_seqs * (drafts + 1) <= args.max_num_batched_tokens:
        raise ValueError(f"max_num_batched_tokens={args.max_num_batched_tokens} must be >= max_num_seqs="
                         f"{args.max_num_seqs} x {drafts + 1} (every running request may decode in one step, with "
                         f"its drafts)")
    model, num_layers = args.model, args.num_layers
    directory = model_directory(model)
    is_dir = directory is not None
    if not is_dir and model not in PRESETS:
        raise ValueError(unknown_model(model))
    if args.tokenizer is not None and not os.path.isdir(args.tokenizer):
        raise ValueError(f"tokenizer {args.tokenizer!r} is not a directory (a HF tokenizer's: tokenizer.json)")
    if not 0 <= args.max_logprobs <= MAX_LOGPROBS:
        raise ValueError(f"max_logprobs={args.max_logprobs} must be in [0, {MAX_LOGPROBS}]")
    sampling_defaults(args.generation_config, directory)  # refused here, before any weight loads
    cfg = architecture.config_from_hf(directory) if is_dir else preset(model, num_layers=num_layers)
    cfg = architecture.with_hf_overrides(cfg, args.hf_overrides)
    if is_dir and num_layers is not None:
        if not 1 <= num_layers <= cfg.num_hidden_layers:
            raise ValueError(f"{num_layers=} must be in [1, {cfg.num_hidden_layers}] (the checkpoint's layers)")
        cfg = dataclasses.replace(cfg, num_hidden_layers=num_layers)
    if drafts and cfg.num_nextn_predict_layers < 1:
        raise ValueError(f"speculative_config: model {model!r} has no MTP layer (num_nextn_predict_layers is 0)")
    if drafts and is_dir and num_layers is not None:
        raise ValueError("speculative_config: a checkpoint cut to num_layers has no MTP layer after its last layer")
    dtype = resolve_dtype(args.dtype, cfg)
    if args.quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization={args.quantization!r} must be one of {QUANTIZATION_CHOICES}")
    formats = CacheFormats(args.latent_cache_format, args.index_cache_format)
    if args.num_pages is not None:
        resolve_max_model_len(cfg, layout, args.max_model_len, args.num_pages)  # refuse a bad length before any load
    processes = 1 if distributed is None else distributed.num_processes
    if parallel.tp % processes:
        raise ValueError(f"tp={parallel.tp} must split evenly over num_processes={processes} (each process holds "
                         f"tp / num_processes devices of the mesh)")
    use_cpu_devices(parallel.tp // processes)
    initialize(distributed)
    import jax
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():  # the allocator reads its share when the backend starts
        os.environ.setdefault(MEM_FRACTION, str(args.gpu_memory_utilization))
    if args.compilation_cache:  # a restart reuses the compiled programs
        jax.config.update("jax_compilation_cache_dir", os.fspath(args.compilation_cache))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from dcp_jax.model.fp8_linear import is_fp8, quantize_channels_params, quantize_params
    from dcp_jax.model.mesh import make_mesh, sharding
    from dcp_jax.model.weights import (abstract_params, check_fp8_shardable, fp8_block_size, load_hf_params,
                                       load_mtp_params, loaded_fp8_block)
    from dcp_jax.runtime.context import kernel_backend
    from dcp_jax.runtime.runner import ModelRunner

    functions = architecture.of(cfg).model
    functions.check_divisible(cfg, parallel.tp, expert_parallel=parallel.enable_expert_parallel)
    architecture.of(cfg).attention.cache_pools(cfg, formats)  # refuses a format the model cannot take
    # ptpc_fp8 quantizes the loaded weights (`fp8_linear.quantize_channels_params`): the checkpoint loads as "auto".
    ptpc = args.quantization == "ptpc_fp8"
    quantization = "auto" if ptpc else args.quantization
    if ptpc and is_dir and fp8_block_size(directory):
        raise ValueError(f"quantization='ptpc_fp8' quantizes an unquantized checkpoint; {directory} is block fp8 "
                         f"(serve it with quantization='auto')")
    # The block of the fp8 weights the load gives (a preset's random weights are quantized under "fp8").
    block = (loaded_fp8_block(directory, quantization) if is_dir
             else ONLINE_FP8_BLOCK if quantization == "fp8" else None)
    mesh = make_mesh(parallel, deployment_devices(parallel.tp, processes) if processes > 1 else None)
    abstract = (abstract_params(cfg, directory, jnp.dtype(dtype), quantization) if is_dir  # MXFP4 experts too
                else nnx.to_pure_dict(functions.abstract_model(cfg, jnp.dtype(dtype), block)[1]))
    loaded_specs = functions.param_specs(cfg, abstract, expert_parallel=parallel.enable_expert_parallel)
    if ptpc:
        abstract = jax.eval_shape(quantize_channels_params, abstract)
    specs = functions.param_specs(cfg, abstract, expert_parallel=parallel.enable_expert_parallel)
    check_fp8_shardable(abstract, specs, mesh)  # before anything is read or drawn
    backend = kernel_backend(args.kernels)

    def per_rank(abstract_params, param_specs):
        return jax.tree.map(lambda a, spec: jax.ShapeDtypeStruct(sharding(mesh, spec).shard_shape(a.shape), a.dtype),
                            abstract_params, param_specs)

    functions.check_kernels(cfg, per_rank(abstract, specs), backend, jnp.dtype(dtype))
    if is_dir:
        params = load_hf_params(cfg, directory, mesh, dtype=jnp.dtype(dtype),
                                expert_parallel=parallel.enable_expert_parallel, quantization=quantization)
    else:
        params = functions.init_params(cfg, args.seed, jnp.dtype(dtype), block)
        if processes > 1:  # host values, each process placing its own shards of them
            params = jax.tree.map(np.asarray, params)
    params = jax.device_put(params, jax.tree.map(lambda spec: sharding(mesh, spec), loaded_specs))
    if ptpc:  # on the devices, each leaf's copy freed as it goes (donated)
        params = jax.jit(quantize_channels_params, donate_argnums=0,
                         out_shardings=jax.tree.map(lambda spec: sharding(mesh, spec), specs))(params)
    mtp_params = None
    if drafts:  # placed split as the decoder layers are, before the pool is sized by what is left
        if is_dir:
            mtp_params = load_mtp_params(cfg, directory, quantization)
        else:
            mtp_params = functions.init_mtp_params(cfg, args.seed + 1, jnp.dtype(dtype))
            mtp_params = mtp_params if block is None else quantize_params(mtp_params, block)
        mtp_abstract = nnx.to_pure_dict(functions.abstract_mtp(cfg, jnp.dtype(dtype), block)[1])
        mtp_params = jax.tree.map(  # fp8 weights as they are, each other leaf in its abstract leaf's dtype
            lambda a, want: a if is_fp8(a) else np.asarray(a).astype(want.dtype), mtp_params, mtp_abstract,
            is_leaf=is_fp8)
        mtp_specs = functions.param_specs(cfg, mtp_abstract, expert_parallel=parallel.enable_expert_parallel)
        check_fp8_shardable(mtp_abstract, mtp_specs, mesh)
        functions.check_kernels(cfg, per_rank(mtp_abstract, mtp_specs), backend, jnp.dtype(dtype))
        mtp_params = jax.device_put(mtp_params, jax.tree.map(lambda spec: sharding(mesh, spec), mtp_specs))
    num_pages = args.num_pages
    if num_pages is None:
        num_pages = pool_pages_from_memory(cfg, layout, formats, dtype=dtype,
                                           gpu_memory_utilization=args.gpu_memory_utilization,
                                           max_num_seqs=args.max_num_seqs, layers=kv_layers(cfg, drafts))
        if num_pages is not None and processes > 1:  # one pool size everywhere: the least any process holds
            from jax.experimental import multihost_utils

            num_pages = int(np.min(multihost_utils.process_allgather(np.int32(num_pages))))
    max_model_len = resolve_max_model_len(cfg, layout, args.max_model_len, num_pages)
    if num_pages is None:
        num_pages = args.max_num_seqs * int(layout.virtual_blocks(max_model_len))
    # No step can hold more rows than every running request's whole context: wider buckets would compile for nothing.
    max_num_batched_tokens = min(args.max_num_batched_tokens,
                                 max(args.max_num_seqs * max_model_len, args.max_num_seqs * (drafts + 1)))
    engine = EngineConfig(page_size=args.page_size, num_pages=num_pages, max_num_seqs=args.max_num_seqs,
                          max_model_len=max_model_len, bucket_ladder=tuple(args.bucket_ladder),
                          max_num_batched_tokens=max_num_batched_tokens, index_cache=formats.index,
                          latent_cache=formats.latent, num_speculative_tokens=drafts)
    log.info("max_model_len %d, %d KV pages (%d tokens), dtype %s", max_model_len, num_pages,
             num_pages * layout.tokens_per_block, dtype)
    return LoadedModel(
        name=os.path.basename(os.path.normpath(directory)) if is_dir else model,
        cfg=cfg,
        parallel=parallel,
        engine=engine,
        tokenizer=load_tokenizer(args.tokenizer or directory, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id),
        runner=ModelRunner(cfg, params, parallel, engine, mesh, backend, dtype=jnp.dtype(dtype),
                           unroll_layers=args.unroll_layers, mtp_params=mtp_params, enable_tbo=args.enable_tbo),
        backend=jax.default_backend(),
        dtype=dtype,
    )
