"""Dense MLA under DCP, the attention variant of DeepSeek-V3 / R1 / V3.1 and Kimi-K2 (`DENSE_MLA`): one layer over
the query rows of a step, per rank (call inside shard_map over the mesh of `mesh.py`). Every row attends to all of
its tokens: each rank to the ones it holds, through the host's per-row local lengths, then the partial outputs meet
in the same log-sum-exp merge as the sparse path's. A decode row, a prefill chunk's token and an MTP verify row
differ only in the local length the host gave them (causal on global positions); a row whose rank holds none of
its tokens has length 0 there and contributes (0, -inf).

Per rank (h = H/tp local heads, W = dcp size, pages/B = this rank's KV pool):
  x [R, D] replicated; the pool "latent" [pages, B, C+E] (exact) or its `Fp8LatentCache` (`cache_formats.py`); md
  the rank's view of the step's `StepMetadata` (local_context_lens and slot_mapping [R], block_tables [M, P],
  query_seqs [R]); rope the (cos, sin) of md.positions.
`backend` names the kernels' implementation (`pallas_kernels.BACKENDS`: "pallas" or "reference").
Letters: see the legend in `dcp_jax/__init__.py`.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

import pallas_kernels
from dcp_jax.config import ModelConfig
from dcp_jax.host import arrays
from dcp_jax.host.step_metadata import StepMetadata
from dcp_jax.model.attention import cache_formats, mla_dcp
from dcp_jax.model.attention.params import MlaParams


def attend(p, q_nope, q_pe, kv_cache, md: StepMetadata, *, cfg: ModelConfig, backend: str):
    """MLA over each row's local tokens for the heads of the whole DCP group: (out [R, W*h, C], lse [R, W*h])."""
    q = cache_formats.cast_query(mla_dcp.group_queries(p, q_nope, q_pe), kv_cache)
    out, lse = pallas_kernels.mla_decode(q[:, None], kv_cache, mla_dcp.row_block_tables(md),
                                         md.local_context_lens[:, None], cfg.softmax_scale,
                                         value_dim=cfg.kv_lora_rank, backend=backend)
    return out[:, 0], lse[:, 0]


def dense_dcp_attention(p: MlaParams, x, kv_cache, rope, md: StepMetadata, *, cfg: ModelConfig, backend: str,
                        micro_batches: int = 1):
    """Returns (attention output [R, D] summed over all TP ranks, kv_cache). With `micro_batches` = 2 (two-batch
    overlap) every row's latent is written first, then the rows attend and merge as independent chains of
    consecutive rows (`mla_dcp.micro_batch_rows`), as the sparse path's do."""
    with jax.named_scope("projections"):
        _, q_nope, q_pe, kv_cache = mla_dcp.project_and_write(p, x, kv_cache, rope, md.slot_mapping, cfg=cfg,
                                                              backend=backend)
    outputs, ranges = [], mla_dcp.micro_batch_rows(x.shape[0], micro_batches)
    for index, rows in enumerate(ranges):
        with jax.named_scope(f"micro_batch_{index}") if len(ranges) > 1 else contextlib.nullcontext():
            with jax.named_scope("mla"):
                out, lse = attend(p, q_nope[rows], q_pe[rows], kv_cache, arrays.rows_view(md, rows), cfg=cfg,
                                  backend=backend)
            with jax.named_scope("merge"):
                outputs.append(mla_dcp.merge_heads(p, out, lse, x.dtype, backend=backend))
    return jnp.concatenate(outputs) if len(outputs) > 1 else outputs[0], kv_cache


class DenseMla(mla_dcp.MlaOnlyVariant):
    """DeepSeek-V3's attention: MLA over every token of the row (`dense_dcp_attention`), caching each token's latent
    ("latent")."""

    name = "mla"

    def attend(self, p, x, pools, rope, mds, *, ctx, selection):
        """The layer's output, its pools and, as the positions attended, an empty [R, 0] (every one before the row's:
        nothing selected to report)."""
        out, latent = dense_dcp_attention(p, x, pools["latent"], rope, mds["latent"], cfg=ctx.cfg,
                                          backend=ctx.backend, micro_batches=ctx.micro_batches)
        return out, dict(pools, latent=latent), jnp.zeros((x.shape[0], 0), jnp.int32)


DENSE_MLA = DenseMla()
# What the architecture registry reads (`architecture.Architecture.attention_file`).
VARIANT = DENSE_MLA
