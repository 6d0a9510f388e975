"""DeepSeek-V3's multi-token-prediction (MTP) module, one depth: HF's decoder layer `num_hidden_layers` of a
checkpoint with `num_nextn_predict_layers` = 1.

At position p it reads the main model's last hidden state of position p - 1 after the final norm (what lm_head
reads, as vLLM and SGLang feed it) and the embedding of token p (zero at position 0, which has no earlier state),
each RMS-normed (hnorm, enorm), concatenated [embedding, hidden] and projected back to D (eh_proj); a full decoder
layer of the main model's structure (MLA with its own lightning indexer, the MoE) follows, then its own norm
(HF's shared_head.norm) and the main model's lm_head: the logits of token p + 1, one past what the main model
predicts there. The embedding and the head are the main model's (HF stores copies in the layer; `weights.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dcp_jax.config import ModelConfig
from dcp_jax.model.attention.projections import rms_norm
from dcp_jax.model.deepseek_v32 import DecoderLayer, norm_param
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

    def layer_input(self, embeddings, previous_hidden):
        """embeddings [T, D] of tokens 0..T-1 and previous_hidden [T, D] (the main model's final-normed state of
        positions -1..T-2, zeros at -1) -> the decoder layer's input [T, D]; position 0's embedding is zeroed."""
        embeddings = embeddings.at[0].set(0)
        eps = self.cfg.rms_norm_eps
        joined = jnp.concatenate([rms_norm(embeddings, self.enorm[...], eps),
                                  rms_norm(previous_hidden, self.hnorm[...], eps)], axis=-1)
        return jnp.einsum("td,de->te", joined, self.eh_proj[...], precision=jax.lax.Precision.HIGHEST)

    def head_input(self, h):
        """The layer's output [..., D] normed for the shared lm_head."""
        return rms_norm(h, self.head_norm[...], self.cfg.rms_norm_eps)


def init_mtp_params(cfg: ModelConfig, seed: int, dtype=jnp.float32) -> dict:
    """Random MTP weights (as `init_params`) as a pure dict."""
    return nnx.to_pure_dict(nnx.state(MtpLayer(cfg, rngs=nnx.Rngs(seed), dtype=dtype)))


def abstract_mtp(cfg: ModelConfig, dtype=jnp.float32):
    """(graphdef, abstract state) of `MtpLayer` without allocating."""
    return nnx.split(nnx.eval_shape(lambda: MtpLayer(cfg, rngs=nnx.Rngs(0), dtype=dtype)))
