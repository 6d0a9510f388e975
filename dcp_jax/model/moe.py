"""DeepSeek's mixture of experts: the router, the routed experts computed grouped by expert, the shared experts.

Router (HF's `noaux_tc`): sigmoid scores; the choice adds e_score_correction_bias (`router_bias`) to them; the
topk_group groups of highest choice (the sum of a group's top two) are kept and the num_experts_per_tok (k)
experts of highest choice among them chosen; their weights are the unbiased scores, normalized to sum 1 when
norm_topk_prob, times routed_scaling_factor.

Routed experts, grouped (`grouped_experts`): a step's R * k (row, expert) assignments are sorted by expert, each
expert multiplies only the rows routed to it (a grouped matmul: gate, up, silu(gate) * up, down) and the weighted
results are summed back into their rows. Shapes are static (R * k assignments whatever the routing); the group
sizes are traced counts. `dense_experts` is the reference: every expert on every row. Which one the model runs is
`MoE.partial`'s `backend`: grouped through `pallas_kernels.grouped_matmul` (block-fp8 experts: `grouped_matmul_fp8`)
under a kernels backend (weights it cannot take are a ValueError saying why), dense under "reference" (jax 0.11.2
lowers `jax.lax.ragged_dot` to a masked dense product on the GPU as on CPU: no faster than dense at decode, 3.4x
slower at 256 rows, and out of memory at prefill rows; bench_moe, docs/performance.md). MXFP4 experts
(`mxfp4.Mxfp4Experts`, AMD Quark's checkpoints) run grouped under every backend, through
`pallas_kernels.grouped_matmul_mxfp4` ("reference": its dequantize + ragged_dot reference), their inputs as the
checkpoint declares them (`mxfp4.activations_as_declared`: MXFP4 activations are a quantize-dequantize, emulated).

Parallelism, inside shard_map over the TP ranks (`mesh.HEADS`). The hidden state is replicated on every rank (the
attention block ends in a psum), so each rank routes every row itself: the dispatch is a local selection, and the
combine is the one psum over HEADS that also sums the shared experts' partial outputs (no all-to-all). The
routed experts are split as vLLM splits them:
- tensor parallel (the default): each rank holds every expert's slice of the width F (experts_gate / experts_up
  [X, D, F/tp], experts_down [X, F/tp, D]) and runs every assignment on it;
- expert parallel (`ParallelConfig.enable_expert_parallel`): each rank holds X/tp whole experts (rank r the ids
  from r * X/tp) and runs only the assignments routed to them; the others sort past its last expert, outside every
  group, and contribute nothing.
A rank reads which from its shard (`MoE.first_expert`). The shared experts are an MLP split over F either way.
`bench/bench_moe.py` times each computation.

Letters: see the legend in `dcp_jax/__init__.py`; k experts per row, so R * k assignments.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

import pallas_kernels
from dcp_jax.config import ModelConfig
from dcp_jax.model import fp8_linear, mxfp4
from dcp_jax.model.mesh import HEADS
from dcp_jax.model.mlp import MLP, dense_param

HIGHEST = jax.lax.Precision.HIGHEST
NEG_INF = float("-inf")


def expert_specs(expert_parallel: bool) -> dict[str, P]:
    """The routed experts' PartitionSpecs: split over every TP rank along X (expert parallel), else along F."""
    if expert_parallel:
        return {"experts_gate": P(HEADS, None, None), "experts_up": P(HEADS, None, None),
                "experts_down": P(HEADS, None, None)}
    return {"experts_gate": P(None, None, HEADS), "experts_up": P(None, None, HEADS),
            "experts_down": P(None, HEADS, None)}


def route(x, router, router_bias, cfg: ModelConfig):
    """x [R, D], router [D, X] f32, router_bias [X] f32 -> (experts [R, k] int32 ids, weights [R, k] f32)."""
    rows = x.shape[0]
    logits = jnp.einsum("rd,dx->rx", x.astype(jnp.float32), router, precision=HIGHEST)
    scores = jax.nn.sigmoid(logits)
    choice = scores + router_bias
    grouped = choice.reshape(rows, cfg.n_group, -1)
    group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [R, groups]: sum of each group's top two
    _, kept_groups = jax.lax.top_k(group_scores, cfg.topk_group)
    is_kept = jnp.zeros((rows, cfg.n_group), bool).at[jnp.arange(rows)[:, None], kept_groups].set(True)
    masked = jnp.where(jnp.repeat(is_kept, grouped.shape[-1], axis=1), choice, NEG_INF)
    _, experts = jax.lax.top_k(masked, cfg.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, experts, axis=1)  # unbiased scores
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return experts.astype(jnp.int32), weights * cfg.routed_scaling_factor


