"""Routed experts kept in OCP MXFP4 (AMD Quark's export, e.g. amd/GLM-5.2-MXFP4; `quark.py` reads its config): the
weight leaf, its sharding and the activations' quantize-dequantize.

Leaf (`Mxfp4Experts`, a `pallas_kernels.formats.Mxfp4Weight`): our plain experts are [X, in, out] (experts_gate /
experts_up [X, D, F], experts_down [X, F, D]: `deepseek_v32.py`); the leaf holds the checkpoint's own bytes of each
expert's HF [out, in] tensor, stacked: `packed` uint8 [X, out, in / 2] and `scales` uint8 [X, out, in / 32] (the
format: `formats.py`), K-major as `pallas_kernels.grouped_matmul_mxfp4` reads them; no repacking at load. A layer
stack adds its leading axis to both. 0.5 + 1/32 bytes a weight. The static `activations` says what the experts'
inputs go through before the product, as the checkpoint declares (`quark.ACTIVATIONS`): "model_dtype" nothing,
"mxfp4" a quantize-dequantize per 32 inputs (`quantize_dequantize`, with `scale_mode` Quark's scale rule).

Sharding (`weight_spec`): as the plain weight's spec says, with the packed and scales axes (out, in) swapped
relative to the plain (in, out): expert parallel splits X; without it gate / up split F = out (packed [X, F/tp,
D/2]), down splits F = in (packed [X, D, F/tp/2], scales [X, D, F/tp/32]): a rank's input slice must be whole
scale blocks of 32 (`check_shardable`).

Activations (`quantize_dequantize`): Hopper has no fp4 tensor cores, so MXFP4 activations are emulated: each row's
32-input blocks are rounded to MXFP4 and back in the activations' dtype before the product, which then multiplies
those values as it would any activations of that dtype. The block's scale is 2^(floor(log2 amax) - 2) by the OCP
spec (scale_mode None, `formats.quantize_mxfp4`'s rule), or by Quark's "even" rule (its Triton quantizer,
quark/torch/kernel/mx/triton.py, as `formats.py` describes): amax's mantissa rounded to e2m1's one bit first (Quark
adds half a step and drops the mantissa), so a block whose amax has a mantissa of 1.75 or more takes the next scale
up instead of saturating at 6; elements round half to even on the e2m1 grid and saturate at 6 either way.
Letters: see the legend in `dcp_jax/__init__.py`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dcp_jax.model.quark import ACTIVATIONS, SCALE_MODES
from pallas_kernels.formats import (E2M1_MAX, E2M1_MAX_EXPONENT, E8M0_BIAS, F32_MIN_NORMAL, MX_BLOCK, Mxfp4Weight,
                                    dequantize_mxfp4)

# The leaves a Quark MXFP4 checkpoint keeps in MXFP4: the routed experts ([X, in, out] plain).
EXPERT_LEAVES = ("experts_gate", "experts_up", "experts_down")


@dataclasses.dataclass(frozen=True)
class ExpertsFormat:
    """Routed experts kept in MXFP4 whose inputs go through `activations` (`quark.ACTIVATIONS`) with Quark's
    `scale_mode` (`quark.SCALE_MODES`): the static part of an `Mxfp4Experts`."""
    activations: str = "model_dtype"
    scale_mode: str | None = None

    def __post_init__(self):
        if self.activations not in ACTIVATIONS or self.scale_mode not in SCALE_MODES:
            raise ValueError(f"activations must be one of {ACTIVATIONS} and scale_mode one of {SCALE_MODES}; got "
                             f"{self.activations!r} {self.scale_mode!r}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mxfp4Experts(Mxfp4Weight):
    """Routed experts in MXFP4 (module docstring): `packed` [..., X, out, in / 2], `scales` [..., X, out, in / 32]
    uint8; `shape` is Mxfp4Weight's [..., X, out, in], `plain_shape` our layout's [..., X, in, out]."""
    # "model_dtype" or "mxfp4": what the inputs go through before the product.
    activations: str = dataclasses.field(default="model_dtype", metadata=dict(static=True))
    # Quark's scale rule of MXFP4 activations: None (the OCP spec's) or "even".
    scale_mode: str | None = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def format(self) -> ExpertsFormat:
        return ExpertsFormat(self.activations, self.scale_mode)

    @property
    def plain_shape(self) -> tuple[int, ...]:
        *batch, width, depth = self.shape
        return (*batch, depth, width)

    def weight(self) -> Mxfp4Weight:
        """The kernel's operand (its contract names Mxfp4Weight alone)."""
        return Mxfp4Weight(self.packed, self.scales)


def is_mxfp4(x) -> bool:
    return isinstance(x, Mxfp4Experts)


def from_checkpoint(packed, scales, fmt: ExpertsFormat) -> Mxfp4Experts:
    """The leaf of one layer's experts from their HF tensors stacked: packed uint8 [X, out, in / 2] and scales uint8
    [X, out, in / 32] (numpy or jax), as they are."""
    return Mxfp4Experts(packed, scales, fmt.activations, fmt.scale_mode)


