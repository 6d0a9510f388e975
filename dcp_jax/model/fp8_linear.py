"""Block-fp8 weights kept in fp8 (DeepSeek's release format) and the one place a linear layer multiplies.

Format (`Fp8BlockWeight`): `values` float8_e4m3fn holding the plain weight (our layout: `deepseek_v32.py`) with
its axes reordered batch, output, input (`in_axes` / `out_axes` name them in our layout; the others, in order, are
batch axes: the experts X, the heads H of w_uk / w_uv, whose rows are blocks of kv_b_proj's, gate_up's pair of
gate_proj and up_proj). So each matrix is [N, K], K-major, the checkpoint's own [out, in]: fp8 tensor cores read
both operands K-major. `scales` f32 [*batch, ceil(N / bn), ceil(K / bk)], the checkpoint's `weight_scale_inv`
grid. K is the product of the input axes, N of the output axes; (bn, bk) = `block` is HF's weight_block_size: bn
output rows by bk input columns; edge blocks are partial. A weight element is its e4m3 value times its block's
scale. `shape` is the plain weight's.

Sharding (`weight_spec`): the values split as the plain weight's axes they hold; the scales' batch axes as the
values', their output-block axis as the first output axis, their input-block axis as the first input axis. A
rank's slice must be whole blocks (`check_shardable`).

Per-channel fp8 (`Fp8ChannelWeight`, `--quantization ptpc_fp8`: vLLM's and ATOM's online "per-token per-channel"
fp8): e4m3 `values` in the same K-major order, `scales` f32 [*batch, N], one static scale per output channel (amax
over its whole input / 448); the activations take one dynamic scale per token over the inputs a rank contracts
(amax / 448). An output channel's scale factors out of a contraction split over TP ranks, so any split works
(`channel_weight_spec`). `quantize_channels_params` makes them of a loaded model's linear leaves but the excluded
ones (`PTPC_EXCLUDED`, the seed's `exclude_layer` list). `einsum` multiplies them as block-fp8 weights (below) of
scale blocks (1, K) with activations of one scale a token: `pallas_kernels.fp8_gemm` of block (1, K) under a
kernels backend, the dequantized product in f32 under "reference".

Multiplying (`einsum`, `ragged_dot`, `grouped_matmul`: plain weights multiply in full precision as before). With an
`Fp8BlockWeight` it is DeepSeek's fine-grained fp8 GEMM: the activations are quantized at run time per token per
bk channels of K (`act_quant`: e4m3, f32 scale amax / 448; DeepSeek's group of 128 is its weights' block), the
products are accumulated in f32 and the output has the activations' dtype. `einsum` under the "reference" kernels
backend computes it in pure jnp: the dequantized operands multiplied in f32 (a block's two scales factor out of it;
an optimization barrier keeps act_quant's e4m3 rounding, which XLA's GPU compiler would otherwise drop as excess
precision). Under a kernels backend it runs `pallas_kernels.fp8_gemm` of that backend ("pallas": the Mosaic GPU
kernel where it applies, on an sm_90 GPU with K a multiple of 128 and N of 64, else the Triton one; interpreted on
CPU): one GEMM of a weight with no batch axis, or of one whose batch axes the activations lack (the fused
gate_up's pair: its matrices stacked along N, or one GEMM a matrix where N ends mid-block). A weight the kernel
cannot take, or whose batch axes the activations share, is a ValueError saying why (`kernels='reference'` runs it).

MXFP4 routed experts (`mxfp4.Mxfp4Experts`, AMD Quark's export) multiply here too: `grouped_matmul` through
`pallas_kernels.grouped_matmul_mxfp4` of the backend ("reference": the dequantize + ragged_dot reference),
`ragged_dot` and `einsum` (dense experts, the reference) on the dequantized weight; each after its inputs went
through what the checkpoint declares for them (`mxfp4.activations_as_declared`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import pallas_kernels
from dcp_jax.model import mxfp4
from pallas_kernels import formats
from pallas_kernels.formats import AMAX_FLOOR, E4M3_MAX

HIGHEST = jax.lax.Precision.HIGHEST

# (in_axes, out_axes) of each leaf DeepSeek's release stores in block fp8 (`memory_plan.BLOCK_FP8_LEAVES`), counted
# from the last axis, so a weight stacked over layers (`deepseek_v32.LayerStack`) keeps them.
FP8_AXES = {
    "wqkv_a": ((-2,), (-1,)),  # [D, Q+C+E]
    "wq_b": ((-3,), (-2, -1)),  # [Q, H, N+E]
    "w_uk": ((-1,), (-2,)),  # [H, N, C]: HF's per-head [out, in]
    "w_uv": ((-1,), (-2,)),  # [H, V, C]
    "wo": ((-3, -2), (-1,)),  # [H, V, D]
    "index_wq": ((-3,), (-2, -1)),  # [Q, I, J]
    "index_wk": ((-2,), (-1,)),  # [D, J]
    "gate_up": ((-3,), (-1,)),  # [D, 2, F]: gate, then up (the pair a batch axis)
    "down": ((-2,), (-1,)),  # [F, D]
    "experts_gate": ((-2,), (-1,)),  # [X, D, F]
    "experts_up": ((-2,), (-1,)),  # [X, D, F]
    "experts_down": ((-2,), (-1,)),  # [X, F, D]
}


def _axes_order(ndim: int, in_axes, out_axes) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(batch, output, input) axes of a plain weight of `ndim` axes, non-negative: the batch axes are the others, in
    order (gate_up's pair sits between its input and output axes)."""
    ins, outs = (tuple(a % ndim for a in axes) for axes in (in_axes, out_axes))
    return tuple(a for a in range(ndim) if a not in ins + outs), outs, ins


