"""DeepSeek-V3.2 in flax nnx: embeddings, MLA + lightning indexer, dense MLP (`mlp.py`), DeepSeek MoE (`moe.py`),
final norm, lm_head.

Layouts (HF stores linear weights `[out, in]`; `weights.py` converts): projections applied as `x @ W` are stored
`[in, out...]` (wqkv_a [D, Q+C+E]: q_a_proj then kv_a_proj_with_mqa, vLLM's fused_qkv_a_proj; wq_b [Q, H, N+E],
wo [H, V, D], index_wq [Q, I, J], index_wk [D, J], index_weights [D, I], MLP gate_up [2, D, F] (gate_proj then
up_proj, vLLM's gate_up_proj) and down [F, D], experts [X, D, F] / [X, F, D], router [D, X], lm_head [D, A]);
the two halves of HF's kv_b_proj keep HF's per-head `[out, in]` order: w_uk [H, N, C] and w_uv [H, V, C], with
w_uv applied C -> V (`projections.output_projection`); embed is [A, D]. The router, its bias
(e_score_correction_bias) and index_weights (the indexer's weights_proj) are always f32, as HF keeps them; every
other weight has the model's dtype, or, for a block fp8 model, is an `fp8_linear.Fp8BlockWeight` (the leaves of
`fp8_linear.FP8_AXES`: e4m3 values of the layout above with their axes reordered batch, output, input, and their
block scales; its `shape` is the layout above).
The attention module holds exactly the fields of `AttentionParams`, so the shared projections, the sparse DCP
attention layer and the kernels read it unchanged. The modules run inside `shard_map` (`runtime/forward.py`):
attention heads, the MLP widths and the routed experts (along F, or along X with expert parallelism: `moe.py`)
are split over every TP rank (partial sums meet in one psum per block); embeddings, norms, the router and lm_head
are replicated.
GLM-5 shares this architecture (a preset of `config.py`); a model of another structure gets a sibling file.

Letters: R rows, T tokens of a row, D hidden, Q q_lora, H heads (local h), N nope, E rope, V v dim, C kv_lora
(latent), I index heads, J index head dim, K index top-k, X experts, F expert / MLP width, A vocab.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from dcp_jax.config import ModelConfig
from dcp_jax.host.layout import DcpLayout
from dcp_jax.model.attention.sparse_dcp import sparse_dcp_attention
from dcp_jax.model.attention.params import AttentionParams, init_attention_params, partition_specs
from dcp_jax.model.attention.projections import rms_norm
from dcp_jax.model import fp8_linear
from dcp_jax.model.mesh import HEADS
from dcp_jax.model.mlp import MLP, dense_param
from dcp_jax.model.moe import MoE, expert_specs

HIGHEST = jax.lax.Precision.HIGHEST


def norm_param(rngs: nnx.Rngs, size: int, dtype) -> nnx.Param:
    """An RMSNorm weight of `size`: 1 + 0.1 normal, in `dtype`."""
    return nnx.Param((1.0 + 0.1 * jax.random.normal(rngs.params(), (size,), jnp.float32)).astype(dtype))


class Attention(nnx.Module):
    """MLA with q_lora and the lightning indexer; the fields are those of `AttentionParams`, initialized by
    `init_attention_params` (index_weights f32 whatever `dtype`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.cfg = cfg
        p = init_attention_params(cfg, rngs.params(), dtype)
        for f in dataclasses.fields(AttentionParams):
            setattr(self, f.name, nnx.Param(getattr(p, f.name)))

    def params(self) -> AttentionParams:
        fields = dataclasses.fields(AttentionParams)
        return AttentionParams(**{f.name: getattr(self, f.name).get_value() for f in fields})

    def __call__(self, x, rope, kv_cache, index_cache, md, *, layout: DcpLayout, backend: str,
                 micro_batches: int = 1):
        """Per rank: the sparse DCP attention layer of `attention/sparse_dcp.py` on these weights (x [R, D] the step's
        rows, md the rank's view of its StepMetadata; `micro_batches` 2: two-batch overlap). Returns (output [R, D]
        summed over TP ranks, kv_cache, index_cache, selected [R, K])."""
        return sparse_dcp_attention(self.params(), x, kv_cache, index_cache, rope, md, cfg=self.cfg, layout=layout,
                                    backend=backend, micro_batches=micro_batches)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.cfg = cfg
        self.input_norm = norm_param(rngs, cfg.hidden_size, dtype)
        self.post_attention_norm = norm_param(rngs, cfg.hidden_size, dtype)
        self.attention = Attention(cfg, rngs=rngs, dtype=dtype)
        if cfg.is_moe_layer(layer):
            self.mlp = MoE(cfg, rngs=rngs, dtype=dtype)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, rngs=rngs, dtype=dtype)

    def attention_input(self, h):
        return rms_norm(h, self.input_norm[...], self.cfg.rms_norm_eps)

    def mlp_input(self, h):
        return rms_norm(h, self.post_attention_norm[...], self.cfg.rms_norm_eps)

    def feed_forward(self, h, *, backend: str):
        """h + MLP/MoE(post-attention norm of h); `backend` the kernels' (the MoE's routed experts: `MoE.partial`;
        fp8 linear layers: `fp8_linear.einsum`)."""
        x = self.mlp_input(h)
        return h + self.mlp(x, backend=backend)


