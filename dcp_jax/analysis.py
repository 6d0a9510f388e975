"""Static checks on a traced decode step: does it derive anything from the global lengths?

The host hands the step per-rank local lengths; global positions may only feed RoPE (a float conversion).
`length_derivations` follows every value computed from the global inputs through the jaxpr, into
sub-jaxprs (jit, shard_map, control flow), and reports each integer arithmetic op applied to one: the
"fallback" arithmetic that derives local lengths on device (floordiv, mul, sub, clamp, add, ...).
"""

from __future__ import annotations

from collections.abc import Iterable

import jax
import numpy as np
from jax.extend import core

# Integer ops that arithmetic on a length would need.
_ARITHMETIC = frozenset(
    {"add", "sub", "mul", "div", "rem", "floor_divide", "max", "min", "clamp", "neg", "abs", "sign",
     "shift_left", "shift_right_arithmetic", "shift_right_logical", "integer_pow", "select_n"}
)


def _sub_jaxprs(eqn) -> Iterable[core.Jaxpr]:
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, core.Jaxpr):
                yield item


def _is_integer(var) -> bool:
    dtype = getattr(var.aval, "dtype", None)
    return dtype is not None and np.issubdtype(dtype, np.integer)


def _is_tainted(var, tainted: set) -> bool:
    return not isinstance(var, core.Literal) and var in tainted


def _walk(jaxpr: core.Jaxpr, tainted: set, found: list[str], where: str) -> None:
    """Extend `tainted` (vars derived from the global inputs) through `jaxpr`, recording arithmetic on them.
    Only integer values carry the taint: a float conversion (RoPE angles) ends it."""
    for eqn in jaxpr.eqns:
        if not any(_is_tainted(v, tainted) for v in eqn.invars):
            continue
        name = eqn.primitive.name
        if name in _ARITHMETIC and any(_is_integer(v) for v in eqn.outvars):
            found.append(f"{where}{name}: {eqn}")
        subs = list(_sub_jaxprs(eqn))
        if not subs:
            tainted.update(v for v in eqn.outvars if _is_integer(v))
        for sub in subs:
            if len(sub.invars) == len(eqn.invars):  # positional pass-through (jit, shard_map, ...)
                sub_tainted = {s for s, v in zip(sub.invars, eqn.invars) if _is_tainted(v, tainted)}
            else:  # control flow with extra operands: every integer input, conservatively
                sub_tainted = {s for s in sub.invars if _is_integer(s)}
            _walk(sub, sub_tainted, found, f"{where}{name}/")
            if len(sub.outvars) == len(eqn.outvars):
                tainted.update(o for o, s in zip(eqn.outvars, sub.outvars) if _is_tainted(s, sub_tainted) and _is_integer(o))
            else:
                tainted.update(o for o in eqn.outvars if _is_integer(o))


def length_derivations(closed: core.ClosedJaxpr, global_input_indices: Iterable[int]) -> list[str]:
    """Integer arithmetic reachable from the flat inputs at `global_input_indices` (empty list = clean)."""
    jaxpr = closed.jaxpr
    found: list[str] = []
    _walk(jaxpr, {jaxpr.invars[i] for i in global_input_indices}, found, "")
    return found


def flat_indices_of(args, select) -> list[int]:
    """Flat-leaf indices of the leaves of `args` picked by `select(args)` (a sub-pytree of `args`)."""
    picked = {id(leaf) for leaf in jax.tree.leaves(select(args))}
    return [i for i, leaf in enumerate(jax.tree.leaves(args)) if id(leaf) in picked]
