"""Declared array fields of the step's host dataclasses (numpy only, no jax).

A step structure is a NamedTuple (so it is a jax pytree with no registration) whose fields are annotated with
their dims and dtype: `positions: Annotated[np.ndarray, spec("R")]`, or hold a nested structure. Dims are letters
of the legend in `dcp_jax/__init__.py` (or literal sizes); a structure's shapes, its structural check, its
abstract shapes (ShapeDtypeStructs for a compile), the per-rank view inside shard_map (`rank_view`: fields whose
first dim is W) and a view of some rows (`rows_view`: fields with an R dim) all come from these declarations, so a
new field is declared once, beside its documentation, and filled by its builder.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable, Mapping

import numpy as np

# The dim that holds one entry per DCP rank: a field whose first dim it is is split over "dcp".
RANK = "W"
# The dim of a step's query rows (the bucket).
ROW = "R"


@dataclasses.dataclass(frozen=True)
class Spec:
    """One array field: its dims (letters of the legend, or literal sizes) and dtype."""

    dims: tuple[str | int, ...]
    dtype: np.dtype

    @property
    def is_per_rank(self) -> bool:
        return bool(self.dims) and self.dims[0] == RANK

    def shape(self, sizes: Mapping[str, int]) -> tuple[int, ...]:
        return tuple(d if isinstance(d, int) else sizes[d] for d in self.dims)


def spec(dims: str, dtype=np.int32) -> Spec:
    """A field's Spec from its dims as a string of letters and sizes, e.g. spec("W R"), spec("U 2", np.uint32)."""
    return Spec(tuple(int(d) if d.isdigit() else d for d in dims.split()), np.dtype(dtype))


def is_structure(cls) -> bool:
    return isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields")


@functools.cache
def fields(cls) -> dict[str, Spec | type]:
    """The fields of structure `cls` in order: name -> its `Spec`, or the nested structure's class."""
    hints = typing.get_type_hints(cls, include_extras=True)
    out = {}
    for name in cls._fields:
        hint = hints[name]
        if typing.get_origin(hint) is typing.Annotated:
            out[name] = next(m for m in hint.__metadata__ if isinstance(m, Spec))
        elif is_structure(hint):
            out[name] = hint
        else:
            raise TypeError(f"{cls.__name__}.{name} is neither an annotated array nor a structure: {hint}")
    return out


def build(cls, sizes: Mapping[str, int], make: Callable[[tuple[int, ...], np.dtype], object]):
    """A `cls` whose every array is make(shape, dtype) (nested structures alike): zeros, ShapeDtypeStructs, ..."""
    return cls(**{name: build(field, sizes, make) if is_structure(field) else make(field.shape(sizes), field.dtype)
                  for name, field in fields(cls).items()})


def check(value, cls, sizes: Mapping[str, int]) -> None:
    """TypeError / ValueError naming the field unless `value` is a `cls` whose every array has its declared shape
    (under `sizes`) and dtype."""
    if not isinstance(value, cls):
        raise TypeError(f"expected {cls.__name__}, got {type(value).__name__}")
    for name, field in fields(cls).items():
        item = getattr(value, name)
        if is_structure(field):
            check(item, field, sizes)
            continue
        if item is None or not hasattr(item, "shape") or not hasattr(item, "dtype"):
            raise TypeError(f"{cls.__name__}.{name} must be an array, got {type(item).__name__}")
        if tuple(item.shape) != field.shape(sizes):
            raise ValueError(f"{cls.__name__}.{name} has shape {tuple(item.shape)}, expected {field.shape(sizes)}")
        if np.dtype(item.dtype) != field.dtype:
            raise TypeError(f"{cls.__name__}.{name} has dtype {item.dtype}, expected {field.dtype}")


def map_fields(fn: Callable[[Spec, object], object], value):
    """`value` (a structure) with every array replaced by fn(its Spec, it), nested structures alike."""
    cls = type(value)
    return cls(**{name: map_fields(fn, getattr(value, name)) if is_structure(field) else fn(field, getattr(value, name))
                  for name, field in fields(cls).items()})


def rank_view(value):
    """Inside shard_map: `value` with the size-1 rank axis of every per-rank field dropped."""
    return map_fields(lambda field, a: a[0] if field.is_per_rank else a, value)


def rows_view(value, rows: slice):
    """A rank's view (`rank_view`: per-rank fields without their W axis) of a run of the step's rows: every field of
    an R dim cut to `rows` (static bounds) along it, the rest whole. Nothing is rebuilt or copied by the host."""
    def cut(field, a):
        if ROW not in field.dims:
            return a
        index = [slice(None)] * a.ndim
        index[field.dims.index(ROW) - field.is_per_rank] = rows
        return a[tuple(index)]

    return map_fields(cut, value)