class _KMajor:
    """The plain weight's axes as a K-major leaf holds them (`values`: batch, output, input; `in_axes` /
    `out_axes` name the plain weight's)."""

    @property
    def order(self) -> tuple[int, ...]:
        """The plain weight's axes in the order `values` holds them."""
        return sum(_axes_order(self.values.ndim, self.in_axes, self.out_axes), ())

    @property
    def shape(self) -> tuple[int, ...]:
        """The plain weight's shape."""
        order = self.order
        return tuple(self.values.shape[order.index(a)] for a in range(len(order)))

    @property
    def batch_axes(self) -> tuple[int, ...]:
        return _axes_order(self.values.ndim, self.in_axes, self.out_axes)[0]

    def matrices(self):
        """`values` as [*batch, N, K]."""
        batch = len(self.batch_axes)
        width = math.prod(self.values.shape[batch: batch + len(self.out_axes)])
        return self.values.reshape(*self.values.shape[:batch], width, -1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8BlockWeight(_KMajor):
    """A block-fp8 weight (module docstring)."""

    # float8_e4m3fn: the plain weight's axes reordered batch, output, input (K-major).
    values: jax.Array
    # f32 [*batch, ceil(N / bn), ceil(K / bk)]: one scale per block, split as `weight_spec` says.
    scales: jax.Array
    # HF's weight_block_size (bn output rows, bk input columns).
    block: tuple[int, int] = dataclasses.field(metadata=dict(static=True))
    # The axes of the plain weight that x @ W contracts (K, flattened in order) and those it produces (N),
    # negative (from the last); the others, in order, are batch axes.
    in_axes: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    out_axes: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))


def from_plain_layout(values, scales, block: tuple[int, int], in_axes, out_axes) -> Fp8BlockWeight:
    """An Fp8BlockWeight of e4m3 `values` in the plain weight's layout (numpy or jax) and its scales."""
    return Fp8BlockWeight(values.transpose(sum(_axes_order(values.ndim, in_axes, out_axes), ())), scales,
                          tuple(block), tuple(in_axes), tuple(out_axes))


def is_fp8(x) -> bool:
    return isinstance(x, Fp8BlockWeight)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8ChannelWeight(_KMajor):
    """A per-channel fp8 weight (module docstring, ptpc_fp8)."""

    # float8_e4m3fn: the plain weight's axes reordered batch, output, input (K-major), as Fp8BlockWeight's.
    values: jax.Array
    # f32 [*batch, N]: one scale per output channel (N the output axes flattened).
    scales: jax.Array
    in_axes: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    out_axes: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))


# The linear leaves ptpc_fp8 leaves unquantized (the seed's exclude_layer: lm_head, model.embed_tokens, *.mlp.gate,
# *expert*): every expert, routed (kept as the checkpoint holds them) and shared (params under "shared"); lm_head, the
# embedding and the router are no `FP8_AXES` leaf anyway.
PTPC_EXCLUDED = ("experts_gate", "experts_up", "experts_down")