@dataclasses.dataclass(frozen=True)
class LayerStack:
    """Consecutive decoder layers of one structure: their weights are stacked along a leading axis (one attribute
    of `DeepseekV32`, named `name`) and run under one `jax.lax.scan`, so a program compiles each structure once
    whatever the depth."""

    name: str
    first: int
    count: int

    @property
    def layers(self) -> range:
        return range(self.first, self.first + self.count)


# The attributes of `DeepseekV32` holding its layer stacks, in layer order.
_STACK_NAMES = ("dense_layers", "moe_layers")


def layer_stacks(cfg: ModelConfig) -> tuple[LayerStack, ...]:
    """The model's stacks in layer order: the dense-MLP layers (the first `first_k_dense_replace`, or all without
    routed experts), then the MoE layers."""
    layers = cfg.num_hidden_layers
    dense = min(cfg.first_k_dense_replace, layers) if cfg.n_routed_experts else layers
    stacks = (LayerStack(_STACK_NAMES[0], 0, dense), LayerStack(_STACK_NAMES[1], dense, layers - dense))
    return tuple(stack for stack in stacks if stack.count)


def stack_of(cfg: ModelConfig, layer: int) -> LayerStack:
    """The stack holding decoder layer `layer`."""
    return next(stack for stack in layer_stacks(cfg) if layer in stack.layers)


def layer_params(cfg: ModelConfig, params: dict, layer: int) -> dict:
    """Decoder layer `layer`'s weights (its slice of its stack) from the model's pure-dict params."""
    stack = stack_of(cfg, layer)
    return jax.tree.map(lambda a: a[layer - stack.first], params[stack.name])


def _stacked(layers: list[DecoderLayer]) -> DecoderLayer:
    """One DecoderLayer whose every weight is the layers' weights stacked along a new leading axis."""
    states = [nnx.state(layer) for layer in layers]
    return nnx.merge(nnx.graphdef(layers[0]), jax.tree.map(lambda *xs: jnp.stack(xs), *states))


class DeepseekV32(nnx.Module):
    """The whole model; `step_body` of `runtime/forward.py` drives the layers, stack by stack (`layer_stacks`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.cfg = cfg
        self.embed = nnx.Param(jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size)).astype(dtype))
        layers = [DecoderLayer(cfg, i, rngs=rngs, dtype=dtype) for i in range(cfg.num_hidden_layers)]
        for stack in layer_stacks(cfg):
            setattr(self, stack.name, _stacked(layers[stack.first:stack.first + stack.count]))
        self.final_norm = norm_param(rngs, cfg.hidden_size, dtype)
        self.lm_head = dense_param(rngs, (cfg.hidden_size, cfg.vocab_size), cfg.hidden_size, dtype)

    def decoder_layer(self, layer: int) -> DecoderLayer:
        """Decoder layer `layer` on its own (its slice of its stack), for code that walks the layers one by one."""
        stack = stack_of(self.cfg, layer)
        graphdef, weights = nnx.split(getattr(self, stack.name))
        return nnx.merge(graphdef, jax.tree.map(lambda a: a[layer - stack.first], weights))

    def embed_tokens(self, tokens):
        return jnp.take(self.embed[...], tokens, axis=0)

    def final_hidden(self, h):
        """The last layer's output h [..., D] after the final RMSNorm: what lm_head (and an MTP layer) reads."""
        return rms_norm(h, self.final_norm[...], self.cfg.rms_norm_eps)

    def head(self, normed):
        """Final-normed states [..., D] -> f32 logits [..., A] (the untied lm_head)."""
        return jnp.einsum("...d,da->...a", normed, self.lm_head[...], precision=HIGHEST).astype(jnp.float32)

    def logits(self, h):
        """h [..., D] -> f32 logits [..., A] (final RMSNorm, untied lm_head)."""
        return self.head(self.final_hidden(h))


