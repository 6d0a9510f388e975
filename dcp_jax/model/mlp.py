"""The gated feed-forward block down(silu(x gate) * x up): the dense layers' MLP and DeepSeek's shared experts, with
the random initializer of the model's projections. gate and up are one weight, gate_up [2, D, F] (vLLM's
gate_up_proj); in block fp8 one GEMM computes both (its pair stacked along N: `fp8_linear.einsum`). F splits over
TP.

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
    """x [..., D], gate_up [2, D, F] (gate, then up) and down [F, D] (plain or block fp8) -> down(silu(x gate) *
    x up) [..., D] in x's dtype; `backend` the kernels' (`fp8_linear.einsum`)."""
    if fp8_linear.is_quantized(gate_up):
        gate_and_up = fp8_linear.einsum("...d,gdf->...gf", x, gate_up, backend=backend)
        gate, up = gate_and_up[..., 0, :], gate_and_up[..., 1, :]
    else:  # one plain [2, D, F] product would copy the weight into [D, 2F] each call (CPU's XLA did): two products
        gate, up = (fp8_linear.einsum("...d,df->...f", x, gate_up[i], backend=backend) for i in range(2))
    gated = jax.nn.silu(gate) * up
    return fp8_linear.einsum("...f,fd->...d", gated, down, backend=backend)


class MLP(nnx.Module):
    """down(silu(gate x) * up x); also the shared experts (width moe_intermediate_size * n_shared_experts)."""

    def __init__(self, hidden: int, width: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.gate_up = dense_param(rngs, (2, hidden, width), hidden, dtype)
        self.down = dense_param(rngs, (width, hidden), width, dtype)

    def partial(self, x, *, backend: str):
        """Per rank, width F split over TP ranks: x [..., D] -> this rank's share [..., D] of the output."""
        return gated_mlp(x, self.gate_up.get_value(), self.down.get_value(), backend=backend)

    def __call__(self, x, *, backend: str):
        """Per rank: x [..., D] -> [..., D], summed over the TP ranks; `backend` the kernels'."""
        return jax.lax.psum(self.partial(x, backend=backend), HEADS)