def quantize_channels(w, in_axes: tuple[int, ...], out_axes: tuple[int, ...]) -> Fp8ChannelWeight:
    """A weight in our layout -> its per-channel fp8 form: scale = max(amax of the output channel, 1e-4) / 448,
    values e4m3(w / scale)."""
    batch, outs, ins = _axes_order(w.ndim, in_axes, out_axes)
    reordered = jnp.transpose(w.astype(jnp.float32), batch + outs + ins)
    m = reordered.reshape(*reordered.shape[: len(batch)], math.prod(w.shape[a] for a in outs), -1)  # [.., N, K]
    scales = jnp.maximum(jnp.abs(m).max(axis=-1), AMAX_FLOOR) / E4M3_MAX
    values = (m / scales[..., None]).astype(jnp.float8_e4m3fn).reshape(reordered.shape)
    return Fp8ChannelWeight(values, scales, tuple(in_axes), tuple(out_axes))


def dequantize_channels(w: Fp8ChannelWeight):
    """f32 weight in our layout: each e4m3 value times its output channel's scale."""
    m = w.matrices().astype(jnp.float32) * w.scales[..., None]
    return jnp.transpose(m.reshape(w.values.shape), [w.order.index(a) for a in range(w.values.ndim)])


def quantize_channels_params(params: dict) -> dict:
    """A pure-dict model state with every `FP8_AXES` leaf outside `PTPC_EXCLUDED` and the shared experts ("shared"
    in its path) in per-channel fp8 (`quantize_channels`); the rest unchanged. Under `jax.eval_shape` it gives the
    abstract state."""

    def leaf(path, x):
        names = [getattr(k, "key", None) for k in path]
        if not channel_quantized(names) or is_quantized(x):
            return x
        return quantize_channels(x, *FP8_AXES[names[-1]])

    return jax.tree_util.tree_map_with_path(leaf, params, is_leaf=is_quantized)


def channel_quantized(names: list) -> bool:
    """Whether ptpc_fp8 quantizes the leaf at this path (its keys): an `FP8_AXES` leaf, no expert."""
    return names[-1] in FP8_AXES and names[-1] not in PTPC_EXCLUDED and "shared" not in names


def has_channel_weights(params) -> bool:
    """Whether `params` hold per-channel fp8 weights (ptpc_fp8)."""
    return any(isinstance(leaf, Fp8ChannelWeight) for leaf in jax.tree.leaves(params, is_leaf=is_quantized))


def channel_weight_spec(w: Fp8ChannelWeight, spec: P) -> Fp8ChannelWeight:
    """The specs of an Fp8ChannelWeight's values and scales for `spec`, the plain weight's: the values as its axes;
    the scales [*batch, N] as the batch axes and the first output axis (N flattens the output axes, the first
    leading)."""
    axes = _padded(spec, len(w.shape))
    batch, outs, ins = _axes_order(len(w.shape), w.in_axes, w.out_axes)
    if any(axes[a] is not None for a in outs[1:]):
        raise ValueError(f"{spec=} splits an inner output axis of {outs}: the channel scales would not follow")
    return Fp8ChannelWeight(P(*(axes[a] for a in batch + outs + ins)), P(*(axes[a] for a in batch), axes[outs[0]]),
                            w.in_axes, w.out_axes)


def _channel_einsum(equation: str, x, w: Fp8ChannelWeight, backend: str):
    """The product with a per-channel fp8 weight, x's contracted axes (its last ones) quantized with one scale a
    token: under "reference" the activations back in f32 times the dequantized weight; else one fp8 GEMM of scale
    blocks (1, K) (a scale a channel and a token) over the weight's matrices stacked along N."""
    _, output, contracted = _fp8_letters(equation, w)
    depth = math.prod(w.shape[a] for a in w.in_axes)
    if backend == "reference":
        x32 = _quantized_activations(x, len(contracted), depth)
        return jnp.einsum(equation, x32, dequantize_channels(w), precision=HIGHEST).astype(x.dtype)
    _check_kernel_output(equation, w)
    values, x_scales = act_quant(x.reshape(-1, depth), depth)
    out = pallas_kernels.fp8_gemm(values, x_scales, w.matrices().reshape(-1, depth), w.scales.reshape(-1, 1),
                                  block=(1, depth), out_dtype=x.dtype, backend=backend)
    return out.reshape(*x.shape[: x.ndim - len(contracted)], *(w.shape[a] for a in w.batch_axes + w.out_axes))