# Attention fields split over heads (every TP rank), from `attention/params.py`.
_HEAD_SPECS = {f.name: getattr(partition_specs(), f.name) for f in dataclasses.fields(AttentionParams)}
# MLP and shared-expert widths split over every TP rank.
_MLP_SPECS = {"gate_up": P(None, None, HEADS), "down": P(HEADS, None)}


def param_specs(params: dict, *, expert_parallel: bool) -> dict:
    """PartitionSpecs for the pure-dict state of `DeepseekV32`: attention heads, MLP widths and routed experts
    (along X when `expert_parallel`, else along F: `moe.expert_specs`) split over every TP rank; the rest
    replicated; a layer stack's leading axis is never split."""
    feed_forward = _MLP_SPECS | expert_specs(expert_parallel)

    def spec(path, leaf):
        names = [getattr(k, "key", None) for k in path]
        if "attention" in names:
            plain = _HEAD_SPECS[names[-1]]
        elif "mlp" in names:
            plain = feed_forward.get(names[-1], P())
        else:
            plain = P()
        if names[0] in _STACK_NAMES:
            plain = P(None, *plain)
        return fp8_linear.weight_spec(leaf, plain) if fp8_linear.is_fp8(leaf) else plain

    return jax.tree_util.tree_map_with_path(spec, params, is_leaf=fp8_linear.is_fp8)


def check_divisible(cfg: ModelConfig, tp: int, *, expert_parallel: bool) -> None:
    """Raise ValueError unless every dimension split over the `tp` ranks divides evenly: the routed experts'
    count X with `expert_parallel`, else their width F."""
    routed = ({"n_routed_experts": cfg.n_routed_experts} if expert_parallel
              else {"moe_intermediate_size": cfg.moe_intermediate_size})
    split = {
        "num_attention_heads": cfg.num_attention_heads,
        "intermediate_size": cfg.intermediate_size,
        **(routed if cfg.n_routed_experts else {}),
        "moe_intermediate_size * n_shared_experts": cfg.moe_intermediate_size * cfg.n_shared_experts,
    }
    bad = {name: size for name, size in split.items() if size % tp}
    if bad:
        mode = "with" if expert_parallel else "without"
        raise ValueError(f"tp={tp} must divide {bad} ({mode} expert parallelism)")


def abstract_model(cfg: ModelConfig, dtype=jnp.float32, fp8_block: tuple[int, int] | None = None):
    """(graphdef, abstract state of ShapeDtypeStructs) without allocating anything; with `fp8_block` the
    `fp8_linear.FP8_AXES` leaves are abstract `Fp8BlockWeight`s of that block."""
    return with_fp8_leaves(nnx.split(nnx.eval_shape(lambda: DeepseekV32(cfg, rngs=nnx.Rngs(0), dtype=dtype))),
                           fp8_block)


def with_fp8_leaves(split, fp8_block: tuple[int, int] | None):
    """(graphdef, abstract state) with the `fp8_linear.FP8_AXES` leaves abstract `Fp8BlockWeight`s of `fp8_block`
    (unchanged when it is None)."""
    graphdef, state = split
    if fp8_block is not None:
        nnx.replace_by_pure_dict(state, jax.eval_shape(
            lambda params: fp8_linear.quantize_params(params, fp8_block), nnx.to_pure_dict(state)))
    return graphdef, state


def init_params(cfg: ModelConfig, seed: int, dtype=jnp.float32, fp8_block: tuple[int, int] | None = None) -> dict:
    """Random weights (normal / sqrt(fan_in), norms 1 + 0.1 normal) as a pure dict of jax arrays: the full,
    unsharded model on the default device (device 0), router / router_bias / index_weights in f32, the rest in
    `dtype`, or with `fp8_block` the `fp8_linear.FP8_AXES` leaves quantized to block fp8. `jax.device_put` them
    with `param_specs` to shard."""
    params = nnx.to_pure_dict(nnx.state(DeepseekV32(cfg, rngs=nnx.Rngs(seed), dtype=dtype)))
    return params if fp8_block is None else fp8_linear.quantize_params(params, fp8_block)


def merge(graphdef, abstract_state, params: dict) -> DeepseekV32:
    """A model (or an `MtpLayer`, of its graphdef and state) whose weights are the arrays of `params` (a pure dict;
    traced values inside jit work)."""
    state = jax.tree.map(lambda x: x, abstract_state)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)
