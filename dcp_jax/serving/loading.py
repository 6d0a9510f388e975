"""Build a ready model runner from a preset name or an HF checkpoint directory (shared by LLM and Engine)."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence

from dcp_jax.config import (DEFAULT_BUCKETS, KERNEL_CHOICES, PRESETS, EngineConfig, ModelConfig, ParallelConfig,
                            preset)
from dcp_jax.host.layout import DcpLayout
from dcp_jax.serving.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

log = logging.getLogger(__name__)


def use_cpu_devices(count: int) -> None:
    """Ask for `count` simulated CPU devices when jax has not started (no effect on GPUs or afterwards)."""
    import jax

    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    try:
        jax.config.update("jax_num_cpu_devices", max(count, 1))
    except RuntimeError:  # backends already initialized: keep what is there
        pass


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    name: str
    cfg: ModelConfig
    parallel: ParallelConfig
    engine: EngineConfig
    tokenizer: ByteTokenizer | HFTokenizer
    runner: object  # dcp_jax.runtime.runner.ModelRunner
    backend: str


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


def load_model(model: str = "tiny", *, dcp: int = 1, interleave: int = 1, tp: int | None = None,
               page_size: int = 16, num_pages: int | None = None, max_num_seqs: int = 8,
               max_model_len: int | None = None, bucket_ladder: Sequence[int] = DEFAULT_BUCKETS,
               kernels: str = "auto", seed: int = 0, num_layers: int | None = None, index_cache: str = "exact",
               latent_cache: str = "exact") -> LoadedModel:
    """Validate the arguments, then load weights (an HF directory) or draw random ones (a preset), placed on a
    (tp/dcp, dcp) mesh; on CPU `tp` simulated devices are used. `max_model_len` None: the model's
    max_position_embeddings, capped by the pool (`resolve_max_model_len`). The pool defaults to max_num_seqs
    requests of max_model_len, its index keys in format `index_cache` (`config.INDEX_CACHE_FORMATS`) and its
    latents in format `latent_cache` (`config.LATENT_CACHE_FORMATS`). `num_layers` keeps only the first decoder
    layers (of a preset or of the checkpoint)."""
    parallel = ParallelConfig(tp=dcp if tp is None else tp, dcp=dcp, interleave=interleave)
    layout = DcpLayout(parallel.dcp, parallel.interleave, page_size)
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"unknown kernels {kernels!r}; choose from {KERNEL_CHOICES}")
    is_dir = os.path.isdir(model)
    if not is_dir and model not in PRESETS:
        raise ValueError(f"model {model!r} is neither a directory nor a preset {sorted(PRESETS)}")
    cfg = ModelConfig.from_hf(model) if is_dir else preset(model, num_layers=num_layers)
    if is_dir and num_layers is not None:
        if not 1 <= num_layers <= cfg.num_hidden_layers:
            raise ValueError(f"{num_layers=} must be in [1, {cfg.num_hidden_layers}] (the checkpoint's layers)")
        cfg = dataclasses.replace(cfg, num_hidden_layers=num_layers)
    max_model_len = resolve_max_model_len(cfg, layout, max_model_len, num_pages)
    blocks = int(layout.virtual_blocks(max_model_len))
    engine = EngineConfig(page_size=page_size, num_pages=num_pages or max_num_seqs * blocks,
                          max_num_seqs=max_num_seqs, max_model_len=max_model_len, bucket_ladder=tuple(bucket_ladder),
                          index_cache=index_cache, latent_cache=latent_cache)
    use_cpu_devices(parallel.tp)
    import jax

    from dcp_jax.model.attention.cache_formats import check_latent_format
    from dcp_jax.model.attention.decode import kernel_backend
    from dcp_jax.model.deepseek_v32 import check_divisible, init_params
    from dcp_jax.model.mesh import make_mesh
    from dcp_jax.model.weights import load_hf_params
    from dcp_jax.runtime.runner import ModelRunner

    check_divisible(cfg, parallel.tp)
    check_latent_format(latent_cache, cfg)
    mesh = make_mesh(parallel)
    params = load_hf_params(cfg, model, mesh) if is_dir else init_params(cfg, seed)
    return LoadedModel(
        name=os.path.basename(os.path.normpath(model)) if is_dir else model,
        cfg=cfg,
        parallel=parallel,
        engine=engine,
        tokenizer=load_tokenizer(model if is_dir else None, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id),
        runner=ModelRunner(cfg, params, parallel, engine, mesh, kernel_backend(kernels)),
        backend=jax.default_backend(),
    )
