"""DeepSeek-V3.2 in flax nnx, the model file of the DeepSeek family (`architecture.py` names it): embeddings, the
architecture's attention variant (`attention/variant.py`: MLA with the lightning indexer for V3.2), dense MLP
(`mlp.py`), DeepSeek MoE (`moe.py`), final norm, lm_head, the multi-token-prediction layer, and the HF tensor names
of all of it (`DeepseekCheckpoint`). `MODEL` is what the registry hands the runtime.

Layouts (HF stores linear weights `[out, in]`; `DeepseekCheckpoint` converts): projections applied as `x @ W` are
stored `[in, out...]` (the attention's: `attention/params.py`; MLP gate_up [D, 2, F] (gate_proj then up_proj,
vLLM's gate_up_proj) and down [F, D], experts [X, D, F] / [X, F, D], router [D, X], lm_head [D, A]); embed is
[A, D]. The router and its bias (e_score_correction_bias) are always f32, as HF keeps them, and so is the
indexer's weights_proj; every other weight has the model's dtype, or, for a block fp8 model, is an
`fp8_linear.Fp8BlockWeight` (the leaves of `fp8_linear.FP8_AXES`: e4m3 values of the layout above with their axes
reordered batch, output, input, and their block scales; its `shape` is the layout above).
The modules run inside `shard_map` (`runtime/forward.py`): attention heads, the MLP widths and the routed experts
(along F, or along X with expert parallelism: `moe.py`) are split over every TP rank (partial sums meet in one
psum per block); embeddings, norms, the router and lm_head are replicated.
Letters: see the legend in `dcp_jax/__init__.py`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

import numpy as np

from dcp_jax.config import ModelConfig
from dcp_jax.model import architecture, fp8_linear
from dcp_jax.model.architecture import ModelFunctions
from dcp_jax.model.attention.projections import rms_norm
from dcp_jax.model.mesh import HEADS
from dcp_jax.model.mlp import MLP, dense_param
from dcp_jax.model.moe import MoE, check_routed_experts, expert_specs

HIGHEST = jax.lax.Precision.HIGHEST


def _attention(cfg: ModelConfig, layer: int):
    """Decoder layer `layer`'s attention variant (`AttentionVariant.layer_variant`)."""
    return architecture.of(cfg).attention.layer_variant(cfg, layer)


def norm_param(rngs: nnx.Rngs, size: int, dtype) -> nnx.Param:
    """An RMSNorm weight of `size`: 1 + 0.1 normal, in `dtype`."""
    return nnx.Param((1.0 + 0.1 * jax.random.normal(rngs.params(), (size,), jnp.float32)).astype(dtype))


class Attention(nnx.Module):
    """Decoder layer `layer`'s attention in its architecture's variant for that layer (`layer_variant`): the fields
    of the variant's `params_class`, initialized by its `init_params` (DSA's index_weights f32 whatever `dtype`)."""

    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.cfg = cfg
        self.variant = _attention(cfg, layer)
        weights = self.variant.init_params(cfg, rngs.params(), dtype)
        for f in dataclasses.fields(weights):
            setattr(self, f.name, nnx.Param(getattr(weights, f.name)))

    def params(self):
        """The weights as the variant's `params_class`."""
        cls = self.variant.params_class
        return cls(**{f.name: getattr(self, f.name).get_value() for f in dataclasses.fields(cls)})

    def __call__(self, x, rope, pools: dict, mds: dict, *, ctx, selection):
        """Per rank: this layer's attention (`AttentionVariant.attend`: its own variant, or what a benchmark's
        step context makes of it, ctx.attention); x [R, D] the step's rows, mds the rank's view of its
        StepMetadata on this layer's entry of each pool it caches in, selection [R, K] the most recent layer's.
        Returns (output [R, D] summed over TP ranks, the pools, the global positions [R, K] each row attended)."""
        variant = self.variant if ctx.attention is None else ctx.attention(self.variant)
        return variant.attend(self.params(), x, pools, rope, mds, ctx=ctx, selection=selection)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.cfg = cfg
        self.input_norm = norm_param(rngs, cfg.hidden_size, dtype)
        self.post_attention_norm = norm_param(rngs, cfg.hidden_size, dtype)
        self.attention = Attention(cfg, layer, rngs=rngs, dtype=dtype)
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
    """Decoder layers of one structure, `count` of them `stride` apart from `first`: their weights are stacked along
    a leading axis (one attribute of `DeepseekV32`, named `name`) and run under one `jax.lax.scan` with the other
    stacks of their scan group (`scan_groups`), so a program compiles each structure once whatever the depth."""

    name: str
    first: int
    count: int
    stride: int = 1

    @property
    def layers(self) -> range:
        return range(self.first, self.first + self.count * self.stride, self.stride)

    def index_of(self, layer: int) -> int:
        """Layer `layer`'s position along the stack's leading axis."""
        return self.layers.index(layer)