def is_quantized(x) -> bool:
    """A quantized weight leaf: block or per-channel fp8, or MXFP4 experts (a pytree node of its arrays)."""
    return isinstance(x, (Fp8BlockWeight, Fp8ChannelWeight)) or mxfp4.is_mxfp4(x)


def _expand(scales, rows: int, cols: int, block_rows: int, block_cols: int):
    """[..., ceil(rows/br), ceil(cols/bc)] -> one scale per element [..., rows, cols] (edge blocks partial)."""
    return jnp.repeat(jnp.repeat(scales, block_rows, axis=-2)[..., :rows, :], block_cols, axis=-1)[..., :cols]


def quantize(w, block: tuple[int, int], in_axes: tuple[int, ...], out_axes: tuple[int, ...]) -> Fp8BlockWeight:
    """A weight in our layout -> its block fp8 form: per block, scale = amax / 448 (amax floored at 1e-4, so an
    all-zero block keeps a finite scale) and values e4m3(w / scale), as DeepSeek's release was made."""
    bn, bk = block
    batch, outs, ins = _axes_order(w.ndim, in_axes, out_axes)
    reordered = jnp.transpose(w.astype(jnp.float32), batch + outs + ins)
    m = reordered.reshape(*reordered.shape[: len(batch)], math.prod(w.shape[a] for a in outs), -1)  # [.., N, K]
    n, k = m.shape[-2:]
    padded = jnp.pad(jnp.abs(m), [(0, 0)] * (m.ndim - 2) + [(0, -n % bn), (0, -k % bk)])
    blocks = padded.reshape(*m.shape[:-2], padded.shape[-2] // bn, bn, padded.shape[-1] // bk, bk)
    scales = jnp.maximum(blocks.max(axis=(-3, -1)), AMAX_FLOOR) / E4M3_MAX
    values = (m / _expand(scales, n, k, bn, bk)).astype(jnp.float8_e4m3fn).reshape(reordered.shape)
    return Fp8BlockWeight(values, scales, tuple(block), tuple(in_axes), tuple(out_axes))


def dequantize(w: Fp8BlockWeight):
    """f32 weight in our layout: each e4m3 value times its block's scale."""
    m = w.matrices().astype(jnp.float32)
    m = m * _expand(w.scales, *m.shape[-2:], *w.block)
    return jnp.transpose(m.reshape(w.values.shape), [w.order.index(a) for a in range(w.values.ndim)])


def weight_values(w, dtype):
    """The weight as a plain array: a plain one as it is, an `Fp8BlockWeight` or `Mxfp4Experts` dequantized into
    `dtype`."""
    if mxfp4.is_mxfp4(w):
        return mxfp4.dequantize(w, dtype)
    if isinstance(w, Fp8ChannelWeight):
        return dequantize_channels(w).astype(dtype)
    return dequantize(w).astype(dtype) if isinstance(w, Fp8BlockWeight) else w


def act_quant(x, group: int):
    """DeepSeek's act_quant over the last axis in groups of `group` channels (the last one partial): x [..., K] ->
    (e4m3 values [..., K], f32 scales [..., ceil(K / group)]) with scale = max(amax, 1e-4) / 448."""
    k = x.shape[-1]
    padded = jnp.pad(x.astype(jnp.float32), [(0, 0)] * (x.ndim - 1) + [(0, -k % group)])
    groups = padded.reshape(*x.shape[:-1], -1, group)
    scales = jnp.maximum(jnp.abs(groups).max(axis=-1), AMAX_FLOOR) / E4M3_MAX
    values = (groups / scales[..., None]).astype(jnp.float8_e4m3fn).reshape(padded.shape)[..., :k]
    return values, scales


def _quantized_activations(x, axes: int, group: int):
    """x with its last `axes` axes (flattened, in order) through act_quant and back, in f32."""
    lead = x.shape[: x.ndim - axes]
    flat = x.reshape(*lead, -1)
    values, scales = act_quant(flat, group)
    values = formats.kept_e4m3(values)
    per_channel = jnp.repeat(scales, group, axis=-1)[..., : flat.shape[-1]]
    return (values.astype(jnp.float32) * per_channel).reshape(x.shape)


def einsum(equation: str, x, w, *, backend: str):
    """`jnp.einsum(equation, x, w)` for activations x and a weight w, plain or `Fp8BlockWeight`; output in x's
    dtype. With fp8 the contracted letters must be w's input axes, in order, and x's last axes; `backend` (the
    kernels', `pallas_kernels.BACKENDS`) says whether the fp8 GEMM kernel may run (module docstring)."""
    if backend not in pallas_kernels.BACKENDS:
        raise ValueError(f"backend must be one of {pallas_kernels.BACKENDS}; got {backend!r}")
    if isinstance(w, Fp8BlockWeight):
        return _fp8_einsum(equation, x, w, backend)
    if isinstance(w, Fp8ChannelWeight):
        return _channel_einsum(equation, x, w, backend)
    if mxfp4.is_mxfp4(w):
        return _mxfp4_einsum(equation, x, w)
    return jnp.einsum(equation, x, w, precision=HIGHEST)


def _mxfp4_einsum(equation: str, x, w):
    """The product with MXFP4 experts (plain layout [..., X, in, out]): x's inputs as declared, the weight
    dequantized, f32; x's last letter must be w's input letter (its blocks of 32 are x's)."""
    inputs, _ = equation.split("->")
    x_letters, w_letters = inputs.split(",")
    if x_letters[-1] != w_letters[-2]:
        raise ValueError(f"{equation!r}: MXFP4 experts contract their input axis with x's last axis")
    x32 = mxfp4.activations_as_declared(x, w).astype(jnp.float32)
    return jnp.einsum(equation, x32, mxfp4.dequantize(w), precision=HIGHEST).astype(x.dtype)


def _fp8_letters(equation: str, w) -> tuple[str, str, str]:
    """(x's letters, the output's, the contracted ones) of `equation` for an fp8 weight w; ValueError unless the
    contracted letters are w's input axes, in order, and x's last ones."""
    inputs, output = equation.replace("...", "").split("->")
    lhs, rhs = inputs.split(",")
    contracted = "".join(rhs[a] for a in w.in_axes)
    if set(contracted) != set(lhs) & set(rhs) - set(output) or not lhs.endswith(contracted):
        raise ValueError(f"{equation=}: an fp8 weight contracts its input axes {contracted!r}, the activations' last")
    return lhs, output, contracted


def _check_kernel_output(equation: str, w) -> None:
    """ValueError unless the output letters are x's uncontracted ones, then the weight's batch letters (so x lacks
    them: an einsum output names a letter once; their matrices stack along N), then its output ones: what one fp8
    GEMM of the stacked matrices gives."""
    lhs, output, contracted = _fp8_letters(equation, w)
    rhs = equation.replace("...", "").split("->")[0].split(",")[1]
    stacked = "".join(rhs[a] for a in w.batch_axes)
    if output != lhs[: len(lhs) - len(contracted)] + stacked + "".join(rhs[a] for a in w.out_axes):
        raise ValueError(f"{equation=}: the fp8 GEMM kernels multiply activations by a weight whose batch axes "
                         f"{stacked!r} they lack; run this product with kernels='reference'")


def _fp8_einsum(equation: str, x, w: Fp8BlockWeight, backend: str):
    _, _, contracted = _fp8_letters(equation, w)
    if backend == "reference":
        x32 = _quantized_activations(x, len(contracted), w.block[1])
        return jnp.einsum(equation, x32, dequantize(w), precision=HIGHEST).astype(x.dtype)
    _check_kernel_output(equation, w)
    rows = x.reshape(-1, math.prod(w.shape[a] for a in w.in_axes))
    values, x_scales = act_quant(rows, w.block[1])
    matrices, scales = _stacked_matrices(w)
    if matrices is not None:
        out = _gemm(values, x_scales, matrices, scales, w, backend, x.dtype)
    else:  # each matrix's N ends mid-block, so its scale rows would not stack: one GEMM a matrix
        per_matrix = w.matrices().reshape(-1, *w.matrices().shape[-2:])
        per_scales = w.scales.reshape(-1, *w.scales.shape[-2:])
        out = jnp.concatenate([_gemm(values, x_scales, m, s, w, backend, x.dtype)
                               for m, s in zip(per_matrix, per_scales)], axis=-1)
    return out.reshape(*x.shape[: x.ndim - len(contracted)], *(w.shape[a] for a in w.batch_axes + w.out_axes))


def _gemm(values, x_scales, matrices, scales, w: Fp8BlockWeight, backend: str, out_dtype):
    """rows [M, K] (e4m3, with their scales) times matrices [N, K] through the implementation `backend` runs them
    with (`_gemm_implementation`)."""
    implementation = _gemm_implementation(values.shape[0], matrices, scales, w, backend)
    return pallas_kernels.fp8_gemm(values, x_scales, matrices, scales, block=w.block, out_dtype=out_dtype,
                                   backend=implementation)


def _stacked_matrices(w: Fp8BlockWeight):
    """w's matrices and scales as one [B * N, K] GEMM operand over its batch axes (B their product; the identity
    without them); (None, None) when a matrix's N ends mid-block, so its scale rows would not stack."""
    matrices = w.matrices()
    if not w.batch_axes:
        return matrices, w.scales
    if matrices.shape[-2] % w.block[0]:
        return None, None
    return matrices.reshape(-1, matrices.shape[-1]), w.scales.reshape(-1, w.scales.shape[-1])


def quantized_rows(num_rows: int, w: Fp8BlockWeight) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    """The abstract `act_quant` of num_rows activation rows for w: e4m3 [num_rows, K] and f32 scales [num_rows, K
    blocks] (what the fp8 kernels' `unsupported` checks)."""
    depth = math.prod(w.shape[a] for a in w.in_axes)
    return (jax.ShapeDtypeStruct((num_rows, depth), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((num_rows, w.scales.shape[-1]), jnp.float32))


def _gemm_implementation(num_rows: int, matrices, scales, w: Fp8BlockWeight, backend: str) -> str:
    """The fp8 GEMM implementation `backend` runs num_rows rows times these (stacked) matrices [N, K] and scales with
    (`pallas_kernels.choose`: "pallas" picks the Mosaic kernel where it applies, else the Triton one); ValueError
    with each one's reasons where none does."""
    return pallas_kernels.choose("fp8_gemm", backend, *quantized_rows(num_rows, w), matrices, scales, block=w.block)


def ragged_dot(x, w, group_sizes):
    """`jax.lax.ragged_dot(x [A, K], w [G, K, N], group_sizes)` for a plain, `Fp8BlockWeight` or `Mxfp4Experts` w
    (x's inputs as declared, the weight dequantized, f32); x's dtype."""
    if isinstance(w, Fp8BlockWeight):
        return _fp8_ragged_dot(x, w, group_sizes)
    if mxfp4.is_mxfp4(w):
        x32 = mxfp4.activations_as_declared(x, w).astype(jnp.float32)
        return jax.lax.ragged_dot(x32, mxfp4.dequantize(w), group_sizes, precision=HIGHEST).astype(x.dtype)
    return jax.lax.ragged_dot(x, w, group_sizes, precision=HIGHEST)


def grouped_matmul(x, w, group_sizes, *, backend: str, rows_per_group=None, **knobs):
    """`ragged_dot(x, w, group_sizes)` through the Pallas kernels of `backend` (`pallas_kernels.grouped_matmul`; an
    `Fp8BlockWeight` with x quantized by `act_quant` per its input blocks: `pallas_kernels.grouped_matmul_fp8`, whose
    scaling of each block's product equals the dequantized product's sum; `Mxfp4Experts` with x as declared:
    `pallas_kernels.grouped_matmul_mxfp4`, "reference" its dequantize + ragged_dot reference); x's dtype. `knobs` go
    to the kernel."""
    if mxfp4.is_mxfp4(w):
        return pallas_kernels.grouped_matmul_mxfp4(mxfp4.activations_as_declared(x, w), w.weight(), group_sizes,
                                                   out_dtype=x.dtype, rows_per_group=rows_per_group,
                                                   backend=backend, **knobs)
    if not isinstance(w, Fp8BlockWeight):
        return pallas_kernels.grouped_matmul(x, w, group_sizes, rows_per_group=rows_per_group, backend=backend,
                                             **knobs)
    problem = grouped_layout_problem(w)
    if problem:
        raise ValueError(problem)
    values, scales = act_quant(x, w.block[1])
    return pallas_kernels.grouped_matmul_fp8(values, scales, w.values, w.scales, group_sizes, block=w.block,
                                             out_dtype=x.dtype, rows_per_group=rows_per_group, backend=backend,
                                             **knobs)


def grouped_layout_problem(w: Fp8BlockWeight) -> str | None:
    """Why `grouped_matmul` cannot take this fp8 weight as [G, K, N] (its values [G, N, K]) (None: it can)."""
    if w.in_axes != (-2,) or w.out_axes != (-1,) or w.values.ndim != 3:
        return f"a grouped fp8 weight is [G, K, N] with K its input axis; got {w.shape} {w.in_axes=} {w.out_axes=}"
    return None


def _fp8_ragged_dot(x, w: Fp8BlockWeight, group_sizes):
    x32 = _quantized_activations(x, 1, w.block[1])
    return jax.lax.ragged_dot(x32, dequantize(w), group_sizes, precision=HIGHEST).astype(x.dtype)


def quantize_params(params: dict, block: tuple[int, int]) -> dict:
    """A pure-dict model state with every `FP8_AXES` leaf quantized (`quantize`); the rest unchanged. Under
    `jax.eval_shape` it gives the abstract fp8 state."""

    def leaf(path, x):
        name = getattr(path[-1], "key", None)
        return quantize(x, block, *FP8_AXES[name]) if name in FP8_AXES else x

    return jax.tree_util.tree_map_with_path(leaf, params)


def weight_block(params) -> tuple[int, int] | None:
    """The block of the `Fp8BlockWeight`s in `params` (None when every weight is plain)."""
    blocks = {leaf.block for leaf in jax.tree.leaves(params, is_leaf=is_fp8) if is_fp8(leaf)}
    if len(blocks) > 1:
        raise ValueError(f"the fp8 weights mix blocks {sorted(blocks)}")
    return blocks.pop() if blocks else None


def _padded(spec: P, ndim: int) -> tuple:
    return tuple(spec) + (None,) * (ndim - len(spec))


def weight_spec(w, spec: P):
    """The specs of a quantized leaf's arrays for `spec`, the plain weight's, as a leaf of its kind: an
    Fp8BlockWeight's values and scales (module docstring), `mxfp4.weight_spec` for `Mxfp4Experts`."""
    if mxfp4.is_mxfp4(w):
        return mxfp4.weight_spec(w, spec)
    if isinstance(w, Fp8ChannelWeight):
        return channel_weight_spec(w, spec)
    axes = _padded(spec, len(w.shape))
    batch, outs, ins = _axes_order(len(w.shape), w.in_axes, w.out_axes)
    for group in (ins, outs):
        if any(axes[a] is not None for a in group[1:]):
            raise ValueError(f"{spec=} splits an inner axis of {group}: its blocks would not follow the split")
    values = P(*(axes[a] for a in batch + outs + ins))
    scales = P(*(axes[a] for a in batch), axes[outs[0]], axes[ins[0]])
    return Fp8BlockWeight(values, scales, w.block, w.in_axes, w.out_axes)


def plain_spec(w: Fp8BlockWeight, values_spec: P) -> P:
    """The plain weight's spec from that of w's values (`weight_spec`'s inverse)."""
    axes, order = _padded(values_spec, len(w.shape)), w.order
    return P(*(axes[order.index(a)] for a in range(len(order))))


def check_shardable(name: str, w: Fp8BlockWeight, spec: P, mesh_shape: dict[str, int]) -> None:
    """ValueError naming the leaf unless every rank's slice of its split input / output axes is whole blocks (one
    rank's slice is the whole axis: its edge block may be partial)."""
    axes = _padded(spec, len(w.shape))
    bn, bk = w.block
    for group, size, kind in ((w.in_axes, bk, "input"), (w.out_axes, bn, "output")):
        split = axes[group[0]]
        names = () if split is None else split if isinstance(split, tuple) else (split,)
        ranks = math.prod(mesh_shape[a] for a in names)
        if ranks == 1:
            continue
        per_rank = math.prod(w.shape[a] for a in group) // ranks
        if per_rank % size:
            raise ValueError(f"{name}: a rank's {kind} slice of {per_rank} is not a whole number of fp8 blocks of "
                             f"{size} (weight_block_size {list(w.block)}, {ranks} ranks); load it with "
                             "quantization='none'")
