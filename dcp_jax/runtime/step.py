"""The jitted, shard_mapped program of one engine step: host-side checks, one transfer, one compiled program per
bucket, the device state donated.

`StepProgram` wraps a per-rank body `body(params, state, inputs, md) -> (outputs, state)`, where `state` is the
donated device state (the KV cache, and the sampler's for the model) and `md` the rank's view of the step's
`StepMetadata` (`arrays.rank_view`: each per-rank field loses its W axis). A bucket is a row width R (decode rows
and prefill-chunk tokens together); every bucket is compiled once up front; a call never traces, and metadata of
an unknown bucket or the wrong shape is refused on the host before anything reaches the device. Metadata fields
declared per rank (`host/arrays.py`) are split over "dcp", everything else replicated.
One transfer a step: the host packs every array of (inputs, md) (all 4-byte types) into one int32 buffer, which the
compiled call transfers, and the program slices them back out by static offsets before the shard_map (a device_put
per array cost ~0.25 ms each).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import jax
import numpy as np
from jax.sharding import Mesh

from dcp_jax.host import arrays
from dcp_jax.host.layout import DcpLayout
from dcp_jax.host.step_inputs import StepInputs
from dcp_jax.host.step_metadata import StepMetadata, check_step_metadata, step_metadata_sizes
from dcp_jax.model.mesh import PER_DCP_RANK, REPLICATED, sharding
from dcp_jax.runtime.jaxpr_check import flat_indices_of, host_syncs, length_derivations
from dcp_jax.runtime.xla_flags import step_compiler_options


def metadata_specs(cls):
    """A `cls` of PartitionSpecs: per-rank fields split over "dcp", the others replicated."""
    return cls(**{name: PER_DCP_RANK if field.is_per_rank else REPLICATED
                  for name, field in arrays.fields(cls).items()})


@dataclasses.dataclass(frozen=True)
class Placed:
    """A step's inputs and metadata as one int32 buffer, for the program of `bucket`: on the devices, or a numpy
    array that the compiled call transfers."""

    bucket: int
    packed: jax.Array | np.ndarray


@dataclasses.dataclass(frozen=True)
class _Packing:
    """Where each array of a pytree of 4-byte arrays lies in one int32 buffer (static: a jit argument)."""

    treedef: object
    fields: tuple[tuple[int, tuple[int, ...], str], ...]  # (offset, shape, dtype name) per leaf
    size: int

    @classmethod
    def of(cls, shapes) -> _Packing:
        leaves, treedef = jax.tree.flatten(shapes)
        fields, offset = [], 0
        for leaf in leaves:
            if np.dtype(leaf.dtype).itemsize != 4:
                raise TypeError(f"only 4-byte arrays pack into the step's buffer, got {leaf.dtype}")
            fields.append((offset, tuple(leaf.shape), np.dtype(leaf.dtype).name))
            offset += int(np.prod(leaf.shape, dtype=np.int64))
        return cls(treedef, tuple(fields), offset)

    def pack(self, tree) -> np.ndarray:
        """Host: the buffer of `tree` (numpy arrays of the shapes and dtypes this packing was made of)."""
        leaves = jax.tree.leaves(tree)
        out = np.empty(self.size, np.int32)
        for leaf, (offset, shape, dtype) in zip(leaves, self.fields, strict=True):
            leaf = np.asarray(leaf, dtype)
            if leaf.shape != shape:
                raise ValueError(f"an array of shape {leaf.shape} where the bucket takes {shape}")
            out[offset: offset + leaf.size] = leaf.reshape(-1).view(np.int32)
        return out

    def views(self, packed: np.ndarray):
        """Host: the pytree as numpy views into `packed` (writing a view writes the buffer)."""
        leaves = [np.ndarray(shape, dtype, buffer=packed, offset=4 * offset) for offset, shape, dtype in self.fields]
        return self.treedef.unflatten(leaves)

    def unpack(self, packed):
        """Traced: the pytree back out of the buffer (static slices, bit casts)."""
        leaves = []
        for offset, shape, dtype in self.fields:
            part = packed[offset: offset + int(np.prod(shape, dtype=np.int64))].reshape(shape)
            leaves.append(part if dtype == "int32" else jax.lax.bitcast_convert_type(part, np.dtype(dtype)))
        return jax.tree.unflatten(self.treedef, leaves)


class StepProgram:
    """One compiled program per bucket (row width R) of a per-rank body, shard_mapped over the mesh; the device
    state is donated. The positions and global lengths of `StepMetadata` (`GLOBAL_FIELDS`) must reach nothing but
    RoPE (`length_derivations`)."""

    GLOBAL_FIELDS = ("positions", "context_lens", "draft_positions", "draft_context_lens")

    def __init__(self, body: Callable, mesh: Mesh, *, buckets: Iterable[int], seqs_for: Callable[[int], int],
                 layout: DcpLayout, max_blocks: int, num_pages: int, param_specs, input_specs, output_specs,
                 input_shapes: Callable[[int], object], state_specs, draft_offsets: int = 0):
        """`body(params, state, inputs, md)` per rank, with `md` the rank's view; `seqs_for(rows)` the sequence
        width of a bucket; `input_shapes(rows)` gives the inputs' ShapeDtypeStructs; `state_specs` the donated
        state's PartitionSpecs; `num_pages` the KV pool's pages (the page check);
        `draft_offsets` the offsets of the metadata's draft_* fields (`metadata.draft_offsets`; 0: none)."""
        self.mesh = mesh
        self.layout, self.max_blocks, self.num_pages = layout, max_blocks, num_pages
        self.draft_offsets = draft_offsets
        self.buckets = tuple(buckets)
        self._seqs = {rows: seqs_for(rows) for rows in self.buckets}
        self._input_shapes = input_shapes
        self._param_shardings = jax.tree.map(lambda spec: sharding(mesh, spec), param_specs)
        specs = metadata_specs(StepMetadata)
        self._md_shardings = jax.tree.map(lambda spec: sharding(mesh, spec), specs)

        def per_rank(params, state, inputs, md):
            return body(params, state, inputs, arrays.rank_view(md))

        self._sharded = jax.shard_map(
            per_rank, mesh=mesh, in_specs=(param_specs, state_specs, input_specs, specs),
            out_specs=(output_specs, state_specs),
            check_vma=False,  # Pallas kernels inside shard_map carry no vma annotations
        )

        def packed_program(params, state, packed, layout: _Packing):
            inputs, md = layout.unpack(packed)
            return self._sharded(params, state, inputs, md)

        self._jitted = jax.jit(packed_program, static_argnums=(3,), donate_argnums=(1,),
                               compiler_options=step_compiler_options())
        self._replicated = sharding(mesh, REPLICATED)
        self._lowered: dict[int, object] = {}
        self._compiled: dict[int, object] = {}
        self._packings: dict[int, _Packing] = {}


    def check(self, md) -> None:
        check_step_metadata(md, buckets=self._seqs, layout=self.layout, max_blocks=self.max_blocks,
                            num_pages=self.num_pages, offsets=self.draft_offsets)

    def place_params(self, params):
        """Params in the step's sharding (heads split over TP ranks), so no call reshards them."""
        return jax.device_put(params, self._param_shardings)

    def param_shapes(self, params):
        """ShapeDtypeStructs of `params` (arrays or ShapeDtypeStructs) in the step's sharding: what `lower` and
        `compile` need of the weights, so a program compiles without them (ahead of loading)."""
        return jax.tree.map(lambda a, placed: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed), params,
                            self._param_shardings)

    def metadata_shapes(self, bucket):
        """The metadata of `bucket` as ShapeDtypeStructs in the step's sharding."""
        sizes = step_metadata_sizes(bucket, self._seqs[bucket], self.layout.dcp_size, self.max_blocks,
                                    self.draft_offsets)
        shapes = arrays.build(StepMetadata, sizes, jax.ShapeDtypeStruct)
        return jax.tree.map(lambda a, placed: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed), shapes,
                            self._md_shardings)

    def _abstract_args(self, params, state, bucket):
        return params, state, self._input_shapes(bucket), self.metadata_shapes(bucket)

    def _packing(self, bucket) -> _Packing:
        if bucket not in self._packings:
            self._packings[bucket] = _Packing.of((self._input_shapes(bucket), self.metadata_shapes(bucket)))
        return self._packings[bucket]

    def lower(self, params, state, bucket):
        """Trace and lower the program of `bucket` (once), without the XLA compile. Lowering traces, so call it
        from one thread; `compile` of lowered buckets may then run in parallel threads (one per bucket)."""
        if bucket not in self.buckets:
            raise ValueError(f"{bucket=} is not a bucket {list(self.buckets)}")
        if bucket not in self._lowered and bucket not in self._compiled:
            packing = self._packing(bucket)
            packed = jax.ShapeDtypeStruct((packing.size,), np.int32, sharding=self._replicated)
            self._lowered[bucket] = self._jitted.lower(params, state, packed, packing)
        return self._lowered.get(bucket)

    def compile(self, params, state, bucket):
        """Compile the program of `bucket` (once; lowering it first if needed); returns it."""
        if bucket not in self._compiled:
            self.lower(params, state, bucket)
            self._compiled[bucket] = self._lowered.pop(bucket).compile()
        return self._compiled[bucket]

    @property
    def num_compiled(self) -> int:
        return len(self._compiled)

    def jaxpr(self, params, state, bucket):
        """The traced program of `bucket` (for inspection), on its inputs and metadata as separate arrays: the
        packed program runs exactly this after slicing them out of its one buffer."""
        return jax.make_jaxpr(self._sharded)(*self._abstract_args(params, state, bucket))

    def length_derivations(self, params, state, bucket) -> list[str]:
        """Operations in `bucket`'s traced program that use the global positions or lengths (`GLOBAL_FIELDS`)
        other than as RoPE angles (`jaxpr_check.length_derivations`); empty when local lengths can only come from
        the host."""
        args = self._abstract_args(params, state, bucket)
        picked = flat_indices_of(args, lambda a: tuple(getattr(a[3], name) for name in self.GLOBAL_FIELDS))
        return length_derivations(self.jaxpr(params, state, bucket), picked)

    def host_syncs(self, params, state, bucket) -> list[str]:
        """Control flow in `bucket`'s traced program that would make its launch wait for the device
        (`jaxpr_check.host_syncs`); empty when the host can dispatch it ahead of the device."""
        return host_syncs(self.jaxpr(params, state, bucket))

    def pack_inputs(self, inputs, md) -> Placed:
        """Check host metadata `md` and pack it with the inputs into one host buffer, with its bucket."""
        self.check(md)
        bucket = md.rows
        if bucket not in self._compiled:
            raise ValueError(f"bucket {bucket} is not compiled; call compile() for every bucket at start-up")
        return Placed(bucket, self._packing(bucket).pack((inputs, md)))

    def pack_filled(self, template: Placed, fill: Callable[[StepInputs, StepMetadata], None]) -> Placed:
        """A copy of `template` (a packed step of its bucket, `pack_inputs`) with `fill(inputs, md)` writing into
        its views, checked as `pack_inputs` checks: a step that differs from the template in a few rows is
        written, not built and packed field by field."""
        packing = self._packing(template.bucket)
        if not isinstance(template.packed, np.ndarray):
            raise TypeError(f"a template is a host buffer (`pack_inputs`), got {type(template.packed).__name__}")
        if template.packed.shape != (packing.size,):
            raise ValueError(f"a template of {template.packed.shape} for bucket {template.bucket}'s {packing.size}")
        packed = template.packed.copy()
        inputs, md = packing.views(packed)
        fill(inputs, md)
        self.check(md)
        return Placed(template.bucket, packed)

    def run_placed(self, params, state, placed: Placed):
        """Run the bucket's program on a packed buffer (no check; a host buffer is transferred by the call)."""
        return self._compiled[placed.bucket](params, state, placed.packed)

    def __call__(self, params, state, inputs, md):
        """Check `md` on the host, pack it with the inputs, run the bucket's program: the compiled call transfers
        the one buffer (in its C++ dispatch, cheaper than a device_put before it)."""
        return self.run_placed(params, state, self.pack_inputs(inputs, md))