def grouped_experts(x, experts, weights, gate, up, down, *, first_expert, matmul=fp8_linear.ragged_dot):
    """x [R, D]; experts [R, k] global expert ids and weights [R, k] f32 (`route`); gate, up [x, D, F] and down
    [x, F, D] (plain, block fp8 or MXFP4) the experts first_expert .. first_expert + x - 1 (an int, or a traced one) ->
    [R, D] in x's dtype: each row's sum over its assignments to these experts of weight * down(silu(x gate) * x up).
    Assignments to other experts add nothing. Only the rows routed to an expert are multiplied by its weights, by
    `matmul(rows [R k, in], w [x, in, out], group_sizes [x])` (`jax.lax.ragged_dot`'s contract)."""
    rows, per_row = experts.shape
    local_experts = gate.shape[0]
    # 1. Each assignment's local expert; another rank's goes to group x, past the last local one.
    local = experts.reshape(-1) - first_expert  # [R k]
    is_local = (local >= 0) & (local < local_experts)
    group = jnp.where(is_local, local, local_experts)
    # 2. Sorted by group (stable: rows in order within one); the ragged dots leave group x out.
    order = jnp.argsort(group, stable=True)
    row_of = order // per_row  # [R k]: the row of each sorted assignment
    group_sizes = jnp.bincount(group, length=local_experts + 1)[:local_experts]
    # 3. The grouped GEMMs: expert j multiplies only its group_sizes[j] rows.
    sorted_x = x[row_of]  # [R k, D]
    hidden = jax.nn.silu(matmul(sorted_x, gate, group_sizes))
    hidden = hidden * matmul(sorted_x, up, group_sizes)
    out = matmul(hidden, down, group_sizes)  # [R k, D]
    # 4. Weighted sum back into the rows, in f32. Rows of group x are left unspecified by the matmul: selected
    # away, not multiplied by a zero weight (0 * NaN is NaN).
    weighted = out.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
    weighted = jnp.where(is_local[order][:, None], weighted, 0.0)
    return jax.ops.segment_sum(weighted, row_of, num_segments=rows).astype(x.dtype)


def dense_experts(x, experts, weights, gate, up, down, *, first_expert):
    """Reference of `grouped_experts` (same contract): every local expert runs on every row, weighted by the row's
    weight for it (zero when it did not choose it)."""
    local_experts = gate.shape[0]
    ids = first_expert + jnp.arange(local_experts)
    combine = jnp.sum(jnp.where(experts[:, :, None] == ids, weights[:, :, None], 0.0), axis=1)  # [R, x] f32
    hidden = jax.nn.silu(fp8_linear.einsum("rd,xdf->rxf", x, gate, backend="reference"))
    hidden = hidden * fp8_linear.einsum("rd,xdf->rxf", x, up, backend="reference")
    per_expert = fp8_linear.einsum("rxf,xfd->rxd", hidden, down, backend="reference")
    return jnp.einsum("rx,rxd->rd", combine, per_expert.astype(jnp.float32), precision=HIGHEST).astype(x.dtype)


def routed_experts(backend: str, x, gate, up, down, *, rows_per_expert: float):
    """The routed experts' computation for a kernels backend (`pallas_kernels.BACKENDS`) and these (local)
    weights: "reference" runs `dense_experts` (MXFP4 experts: `grouped_experts` through the reference of
    `grouped_matmul_mxfp4`); a kernels backend `grouped_experts` through `fp8_linear.grouped_matmul` (plain weights
    of x's dtype: `pallas_kernels.grouped_matmul`; block fp8: `grouped_matmul_fp8`; MXFP4: `grouped_matmul_mxfp4`),
    its tiles chosen for `rows_per_expert` (the assignments over all the experts: under expert parallelism the rows
    the kernel sees include other ranks'), or a ValueError saying why it cannot (`check_routed_experts`)."""
    if backend == "reference" and not mxfp4.is_mxfp4(gate):
        return dense_experts
    check_routed_experts(backend, x.dtype, gate, up, down)
    matmul = functools.partial(fp8_linear.grouped_matmul, backend=backend, rows_per_group=rows_per_expert)
    return functools.partial(grouped_experts, matmul=matmul)