def abstract_experts(plain, fmt: ExpertsFormat) -> Mxfp4Experts:
    """The abstract leaf (ShapeDtypeStructs) of a plain abstract expert weight [..., X, in, out]; ValueError unless
    `in` is whole scale blocks."""
    *batch, depth, width = plain.shape
    if depth % MX_BLOCK:
        raise ValueError(f"MXFP4 experts need their input width a multiple of {MX_BLOCK}; got {plain.shape} "
                         f"(X, in, out)")
    return Mxfp4Experts(jax.ShapeDtypeStruct((*batch, width, depth // 2), jnp.uint8),
                        jax.ShapeDtypeStruct((*batch, width, depth // MX_BLOCK), jnp.uint8), fmt.activations,
                        fmt.scale_mode)


def with_mxfp4_experts(params: dict, fmt: ExpertsFormat | None) -> dict:
    """A pure-dict abstract state (ShapeDtypeStructs) with every routed expert leaf (`EXPERT_LEAVES`) an abstract
    `Mxfp4Experts` of `fmt` (unchanged when it is None: plain experts)."""
    if fmt is None:
        return params

    def leaf(path, x):
        return abstract_experts(x, fmt) if getattr(path[-1], "key", None) in EXPERT_LEAVES else x

    return jax.tree_util.tree_map_with_path(leaf, params)


def with_mxfp4_leaves(split, fmt: ExpertsFormat | None):
    """(graphdef, abstract nnx state) with the routed experts abstract `Mxfp4Experts` of `fmt` (`with_mxfp4_experts`;
    unchanged when it is None)."""
    from flax import nnx

    graphdef, state = split
    if fmt is not None:
        nnx.replace_by_pure_dict(state, with_mxfp4_experts(nnx.to_pure_dict(state), fmt))
    return graphdef, state


def experts_format(params) -> ExpertsFormat | None:
    """The format of the MXFP4 experts in `params` (None: no routed expert is MXFP4); ValueError when they
    differ."""
    found = {leaf.format for leaf in jax.tree.leaves(params, is_leaf=is_mxfp4) if is_mxfp4(leaf)}
    if len(found) > 1:
        raise ValueError(f"the MXFP4 experts mix formats {sorted(found, key=str)}")
    return found.pop() if found else None


def dequantize(w: Mxfp4Experts, dtype=jnp.float32):
    """The plain weight [..., X, in, out] in `dtype` (exact in f32)."""
    return jnp.swapaxes(dequantize_mxfp4(w.packed, w.scales, jnp.float32), -1, -2).astype(dtype)


def quantize_dequantize(x, scale_mode: str | None = None):
    """x [..., K] (K a multiple of 32) rounded to MXFP4 per 32 consecutive inputs and back, in x's dtype (module
    docstring: the OCP scale rule for scale_mode None, Quark's for "even")."""
    k = x.shape[-1]
    if k % MX_BLOCK:
        raise ValueError(f"MXFP4 activations need their width a multiple of {MX_BLOCK}; got {x.shape=}")
    blocks = x.astype(jnp.float32).reshape(*x.shape[:-1], k // MX_BLOCK, MX_BLOCK)
    amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    mantissa, exponent = jnp.frexp(amax)  # amax = mantissa * 2^exponent, mantissa in [0.5, 1)
    floor_log2 = exponent - 1
    if scale_mode == "even":  # amax rounded to one mantissa bit: 1.75 * 2^e and up reach 2^(e + 1)
        floor_log2 = jnp.where(mantissa >= 0.875, exponent, floor_log2)
    shared = jnp.where(amax >= F32_MIN_NORMAL, floor_log2 - E2M1_MAX_EXPONENT, -E8M0_BIAS)
    shared = jnp.clip(shared, -E8M0_BIAS, E8M0_BIAS).astype(jnp.int32)
    magnitude = jnp.minimum(jnp.abs(jnp.ldexp(blocks, -shared)), E2M1_MAX)  # exact: a power of two
    # The e2m1 grid is 0.5 apart below 2, 1 apart in [2, 4), 2 apart from 4; round half to even on it.
    step = jnp.where(magnitude < 2, 0.5, jnp.where(magnitude < 4, 1.0, 2.0)).astype(jnp.float32)
    rounded = jnp.round(magnitude / step) * step
    return jnp.ldexp(jnp.copysign(rounded, blocks), shared).reshape(x.shape).astype(x.dtype)


def activations_as_declared(x, w: Mxfp4Experts):
    """x as w's inputs are declared (`Mxfp4Experts.activations`): as it is, or `quantize_dequantize`d."""
    return quantize_dequantize(x, w.scale_mode) if w.activations == "mxfp4" else x


def _padded(spec: P, ndim: int) -> tuple:
    return tuple(spec) + (None,) * (ndim - len(spec))


def weight_spec(w: Mxfp4Experts, plain_spec: P) -> Mxfp4Experts:
    """The specs of w's packed values and scales (module docstring) for `plain_spec`, the plain weight's
    [..., X, in, out], as an Mxfp4Experts."""
    *batch, depth, width = _padded(plain_spec, len(w.shape))
    spec = P(*batch, width, depth)
    return Mxfp4Experts(spec, spec, w.activations, w.scale_mode)


def plain_spec(w: Mxfp4Experts, packed_spec: P) -> P:
    """The plain weight's spec from that of w's packed values (`weight_spec`'s inverse)."""
    *batch, width, depth = _padded(packed_spec, len(w.shape))
    return P(*batch, depth, width)


def check_shardable(name: str, w: Mxfp4Experts, plain: P, mesh_shape: dict[str, int]) -> None:
    """ValueError naming the leaf unless every rank's slice of its input axis is whole scale blocks of 32."""
    split = _padded(plain, len(w.shape))[-2]
    names = () if split is None else split if isinstance(split, tuple) else (split,)
    ranks = math.prod(mesh_shape[a] for a in names)
    depth = w.shape[-1]
    if ranks > 1 and (depth % ranks or depth // ranks % MX_BLOCK):
        raise ValueError(f"{name}: a rank's input slice of {depth} / {ranks} ranks is not a whole number of MXFP4 "
                         f"scale blocks of {MX_BLOCK} inputs; split the experts whole (enable_expert_parallel), "
                         f"use a tp that leaves whole blocks, or load with quantization='none'")
