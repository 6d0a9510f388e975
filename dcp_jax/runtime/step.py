"""The jitted, shard_mapped programs of one engine step: host-side checks, one transfer, one compiled program per
bucket, the KV cache donated.

`DecodeStep` and `PrefillStep` wrap a per-rank body `body(params, kv_cache, inputs, md) -> (outputs, kv_cache)`,
where `md` is the rank's view of the step's metadata (`rank_view`: each per-rank field loses its W axis). Every
bucket is compiled once up front; a call never traces, and metadata of an unknown bucket or the wrong shape is
refused on the host before anything reaches the device. The metadata dataclasses of `host/metadata.py` (numpy
only) are registered as pytrees here, with their shardings: per-rank fields over "dcp", the rest replicated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Iterable

import jax
import numpy as np
from jax.sharding import Mesh

from dcp_jax.host.layout import DcpLayout
from dcp_jax.host.metadata import (DecodeMetadata, PrefillMetadata, check_decode_metadata, check_prefill_metadata,
                                   field_names, is_per_rank)
from dcp_jax.model.kv_cache import KV_CACHE_SPECS, KVCache
from dcp_jax.model.mesh import PER_DCP_RANK, REPLICATED, sharding
from dcp_jax.runtime.jaxpr_check import flat_indices_of, length_derivations

for _cls in (DecodeMetadata, PrefillMetadata):
    jax.tree_util.register_dataclass(_cls, data_fields=list(field_names(_cls)), meta_fields=[])


def metadata_specs(cls):
    """A `cls` of PartitionSpecs: per-rank fields split over "dcp", the others replicated."""
    return cls(**{f.name: PER_DCP_RANK if is_per_rank(f) else REPLICATED for f in dataclasses.fields(cls)})


def rank_view(md):
    """Inside shard_map: the metadata with the size-1 rank axis of every per-rank field dropped."""
    return dataclasses.replace(md, **{f.name: getattr(md, f.name)[0] for f in dataclasses.fields(md) if is_per_rank(f)})


class BucketedStep:
    """One compiled program per bucket of a per-rank body, shard_mapped over the mesh; the KV cache is donated.

    Subclasses say what a bucket is: `bucket_of(md)`, `metadata_shapes(bucket)`, `check(md, kv_cache)` and
    `GLOBAL_FIELDS`, the metadata fields that must reach nothing but RoPE (`length_derivations`)."""

    METADATA: type
    GLOBAL_FIELDS: tuple[str, ...]

    def __init__(self, body: Callable, mesh: Mesh, *, buckets: Iterable[Hashable], param_specs, input_specs,
                 output_specs, input_shapes: Callable[[Hashable], object]):
        """`body(params, kv_cache, inputs, md)` per rank, with `md` the rank's view; `input_shapes(bucket)` gives
        the inputs' ShapeDtypeStructs."""
        self.mesh = mesh
        self.buckets = tuple(buckets)
        self._input_shapes = input_shapes
        self._param_shardings = jax.tree.map(lambda spec: sharding(mesh, spec), param_specs)
        specs = metadata_specs(self.METADATA)
        self._md_shardings = jax.tree.map(lambda spec: sharding(mesh, spec), specs)

        def per_rank(params, kv_cache, inputs, md):
            return body(params, kv_cache, inputs, rank_view(md))

        sharded = jax.shard_map(
            per_rank, mesh=mesh, in_specs=(param_specs, KV_CACHE_SPECS, input_specs, specs),
            out_specs=(output_specs, KV_CACHE_SPECS),
            check_vma=False,  # Pallas kernels inside shard_map carry no vma annotations
        )
        self._jitted = jax.jit(sharded, donate_argnums=(1,))
        self._lowered: dict[Hashable, object] = {}
        self._compiled: dict[Hashable, object] = {}
        self._input_placements: dict[Hashable, tuple] = {}  # bucket -> placements of (inputs, md) in its program

    # ---- what a subclass defines ---------------------------------------------------------------------------
    def bucket_of(self, md) -> Hashable:
        raise NotImplementedError

    def metadata_dims(self, bucket) -> dict[str, tuple[int, ...]]:
        raise NotImplementedError

    def check(self, md, kv_cache: KVCache) -> None:
        raise NotImplementedError

    # ---- shared machinery ----------------------------------------------------------------------------------
    def place_params(self, params):
        """Params in the step's sharding (heads split over TP ranks), so no call reshards them."""
        return jax.device_put(params, self._param_shardings)

    def metadata_shapes(self, bucket):
        """The metadata of `bucket` as ShapeDtypeStructs in the step's sharding."""
        return self.METADATA(**{name: jax.ShapeDtypeStruct(shape, np.int32, sharding=getattr(self._md_shardings, name))
                                for name, shape in self.metadata_dims(bucket).items()})

    def _abstract_args(self, params, kv_cache, bucket):
        return params, kv_cache, self._input_shapes(bucket), self.metadata_shapes(bucket)

    def lower(self, params, kv_cache: KVCache, bucket):
        """Trace and lower the program of `bucket` (once), without the XLA compile. Lowering traces, so call it
        from one thread; `compile` of lowered buckets may then run in parallel threads (one per bucket)."""
        if bucket not in self.buckets:
            raise ValueError(f"{bucket=} is not a bucket {list(self.buckets)}")
        if bucket not in self._lowered and bucket not in self._compiled:
            self._lowered[bucket] = self._jitted.lower(*self._abstract_args(params, kv_cache, bucket))
        return self._lowered.get(bucket)

    def compile(self, params, kv_cache: KVCache, bucket):
        """Compile the program of `bucket` (once; lowering it first if needed); returns it."""
        if bucket not in self._compiled:
            self.lower(params, kv_cache, bucket)
            compiled = self._lowered.pop(bucket).compile()
            self._input_placements[bucket] = tuple(compiled.input_shardings[0][2:4])
            self._compiled[bucket] = compiled
        return self._compiled[bucket]

    @property
    def num_compiled(self) -> int:
        return len(self._compiled)

    def jaxpr(self, params, kv_cache: KVCache, bucket):
        """The traced program of `bucket` (for inspection)."""
        return jax.make_jaxpr(self._jitted)(*self._abstract_args(params, kv_cache, bucket))

    def length_derivations(self, params, kv_cache: KVCache, bucket) -> list[str]:
        """Operations in `bucket`'s traced program that use the global positions or lengths (`GLOBAL_FIELDS`)
        other than as RoPE angles (`jaxpr_check.length_derivations`); empty when local lengths can only come from
        the host."""
        args = self._abstract_args(params, kv_cache, bucket)
        picked = flat_indices_of(args, lambda a: tuple(getattr(a[3], name) for name in self.GLOBAL_FIELDS))
        return length_derivations(self.jaxpr(params, kv_cache, bucket), picked)

    def place_inputs(self, kv_cache: KVCache, inputs, md):
        """Check host metadata `md` and transfer it with the inputs in one go; returns them on the devices, in the
        placement of the bucket's program."""
        self.check(md, kv_cache)
        bucket = self.bucket_of(md)
        if bucket not in self._compiled:
            raise ValueError(f"bucket {bucket} is not compiled; call compile() for every bucket at start-up")
        return jax.device_put((inputs, md), self._input_placements[bucket])

    def run_placed(self, params, kv_cache: KVCache, inputs, md):
        """Run the bucket's program on inputs and metadata from `place_inputs` (no check, no transfer)."""
        return self._compiled[self.bucket_of(md)](params, kv_cache, inputs, md)

    def __call__(self, params, kv_cache: KVCache, inputs, md):
        """Check `md` on the host, transfer it with the inputs in one go, run the bucket's program."""
        return self.run_placed(params, kv_cache, *self.place_inputs(kv_cache, inputs, md))


