"""DeepSeek-V3's multi-token-prediction (MTP) module, one depth: HF's decoder layer `num_hidden_layers` of a
checkpoint with `num_nextn_predict_layers` = 1.

Its row at position r (RoPE position r, its cache entry r) reads the main model's last hidden state of position r
after the final norm (what lm_head reads) and the embedding of token r + 1, the token the main model produced
there (zero at position 0), as vLLM and SGLang feed DeepSeek's MTP layer; each is RMS-normed (hnorm, enorm),
concatenated [embedding, hidden] and projected back to D (eh_proj); a full decoder layer of the main model's
structure (MLA with its own lightning indexer, the MoE) follows, then its own norm (HF's shared_head.norm) and the
main model's lm_head: the logits of token r + 2, one past what the main model predicts at r + 1. The embedding and
the head are the main model's (HF stores copies in the layer; `weights.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dcp_jax.config import ModelConfig
from dcp_jax.model.attention.projections import rms_norm
from dcp_jax.model.deepseek_v32 import DecoderLayer, norm_param, with_fp8_leaves
from dcp_jax.model.mlp import dense_param


class MtpLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        if cfg.num_nextn_predict_layers != 1:
            raise ValueError(f"one MTP depth is built, the config has {cfg.num_nextn_predict_layers}")
        d = cfg.hidden_size
        self.cfg = cfg
        self.enorm = norm_param(rngs, d, dtype)
        self.hnorm = norm_param(rngs, d, dtype)
        self.eh_proj = dense_param(rngs, (2 * d, d), 2 * d, dtype)
        self.layer = DecoderLayer(cfg, cfg.num_hidden_layers, rngs=rngs, dtype=dtype)
        self.head_norm = norm_param(rngs, d, dtype)

    def layer_input(self, embeddings, hidden, is_position_zero):
        """embeddings [R, D] of the tokens after the rows, hidden [R, D] the main model's final-normed states at
        them -> the decoder layer's input [R, D]; a row at position 0 (is_position_zero [R]) has its embedding
        zeroed."""
        embeddings = jnp.where(is_position_zero[:, None], 0, embeddings)
        eps = self.cfg.rms_norm_eps
        joined = jnp.concatenate([rms_norm(embeddings, self.enorm[...], eps),
                                  rms_norm(hidden, self.hnorm[...], eps)], axis=-1)
        return jnp.einsum("td,de->te", joined, self.eh_proj[...], precision=jax.lax.Precision.HIGHEST)

    def head_input(self, h):
        """The layer's output [..., D] normed for the shared lm_head."""
        return rms_norm(h, self.head_norm[...], self.cfg.rms_norm_eps)


def init_mtp_params(cfg: ModelConfig, seed: int, dtype=jnp.float32) -> dict:
    """Random MTP weights (as `init_params`) as a pure dict."""
    return nnx.to_pure_dict(nnx.state(MtpLayer(cfg, rngs=nnx.Rngs(seed), dtype=dtype)))


def abstract_mtp(cfg: ModelConfig, dtype=jnp.float32, fp8_block: tuple[int, int] | None = None):
    """(graphdef, abstract state) of `MtpLayer` without allocating; with `fp8_block` its decoder layer's
    `fp8_linear.FP8_AXES` leaves are abstract `Fp8BlockWeight`s of that block (a block fp8 checkpoint's)."""
    return with_fp8_leaves(nnx.split(nnx.eval_shape(lambda: MtpLayer(cfg, rngs=nnx.Rngs(0), dtype=dtype))), fp8_block)