def check_routed_experts(backend: str, dtype, gate, up, down) -> None:
    """ValueError unless the grouped matmul of kernels backend `backend` takes rows of `dtype` times these (local;
    arrays or ShapeDtypeStructs) expert weights; the "reference" backend takes any (as dense experts)."""
    if backend == "reference":
        return
    reasons = [reason for w in (gate, up, down) for reason in _kernel_refusals(backend, dtype, w)]
    if reasons:
        raise ValueError(f"the routed experts' grouped matmul (kernels backend {backend!r}) cannot take these "
                         f"weights: {'; '.join(dict.fromkeys(reasons))}; kernels='reference' runs them as dense "
                         f"experts")


def _kernel_refusals(backend: str, dtype, w) -> list[str]:
    """Why the grouped matmul of `backend` does not take rows of `dtype` times the expert weights w (empty: it
    does)."""
    sizes = jax.ShapeDtypeStruct((w.shape[0],), jnp.int32)
    if mxfp4.is_mxfp4(w):
        rows = jax.ShapeDtypeStruct((1, w.shape[-1]), dtype)
        return pallas_kernels.unsupported("grouped_matmul_mxfp4", backend, rows, w.weight(), sizes, out_dtype=dtype)
    if not fp8_linear.is_fp8(w):
        rows = jax.ShapeDtypeStruct((1, w.shape[1]), dtype)
        return pallas_kernels.unsupported("grouped_matmul", backend, rows, w, sizes)
    problem = fp8_linear.grouped_layout_problem(w)
    if problem:
        return [problem]
    return pallas_kernels.unsupported("grouped_matmul_fp8", backend, *fp8_linear.quantized_rows(1, w), w.values,
                                      w.scales, sizes, block=w.block)


class MoE(nnx.Module):
    """DeepSeek MoE: the router (f32, replicated), the routed experts (split by `expert_specs`), the shared
    experts (an MLP of width moe_intermediate_size * n_shared_experts, split over F)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        d, x, f = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
        self.cfg = cfg
        self.router = dense_param(rngs, (d, x), d, jnp.float32)
        self.router_bias = nnx.Param(0.1 * jax.random.normal(rngs.params(), (x,), jnp.float32))
        self.experts_gate = dense_param(rngs, (x, d, f), d, dtype)
        self.experts_up = dense_param(rngs, (x, d, f), d, dtype)
        self.experts_down = dense_param(rngs, (x, f, d), f, dtype)
        self.shared = MLP(d, f * cfg.n_shared_experts, rngs=rngs, dtype=dtype)

    def route(self, x):
        """x [R, D] -> (experts [R, k] int32, weights [R, k] f32) (`route`)."""
        return route(x, self.router[...], self.router_bias[...], self.cfg)

    def first_expert(self):
        """The id of this rank's first expert: rank * x when its shard holds x < X whole experts (expert
        parallel), else 0 (every expert, a slice of F)."""
        local_experts = self.experts_gate.shape[0]
        if local_experts == self.cfg.n_routed_experts:
            return 0
        return jax.lax.axis_index(HEADS) * local_experts

    def partial(self, x, *, backend: str):
        """Per rank: x [R, D] -> this rank's share [R, D] of the output: its routed experts' (`routed_experts` for
        the kernels `backend`: "reference" runs them densely) and its slice of the shared experts'."""
        experts, weights = self.route(x)
        gate, up, down = (w.get_value() for w in (self.experts_gate, self.experts_up, self.experts_down))
        cfg = self.cfg
        run = routed_experts(backend, x, gate, up, down,
                             rows_per_expert=x.shape[0] * cfg.num_experts_per_tok / cfg.n_routed_experts)
        routed = run(x, experts, weights, gate, up, down, first_expert=self.first_expert())
        return routed + self.shared.partial(x, backend=backend)

    def __call__(self, x, *, backend: str):
        """Per rank: x [..., D] -> [..., D], summed over the TP ranks."""
        shape = x.shape
        return jax.lax.psum(self.partial(x.reshape(-1, shape[-1]), backend=backend), HEADS).reshape(shape)