def _layer_structure(cfg: ModelConfig, layer: int) -> tuple[bool, str]:
    """What makes two layers stackable: their MLP kind and their attention variant."""
    return cfg.is_moe_layer(layer), _attention(cfg, layer).name


def _periodic_runs(kinds: list, limit: int = 8) -> list[tuple[int, int]]:
    """`kinds` cut into runs that each repeat one block: [(block length p, repeats n)] covering it in order, with
    the fewest distinct blocks' layers in all (each block layer is one stack: one compiled layer body). A uniform
    sequence is one run of p = 1; IndexShare's "SSSF" x 18 + "SSS" is (4, 18), (1, 3)."""

    @functools.cache
    def best(start: int) -> tuple[int, tuple[tuple[int, int], ...]]:
        if start == len(kinds):
            return 0, ()
        choices = []
        for p in range(1, min(limit, len(kinds) - start) + 1):
            block, n = kinds[start:start + p], 1
            while kinds[start + n * p:start + (n + 1) * p] == block:
                n += 1
            cost, rest = best(start + n * p)
            choices.append((p + cost, ((p, n),) + rest))
        return min(choices, key=lambda choice: choice[0])

    return list(best(0)[1])


@functools.cache
def scan_groups(cfg: ModelConfig) -> tuple[tuple[LayerStack, ...], ...]:
    """The model's layers in order as scan groups: each runs its stacks' layers in turn under one scan (a group of
    p stacks of stride p repeats a block of p layers). The dense-MLP layers (the first `first_k_dense_replace`, or
    all without routed experts) are "dense_layers", the MoE layers "moe_layers" (further stacks of either kind
    "<name>_<i>", where IndexShare's shared layers break a kind into repeating blocks)."""
    kinds = [_layer_structure(cfg, layer) for layer in range(cfg.num_hidden_layers)]
    groups, first, used = [], 0, {}
    for p, n in _periodic_runs(kinds):
        group = []
        for j in range(p):
            base = "moe_layers" if kinds[first + j][0] else "dense_layers"
            index = used[base] = used.get(base, -1) + 1
            group.append(LayerStack(base if index == 0 else f"{base}_{index}", first + j, n, p))
        groups.append(tuple(group))
        first += p * n
    return tuple(groups)


def layer_stacks(cfg: ModelConfig) -> tuple[LayerStack, ...]:
    """Every stack of the model (`scan_groups`' in order)."""
    return tuple(stack for group in scan_groups(cfg) for stack in group)


def stack_of(cfg: ModelConfig, layer: int) -> LayerStack:
    """The stack holding decoder layer `layer`."""
    return next(stack for stack in layer_stacks(cfg) if layer in stack.layers)


def layer_params(cfg: ModelConfig, params: dict, layer: int) -> dict:
    """Decoder layer `layer`'s weights (its slice of its stack) from the model's pure-dict params."""
    stack = stack_of(cfg, layer)
    return jax.tree.map(lambda a: a[stack.index_of(layer)], params[stack.name])


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
            setattr(self, stack.name, _stacked([layers[i] for i in stack.layers]))
        self.final_norm = norm_param(rngs, cfg.hidden_size, dtype)
        self.lm_head = dense_param(rngs, (cfg.hidden_size, cfg.vocab_size), cfg.hidden_size, dtype)

    def decoder_layer(self, layer: int) -> DecoderLayer:
        """Decoder layer `layer` on its own (its slice of its stack), for code that walks the layers one by one."""
        stack = stack_of(self.cfg, layer)
        graphdef, weights = nnx.split(getattr(self, stack.name))
        return nnx.merge(graphdef, jax.tree.map(lambda a: a[stack.index_of(layer)], weights))

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


# MLP and shared-expert widths split over every TP rank.
_MLP_SPECS = {"gate_up": P(None, None, HEADS), "down": P(HEADS, None)}


