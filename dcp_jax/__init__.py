"""dcp-jax: DeepSeek-V3.2 sparse-attention decode with decode context parallelism in JAX.

Packages: `host/` (numpy only: layout, metadata, pages, scheduler, sampling parameters), `model/` (mesh, KV cache,
weights, attention, the DeepSeek-V3.2 modules), `runtime/` (the compiled steps and the runner), `serving/` (the
core, `Engine`, `LLM`, the server). `from dcp_jax import LLM, SamplingParams` works; the names load lazily so
`import dcp_jax` stays free of jax.
"""

_LAZY = {
    "LLM": "dcp_jax.serving.llm",
    "RequestOutput": "dcp_jax.serving.llm",
    "SamplingParams": "dcp_jax.host.sampling",
    "ModelConfig": "dcp_jax.config",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dcp_jax' has no attribute {name!r}")
