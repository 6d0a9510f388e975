"""Static check on a traced program: does anything derive from the global positions or lengths?

The host hands every program per-rank local lengths. Global positions may only become RoPE angles: converted to a
float, broadcast, scaled (mul) and ended by cos/sin, whose outputs are free to use; and they may be moved unchanged
(a static slice: a micro-batch's rows; a gather of host-built entries at indices not derived from them: a verify's
kept-draft count picking a chained draft row's), the moved values followed as the originals. `length_derivations`
follows every value computed from the global inputs through the jaxpr, into sub-jaxprs (jit, shard_map,
control flow), whatever its dtype, and reports every other operation applied to one: the "fallback"
arithmetic (floordiv, mul, sub, clamp, ...), a comparison mask, a float round trip, a reduction.
`local_context_lens_on_device` is that arithmetic, the counterexample the tests wire in to show the check fails.
`host_syncs` finds what would make a program's launch wait for the device: a data-dependent branch or loop.
"""

from __future__ import annotations

from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core

# The RoPE angle path: positions -> float -> broadcast -> * inv_freq; cos/sin end it. A static slice (a micro-batch's
# rows) moves values without deriving any.
_ROPE_PATH = frozenset({"convert_element_type", "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "mul", "copy",
                        "slice"})
_ROPE_END = frozenset({"cos", "sin"})


def _sub_jaxprs(eqn) -> Iterable[core.Jaxpr]:
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, core.Jaxpr):
                yield item


def _is_tainted(var, tainted: set) -> bool:
    return not isinstance(var, core.Literal) and var in tainted


def _is_float(var) -> bool:
    return np.issubdtype(var.aval.dtype, np.floating)


def _is_rope_step(eqn) -> bool:
    if eqn.primitive.name == "convert_element_type":  # to a float only: a cast back to int would floor
        return all(_is_float(v) for v in eqn.outvars)
    return eqn.primitive.name in _ROPE_PATH


# Moves of an operand (its first input) to positions given by its other inputs.
_SELECTIONS = frozenset({"gather"})


def _is_selection(eqn, tainted: set) -> bool:
    """A gather of tainted values at untainted indices: entries moved, none computed."""
    return eqn.primitive.name in _SELECTIONS and not any(_is_tainted(v, tainted) for v in eqn.invars[1:])


def _walk(jaxpr: core.Jaxpr, tainted: set, found: list[str], where: str) -> None:
    """Extend `tainted` (vars derived from the global inputs) through `jaxpr`, recording every use of one that
    is not a step of the RoPE angle path."""
    for eqn in jaxpr.eqns:
        if not any(_is_tainted(v, tainted) for v in eqn.invars):
            continue
        name = eqn.primitive.name
        subs = list(_sub_jaxprs(eqn))
        for sub in subs:
            if len(sub.invars) == len(eqn.invars):  # positional pass-through (jit, shard_map, ...)
                sub_tainted = {s for s, v in zip(sub.invars, eqn.invars) if _is_tainted(v, tainted)}
            else:  # control flow with extra operands: every input, conservatively
                sub_tainted = set(sub.invars)
            _walk(sub, sub_tainted, found, f"{where}{name}/")
            if len(sub.outvars) == len(eqn.outvars):
                tainted.update(o for o, s in zip(eqn.outvars, sub.outvars) if _is_tainted(s, sub_tainted))
            else:
                tainted.update(eqn.outvars)
        if subs or name in _ROPE_END:
            continue
        if not (_is_rope_step(eqn) or _is_selection(eqn, tainted)):
            found.append(f"{where}{name}: {eqn}")
        tainted.update(eqn.outvars)


def length_derivations(closed: core.ClosedJaxpr, global_input_indices: Iterable[int]) -> list[str]:
    """Uses of the flat inputs at `global_input_indices` other than the RoPE angle path (empty list = clean)."""
    jaxpr = closed.jaxpr
    found: list[str] = []
    _walk(jaxpr, {jaxpr.invars[i] for i in global_input_indices}, found, "")
    return found


# Control flow whose GPU runtime copies a device value (a branch index, a loop predicate) to the host and waits for
# it, inside the launch: the host could not dispatch the next step ahead. (A scan's trip count is static: no wait.)
_HOST_SYNCS = frozenset({"cond", "while"})


def host_syncs(closed: core.ClosedJaxpr) -> list[str]:
    """The `cond` and `while` operations of a traced program, in sub-jaxprs too (not inside a Pallas kernel,
    whose control flow runs on the device); empty = its launch never waits for the device."""
    found: list[str] = []

    def walk(jaxpr: core.Jaxpr, where: str) -> None:
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name in _HOST_SYNCS:
                found.append(f"{where}{name}")
            if name != "pallas_call":
                for sub in _sub_jaxprs(eqn):
                    walk(sub, f"{where}{name}/")

    walk(closed.jaxpr, "")
    return found


def flat_indices_of(args, select) -> list[int]:
    """Flat-leaf indices of the leaves of `args` picked by `select(args)` (a sub-pytree of `args`)."""
    picked = {id(leaf) for leaf in jax.tree.leaves(select(args))}
    return [i for i, leaf in enumerate(jax.tree.leaves(args)) if id(leaf) in picked]


def local_context_lens_on_device(context_lens, rank, *, dcp: int, interleave: int):
    """The device-side "fallback" derivation of a rank's local lengths from global ones (spec 2: 7 device ops).

    The counterexample of this module and of the fallback-vs-host benchmark only: no program may contain it (the
    host computes `DcpLayout.local_context_lens` instead).
    """
    base = (context_lens // (interleave * dcp)) * interleave
    rem = jnp.clip(context_lens - base * dcp - rank * interleave, 0, interleave)
    return base + rem
