"""Build a ready model runner from a preset name or an HF checkpoint directory (shared by LLM and Engine)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from dcp_jax.config import DEFAULT_BUCKETS, EngineConfig, ModelConfig, ParallelConfig, PRESETS, preset
from dcp_jax.layout import check_layout, virtual_blocks
from dcp_jax.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer


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
    runner: object  # dcp_jax.model_step.ModelRunner
    backend: str


def load_model(model: str = "tiny", *, dcp: int = 1, interleave: int = 1, tp: int | None = None,
               page_size: int = 16, num_pages: int | None = None, max_num_seqs: int = 8, max_model_len: int = 512,
               bucket_ladder: Sequence[int] = DEFAULT_BUCKETS, kernels: str = "auto", seed: int = 0,
               num_layers: int | None = None, index_cache: str = "exact", latent_cache: str = "exact") -> LoadedModel:
    """Validate the arguments, then load weights (an HF directory) or draw random ones (a preset), placed on a
    (tp/dcp, dcp) mesh; on CPU `tp` simulated devices are used. The pool defaults to max_num_seqs full-length
    requests, its index keys in format `index_cache` (`config.INDEX_CACHE_FORMATS`) and its latents in format
    `latent_cache` (`config.LATENT_CACHE_FORMATS`). `num_layers` keeps only the first decoder layers (of a preset
    or of the checkpoint)."""
    parallel = ParallelConfig(tp=dcp if tp is None else tp, dcp=dcp, interleave=interleave)
    check_layout(parallel.dcp, parallel.interleave, page_size)
    is_dir = os.path.isdir(model)
    if not is_dir and model not in PRESETS:
        raise ValueError(f"model {model!r} is neither a directory nor a preset {sorted(PRESETS)}")
    cfg = ModelConfig.from_hf(model) if is_dir else preset(model, num_layers=num_layers)
    if is_dir and num_layers is not None:
        if not 1 <= num_layers <= cfg.num_hidden_layers:
            raise ValueError(f"{num_layers=} must be in [1, {cfg.num_hidden_layers}] (the checkpoint's layers)")
        cfg = dataclasses.replace(cfg, num_hidden_layers=num_layers)
    if max_model_len > cfg.max_position_embeddings:
        raise ValueError(f"{max_model_len=} exceeds max_position_embeddings={cfg.max_position_embeddings}")
    blocks = int(virtual_blocks(max_model_len, parallel.dcp, page_size))
    engine = EngineConfig(page_size=page_size, num_pages=num_pages or max_num_seqs * blocks,
                          max_num_seqs=max_num_seqs, max_model_len=max_model_len, bucket_ladder=tuple(bucket_ladder),
                          index_cache=index_cache, latent_cache=latent_cache)
    use_cpu_devices(parallel.tp)
    import jax

    from dcp_jax.attention import latent_format
    from dcp_jax.attention.kernels import select_kernels
    from dcp_jax.mesh import make_mesh
    from dcp_jax.model import check_divisible, init_params
    from dcp_jax.model_step import ModelRunner
    from dcp_jax.weights import load_hf_params

    check_divisible(cfg, parallel.tp)
    latent_format.check_model(latent_cache, cfg)
    kernel_set = select_kernels(kernels)
    mesh = make_mesh(parallel)
    params = load_hf_params(cfg, model, mesh) if is_dir else init_params(cfg, seed)
    return LoadedModel(
        name=os.path.basename(os.path.normpath(model)) if is_dir else model,
        cfg=cfg,
        parallel=parallel,
        engine=engine,
        tokenizer=load_tokenizer(model if is_dir else None, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id),
        runner=ModelRunner(cfg, params, parallel, engine, mesh, kernel_set),
        backend=jax.default_backend(),
    )