class DecodeStep(BucketedStep):
    """One compiled decode program per bucket width R (`DecodeMetadata`)."""

    METADATA = DecodeMetadata
    GLOBAL_FIELDS = ("positions", "context_lens")

    def __init__(self, body: Callable, mesh: Mesh, *, buckets: Iterable[int], layout: DcpLayout, max_blocks: int,
                 **kwargs):
        self.layout, self.max_blocks = layout, max_blocks
        super().__init__(body, mesh, buckets=buckets, **kwargs)

    def bucket_of(self, md: DecodeMetadata) -> int:
        return md.rows

    def metadata_dims(self, rows: int) -> dict[str, tuple[int, ...]]:
        w = self.layout.dcp_size
        return dict(positions=(rows,), context_lens=(rows,), local_context_lens=(w, rows), slot_mapping=(w, rows),
                    block_tables=(rows, self.max_blocks))

    def check(self, md, kv_cache: KVCache) -> None:
        check_decode_metadata(md, buckets=self.buckets, layout=self.layout, max_blocks=self.max_blocks,
                              num_pages=kv_cache.num_pages)


class PrefillStep(BucketedStep):
    """One compiled prefill program per bucket (R prompts, T tokens) (`PrefillMetadata`)."""

    METADATA = PrefillMetadata
    GLOBAL_FIELDS = ("positions",)

    def __init__(self, body: Callable, mesh: Mesh, *, buckets: Iterable[tuple[int, int]], layout: DcpLayout,
                 **kwargs):
        self.layout = layout
        super().__init__(body, mesh, buckets=buckets, **kwargs)

    def bucket_of(self, md: PrefillMetadata) -> tuple[int, int]:
        return md.bucket

    def metadata_dims(self, bucket: tuple[int, int]) -> dict[str, tuple[int, ...]]:
        rows, tokens = bucket
        return dict(positions=(rows, tokens), slot_mapping=(self.layout.dcp_size, rows, tokens),
                    logits_indices=(rows,))

    def check(self, md, kv_cache: KVCache) -> None:
        check_prefill_metadata(md, buckets=self.buckets, layout=self.layout, num_pages=kv_cache.num_pages)
