"""dcp-jax: MLA models with decode context parallelism (DCP) in JAX and Pallas, born from DeepSeek-V3.2's sparse
attention (DSA) decode.

Packages: `host/` (numpy only: layout, step metadata, pages, scheduler, sampling parameters), `model/` (the
architecture registry and its model files, attention variants, mesh, KV pools, weights), `runtime/` (the step
context, the compiled steps and the runner), `serving/` (engine arguments, the core, `Engine`, `LLM`, the server).
`from dcp_jax import LLM, SamplingParams` works; the names load lazily so `import dcp_jax` stays free of jax.

The letters of shapes and einsums, one meaning each (every module points here; a size without a letter is spelled
out: layers, pages, splits, slots):

| letter | meaning |
|---|---|
| A | vocabulary size |
| B | page size: tokens one rank holds per page (a virtual block holds B * W) |
| C | kv_lora_rank: the MLA latent |
| D | hidden size |
| E | qk_rope_head_dim: the roped part of a query or key |
| F | an MLP's or an expert's width |
| G | sample groups of a step (one per sequence; G = M) |
| H | attention heads (h: a rank's) |
| I | indexer heads |
| J | indexer head dim |
| K | index top-k: the tokens a row attends |
| L | a sequence's context length (global tokens) |
| M | sequences of a step (the bucket's sequence width) |
| N | qk_nope_head_dim: the unroped part of a query or key |
| O | draft offsets of the MTP layer's chained passes (2 x drafts - 1) |
| P | virtual blocks of a sequence (a block table's width) |
| Q | q_lora_rank |
| R | query rows of a step (the bucket) |
| S | DCP interleave: consecutive tokens a rank holds in turn |
| T | tokens of one row's history (key positions) |
| U | sampled rows of a step (M x the sample group's width) |
| V | v_head_dim |
| W | DCP size: the ranks of a DCP group |
| X | routed experts (x: a rank's) |
| Y | query rows of one sequence in a dense MLA call (`pallas_kernels.mla_decode`: 1 at decode, n + 1 for MTP) |

Lowercase: h a rank's heads, x a rank's experts, k the experts a row is routed to, n a request's drafts
(num_speculative_tokens).
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
