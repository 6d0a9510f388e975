"""The jitted, shard_mapped decode step: host-side validation, one transfer, one compiled program per bucket.

`DecodeStep` wraps a per-rank body `body(params, kv_cache, inputs, md) -> (outputs, kv_cache)` where `md` is
the rank's view of `DecodeMetadata` (local_context_lens and slot_mapping become [R]). Every bucket is
compiled once up front; a call never traces, and metadata of an unknown bucket or the wrong shape is
rejected on the host before anything reaches the device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import jax
import numpy as np
from jax.sharding import Mesh

from dcp_jax.analysis import flat_indices_of, length_derivations
from dcp_jax.kv_cache import KV_CACHE_SPECS, KVCache
from dcp_jax.mesh import PER_DCP_RANK, REPLICATED, sharding
from dcp_jax.metadata import DecodeMetadata, check_decode_metadata

METADATA_SPECS = DecodeMetadata(
    positions=REPLICATED,
    context_lens=REPLICATED,
    local_context_lens=PER_DCP_RANK,
    slot_mapping=PER_DCP_RANK,
    block_tables=REPLICATED,
)


def rank_view(md: DecodeMetadata) -> DecodeMetadata:
    """Inside shard_map: drop the size-1 rank axis of the per-rank fields."""
    return dataclasses.replace(md, local_context_lens=md.local_context_lens[0], slot_mapping=md.slot_mapping[0])


def shard_decode_body(body: Callable, mesh: Mesh, *, param_specs, input_specs, output_specs) -> Callable:
    """shard_map of `body` over the mesh, with the per-rank metadata view; the KV cache is split over dcp."""

    def per_rank(params, kv_cache, inputs, md):
        return body(params, kv_cache, inputs, rank_view(md))

    return jax.shard_map(
        per_rank,
        mesh=mesh,
        in_specs=(param_specs, KV_CACHE_SPECS, input_specs, METADATA_SPECS),
        out_specs=(output_specs, KV_CACHE_SPECS),
        check_vma=False,  # Pallas kernels inside shard_map carry no vma annotations
    )


class DecodeStep:
    """One compiled decode program per bucket width; the KV cache is donated."""

    def __init__(
        self,
        sharded_body: Callable,
        mesh: Mesh,
        *,
        buckets: Iterable[int],
        dcp: int,
        interleave: int,
        max_blocks: int,
        param_specs,
        input_shapes: Callable[[int], object],
    ):
        """`sharded_body` from `shard_decode_body` with `param_specs`; `input_shapes(R)` gives the inputs'
        ShapeDtypeStructs."""
        self.mesh = mesh
        self._param_shardings = jax.tree.map(lambda spec: sharding(mesh, spec), param_specs)
        self.buckets = tuple(buckets)
        self.dcp = dcp
        self.interleave = interleave
        self.max_blocks = max_blocks
        self._input_shapes = input_shapes
        self._jitted = jax.jit(sharded_body, donate_argnums=(1,))
        self._lowered: dict[int, object] = {}
        self._compiled: dict[int, object] = {}
        self._input_placements: dict[int, tuple] = {}  # bucket -> placements of (inputs, md) in its program
        self._md_shardings = jax.tree.map(lambda spec: sharding(mesh, spec), METADATA_SPECS)

    def place_params(self, params):
        """Params in the step's sharding (heads split over TP ranks), so no call reshards them."""
        return jax.device_put(params, self._param_shardings)

    def metadata_shapes(self, rows: int) -> DecodeMetadata:
        w, p = self.dcp, self.max_blocks
        shapes = DecodeMetadata(
            positions=(rows,), context_lens=(rows,), local_context_lens=(w, rows), slot_mapping=(w, rows),
            block_tables=(rows, p),
        )
        return jax.tree.map(
            lambda shape, s: jax.ShapeDtypeStruct(shape, np.int32, sharding=s),
            shapes, self._md_shardings, is_leaf=lambda x: isinstance(x, tuple),
        )

    def lower(self, params, kv_cache: KVCache, rows: int):
        """Trace and lower the program of bucket `rows` (once), without the XLA compile. Lowering traces, so call
        it from one thread; `compile` of lowered buckets may then run in parallel threads (one per bucket)."""
        if rows not in self.buckets:
            raise ValueError(f"{rows=} is not a bucket {list(self.buckets)}")
        if rows not in self._lowered and rows not in self._compiled:
            self._lowered[rows] = self._jitted.lower(params, kv_cache, self._input_shapes(rows),
                                                     self.metadata_shapes(rows))
        return self._lowered.get(rows)

    def compile(self, params, kv_cache: KVCache, rows: int):
        """Compile the program of bucket `rows` (once; lowering it first if needed); returns it."""
        if rows not in self._compiled:
            self.lower(params, kv_cache, rows)
            compiled = self._lowered.pop(rows).compile()
            self._input_placements[rows] = tuple(compiled.input_shardings[0][2:4])
            self._compiled[rows] = compiled
        return self._compiled[rows]

    @property
    def num_compiled(self) -> int:
        return len(self._compiled)

    def jaxpr(self, params, kv_cache: KVCache, rows: int):
        """The traced step of bucket `rows` (for inspection)."""
        return jax.make_jaxpr(self._jitted)(params, kv_cache, self._input_shapes(rows), self.metadata_shapes(rows))

    def length_derivations(self, params, kv_cache: KVCache, rows: int) -> list[str]:
        """Operations in bucket `rows`' traced step that use the global positions or context lengths other than
        as RoPE angles (`analysis.length_derivations`); empty when local lengths can only come from the host."""
        args = (params, kv_cache, self._input_shapes(rows), self.metadata_shapes(rows))
        global_inputs = flat_indices_of(args, lambda a: (a[3].positions, a[3].context_lens))
        return length_derivations(self.jaxpr(params, kv_cache, rows), global_inputs)

    def place_inputs(self, kv_cache: KVCache, inputs, md: DecodeMetadata):
        """Validate host metadata `md` and transfer it with the inputs in one go; returns them on the devices, in
        the placement of the bucket's program."""
        check_decode_metadata(md, buckets=self.buckets, dcp=self.dcp, interleave=self.interleave,
                              max_blocks=self.max_blocks, page_size=kv_cache.page_size, num_pages=kv_cache.num_pages)
        if md.rows not in self._compiled:
            raise ValueError(f"bucket {md.rows} is not compiled; call compile() for every bucket at start-up")
        return jax.device_put((inputs, md), self._input_placements[md.rows])

    def run_placed(self, params, kv_cache: KVCache, inputs, md: DecodeMetadata):
        """Run the bucket's program on inputs and metadata from `place_inputs` (no validation, no transfer)."""
        return self._compiled[md.rows](params, kv_cache, inputs, md)

    def __call__(self, params, kv_cache: KVCache, inputs, md: DecodeMetadata):
        """Validate `md` on the host, transfer it with the inputs in one go, run the bucket's program."""
        return self.run_placed(params, kv_cache, *self.place_inputs(kv_cache, inputs, md))
