"""The gated feed-forward block down(silu(x gate) * x up): the dense layers' MLP and DeepSeek's shared experts, with
the random initializer of the model's projections. gate and up are one weight, gate_up [D, 2, F] (vLLM's
gate_up_proj), one GEMM for both: plain, of its [D, 2F] view, so the scan reads a layer's slice of its stack in place
(stored [2, D, F] and multiplied a half at a time, each layer's gate and up were copied out of the stack first:
docs/performance.md, "The step against its roofline"); in fp8 its pair stacked along N (`fp8_linear.einsum`). F
splits over TP.

Letters: see the legend in `dcp_jax/__init__.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dcp_jax.model import fp8_linear
from dcp_jax.model.mesh import HEADS


def dense_param(rngs: nnx.Rngs, shape, fan_in: int, dtype) -> nnx.Param:
    """A projection of `shape`, normal / sqrt(fan_in), in `dtype`."""
    return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) * fan_in**-0.5).astype(dtype))


def gated_mlp(x, gate_up, down, *, backend: str):
    """x [..., D], gate_up [D, 2, F] (gate, then up) and down [F, D] (plain, fp8) -> down(silu(x gate) * x up)
    [..., D] in x's dtype; `backend` the kernels' (`fp8_linear.einsum`)."""
    if fp8_linear.is_quantized(gate_up):
        gate_and_up = fp8_linear.einsum("...d,dgf->...gf", x, gate_up, backend=backend)
    else:
        depth, pair, width = gate_up.shape
        gate_and_up = fp8_linear.einsum("...d,dn->...n", x, gate_up.reshape(depth, pair * width),
                                        backend=backend).reshape(*x.shape[:-1], pair, width)
    gate, up = gate_and_up[..., 0, :], gate_and_up[..., 1, :]
    gated = jax.nn.silu(gate) * up
    return fp8_linear.einsum("...f,fd->...d", gated, down, backend=backend)


class MLP(nnx.Module):
    """down(silu(gate x) * up x); also the shared experts (width moe_intermediate_size * n_shared_experts)."""

    def __init__(self, hidden: int, width: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        # Drawn as [2, D, F] (gate's draws, then up's: every seed's weights as before the [D, 2, F] layout).
        gate_up = dense_param(rngs, (2, hidden, width), hidden, dtype)
        self.gate_up = nnx.Param(jnp.moveaxis(gate_up.get_value(), 0, 1))
        self.down = dense_param(rngs, (width, hidden), width, dtype)

    def partial(self, x, *, backend: str):
        """Per rank, width F split over TP ranks: x [..., D] -> this rank's share [..., D] of the output."""
        return gated_mlp(x, self.gate_up.get_value(), self.down.get_value(), backend=backend)

    def __call__(self, x, *, backend: str):
        """Per rank: x [..., D] -> [..., D], summed over the TP ranks; `backend` the kernels'."""
        return jax.lax.psum(self.partial(x, backend=backend), HEADS)