def param_specs(cfg: ModelConfig, params: dict, *, expert_parallel: bool) -> dict:
    """PartitionSpecs for the pure-dict state of `DeepseekV32` (or an `MtpLayer`): the attention's as its variant
    splits them (heads over every TP rank), MLP widths and routed experts (along X when `expert_parallel`, else
    along F: `moe.expert_specs`) split over every TP rank; the rest replicated; a layer stack's leading axis is never
    split."""
    feed_forward = _MLP_SPECS | expert_specs(expert_parallel)
    attention_specs = vars(architecture.of(cfg).attention.partition_specs())
    stack_names = {stack.name for stack in layer_stacks(cfg)}

    def spec(path, leaf):
        names = [getattr(k, "key", None) for k in path]
        if "attention" in names:
            plain = attention_specs[names[-1]]
        elif "mlp" in names:
            plain = feed_forward.get(names[-1], P())
        else:
            plain = P()
        if names[0] in stack_names:
            plain = P(None, *plain)
        return fp8_linear.weight_spec(leaf, plain) if fp8_linear.is_quantized(leaf) else plain

    return jax.tree_util.tree_map_with_path(spec, params, is_leaf=fp8_linear.is_quantized)


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


def check_kernels(cfg: ModelConfig, local_params: dict, backend: str, dtype) -> None:
    """ValueError where the kernels of `backend` cannot run these per-rank weights (a model's or an MTP layer's pure
    dict; ShapeDtypeStructs do): every MoE block's routed experts (`moe.check_routed_experts`, on one layer's
    [X, D, F] / [X, F, D]: a layer stack's leading axis dropped). Runs before any weight is read."""
    if not isinstance(local_params, dict):
        return
    if "experts_gate" in local_params:
        one_layer = [jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[-3:], a.dtype), local_params[name])
                     for name in ("experts_gate", "experts_up", "experts_down")]
        check_routed_experts(backend, dtype, *one_layer)
        return
    for value in local_params.values():
        check_kernels(cfg, value, backend, dtype)


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


# ---- the multi-token-prediction layer ----------------------------------------------------------------------------


class MtpLayer(nnx.Module):
    """DeepSeek-V3's multi-token-prediction (MTP) module, one depth: HF's decoder layer `num_hidden_layers` of a
    checkpoint with `num_nextn_predict_layers` = 1.

    Its row at position r (RoPE position r, its cache entry r) reads the main model's last hidden state of position
    r after the final norm (what lm_head reads) and the embedding of token r + 1, the token the main model produced
    there (zero at position 0), as vLLM and SGLang feed DeepSeek's MTP layer; each is RMS-normed (hnorm, enorm),
    concatenated [embedding, hidden] and projected back to D (eh_proj); a full decoder layer of the main model's
    structure (its attention variant, the MoE) follows, then its own norm (HF's shared_head.norm) and the main
    model's lm_head: the logits of token r + 2, one past what the main model predicts at r + 1. The embedding and
    the head are the main model's (HF stores copies in the layer; `DeepseekCheckpoint`)."""

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
        return jnp.einsum("td,de->te", joined, self.eh_proj[...], precision=HIGHEST)

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


# ---- HF tensor names -----------------------------------------------------------------------------------------------


def _mlp_to_ours(t: dict, prefix: str) -> dict:
    """HF's gate_proj and up_proj [F, D] as our gate_up [D, 2, F] (a view of their one stacked copy); down_proj
    [D, F] as down [F, D]."""
    gate_up = np.stack([t[prefix + "gate_proj.weight"], t[prefix + "up_proj.weight"]]).transpose(2, 0, 1)
    return {"gate_up": gate_up, "down": t[prefix + "down_proj.weight"].T}


def _mlp_to_hf(p: dict, prefix: str) -> dict:
    return {prefix + "gate_proj.weight": p["gate_up"][:, 0].T, prefix + "up_proj.weight": p["gate_up"][:, 1].T,
            prefix + "down_proj.weight": p["down"].T}


def _stacked_experts(t: dict[str, np.ndarray], kind: str, experts) -> np.ndarray:
    """The routed experts' `kind` projections, HF [out, in] each, as ours [X, in, out]: one stacked copy, viewed."""
    return np.stack([t[f"mlp.experts.{x}.{kind}_proj.weight"] for x in experts]).transpose(0, 2, 1)


class DeepseekCheckpoint:
    """The HF tensors of a DeepSeek-family checkpoint (experts one tensor each, linear weights [out, in]) and their
    conversion to our params and back, one layer at a time (the loader and the oracle tests share them); the
    attention's tensors are its variant's (`AttentionVariant.hf_tensor_shapes`). The MTP layer is HF layer
    `num_hidden_layers`."""

    # Our top-level params -> (HF name, whether HF stores it transposed).
    TOP = {"embed": ("model.embed_tokens.weight", False), "final_norm": ("model.norm.weight", False),
           "lm_head": ("lm_head.weight", True)}
    # The MLP tensors (relative to a layer, experts' and shared ones included) DeepSeek's release stores in e4m3.
    MLP_FP8_TENSORS = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
    # The MTP layer's copies of the main model's tensors: its name (relative to the layer) -> the main model's.
    MTP_COPIES = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}

    @staticmethod
    def layer_prefix(layer: int) -> str:
        return f"model.layers.{layer}."

    def tensor_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every tensor of the checkpoint (without MTP layers or fp8 scales): name -> shape."""
        d = cfg.hidden_size
        shapes = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,),
                  "lm_head.weight": (cfg.vocab_size, d)}
        for layer in range(cfg.num_hidden_layers):
            shapes |= {self.layer_prefix(layer) + k: s for k, s in self.layer_tensor_shapes(cfg, layer).items()}
        return shapes

    def layer_tensor_shapes(self, cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
        """Decoder layer `layer`'s tensors (names relative to its prefix) -> shape."""
        d = cfg.hidden_size
        shapes = {"input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
                  **_attention(cfg, layer).hf_tensor_shapes(cfg)}
        if cfg.is_moe_layer(layer):
            f, shared = cfg.moe_intermediate_size, cfg.moe_intermediate_size * cfg.n_shared_experts
            shapes["mlp.gate.weight"] = (cfg.n_routed_experts, d)
            shapes["mlp.gate.e_score_correction_bias"] = (cfg.n_routed_experts,)
            for x in range(cfg.n_routed_experts):
                expert = f"mlp.experts.{x}."
                shapes |= {expert + "gate_proj.weight": (f, d), expert + "up_proj.weight": (f, d),
                           expert + "down_proj.weight": (d, f)}
            shapes |= {"mlp.shared_experts.gate_proj.weight": (shared, d),
                       "mlp.shared_experts.up_proj.weight": (shared, d),
                       "mlp.shared_experts.down_proj.weight": (d, shared)}
        else:
            f = cfg.intermediate_size
            shapes |= {"mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d), "mlp.down_proj.weight": (d, f)}
        return shapes

    def fp8_tensors(self, cfg: ModelConfig) -> tuple[str, ...]:
        """The tensor-name endings (relative to a layer) a block-fp8 checkpoint stores in e4m3."""
        return architecture.of(cfg).attention.fp8_tensors + self.MLP_FP8_TENSORS

    def layer_to_ours(self, cfg: ModelConfig, layer: int, t: dict[str, np.ndarray]) -> dict:
        """One decoder layer: HF tensors (names relative to its prefix) -> our pure-dict params, views of the HF
        [out, in] tensors where the layouts allow (gate_up and the routed experts one stacked copy), so block-fp8
        values kept K-major are the checkpoint's bytes in their own order."""
        if cfg.is_moe_layer(layer):
            mlp = {"router": t["mlp.gate.weight"].T, "router_bias": t["mlp.gate.e_score_correction_bias"],
                   **{f"experts_{kind}": _stacked_experts(t, kind, range(cfg.n_routed_experts))
                      for kind in ("gate", "up", "down")},
                   "shared": _mlp_to_ours(t, "mlp.shared_experts.")}
        else:
            mlp = _mlp_to_ours(t, "mlp.")
        return {"input_norm": t["input_layernorm.weight"], "post_attention_norm": t["post_attention_layernorm.weight"],
                "attention": _attention(cfg, layer).to_ours(cfg, t), "mlp": mlp}

    def layer_to_hf(self, cfg: ModelConfig, layer: int, p: dict) -> dict[str, np.ndarray]:
        """Inverse of `layer_to_ours` (numpy arrays in, names relative to the layer's prefix out)."""
        out = {"input_layernorm.weight": p["input_norm"], "post_attention_layernorm.weight": p["post_attention_norm"],
               **_attention(cfg, layer).to_hf(cfg, p["attention"])}
        mlp = p["mlp"]
        if cfg.is_moe_layer(layer):
            out["mlp.gate.weight"] = mlp["router"].T
            out["mlp.gate.e_score_correction_bias"] = mlp["router_bias"]
            for x in range(cfg.n_routed_experts):
                for kind in ("gate", "up", "down"):
                    out[f"mlp.experts.{x}.{kind}_proj.weight"] = mlp[f"experts_{kind}"][x].T
            out |= _mlp_to_hf(mlp["shared"], "mlp.shared_experts.")
        else:
            out |= _mlp_to_hf(mlp, "mlp.")
        return out

    def layer_scales_to_ours(self, cfg: ModelConfig, layer: int, scales: dict[str, np.ndarray],
                             block: tuple[int, int]) -> dict:
        """One layer's weight_scale_inv grids (HF [out blocks, in blocks], keyed by their weight's name relative to
        the layer) -> the scales of its fp8 leaves, [*batch, out blocks, in blocks] (`fp8_linear`), nested as our
        params."""
        def mlp_scales(prefix):  # gate_proj's and up_proj's grids stacked, as their weights
            return {"gate_up": np.stack([scales[f"{prefix}gate_proj.weight"], scales[f"{prefix}up_proj.weight"]]),
                    "down": scales[f"{prefix}down_proj.weight"]}

        if cfg.is_moe_layer(layer):
            mlp = {f"experts_{kind}": np.stack([scales[f"mlp.experts.{x}.{kind}_proj.weight"]
                                                for x in range(cfg.n_routed_experts)])
                   for kind in ("gate", "up", "down")}
            mlp["shared"] = mlp_scales("mlp.shared_experts.")
        else:
            mlp = mlp_scales("mlp.")
        return {"attention": _attention(cfg, layer).fp8_scales_to_ours(cfg, scales, block), "mlp": mlp}

    def fp8_problems(self, cfg: ModelConfig, block: tuple[int, int]) -> list[str]:
        """Why this config's weights cannot stay in block fp8 of `block` (empty: they can)."""
        return architecture.of(cfg).attention.fp8_problems(cfg, block)

    def mtp_tensor_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every tensor of the checkpoint's MTP layer (HF layer `num_hidden_layers`): name -> shape."""
        d, a, prefix = cfg.hidden_size, cfg.vocab_size, self.layer_prefix(cfg.num_hidden_layers)
        own = {"enorm.weight": (d,), "hnorm.weight": (d,), "eh_proj.weight": (d, 2 * d),
               "shared_head.norm.weight": (d,), "shared_head.head.weight": (a, d), "embed_tokens.weight": (a, d)}
        return {prefix + name: shape
                for name, shape in (self.layer_tensor_shapes(cfg, cfg.num_hidden_layers) | own).items()}

    def mtp_own_to_ours(self, read) -> dict:
        """The MTP layer's own weights (besides its decoder layer and the copies) from read(name relative to the
        layer) -> numpy."""
        return {"enorm": read("enorm.weight"), "hnorm": read("hnorm.weight"), "eh_proj": read("eh_proj.weight").T,
                "head_norm": read("shared_head.norm.weight")}

    def mtp_to_hf(self, cfg: ModelConfig, mtp: dict, params: dict) -> dict[str, np.ndarray]:
        """An `MtpLayer`'s pure dict (numpy) and the main model's (for the copies of the embedding and the head) ->
        HF tensors of the MTP layer (full names)."""
        own = {"enorm.weight": mtp["enorm"], "hnorm.weight": mtp["hnorm"], "eh_proj.weight": mtp["eh_proj"].T,
               "shared_head.norm.weight": mtp["head_norm"], "shared_head.head.weight": params["lm_head"].T,
               "embed_tokens.weight": params["embed"]}
        layer = self.layer_to_hf(cfg, cfg.num_hidden_layers, mtp["layer"])
        return {self.layer_prefix(cfg.num_hidden_layers) + name: value for name, value in (layer | own).items()}


MODEL = ModelFunctions(abstract_model=abstract_model, init_params=init_params, merge=merge, param_specs=param_specs,
                       check_divisible=check_divisible, layer_stacks=layer_stacks, scan_groups=scan_groups,
                       stack_of=stack_of, layer_params=layer_params, abstract_mtp=abstract_mtp,
                       init_mtp_params=init_mtp_params,
                       check_kernels=check_kernels, checkpoint=DeepseekCheckpoint())
