"""`ModelRunner`: the placed weights, the device state (paged KV pools and sampler state) and the compiled step
programs of one model.

Serving dispatches (`dispatch`): the runner builds the step's metadata and inputs from the scheduled rows
(`host/step_plan.py`), enqueues the bucket's program of the step's kind (`forward.ProgramKind`) and returns its
outputs still on the device (JAX dispatch is asynchronous), so the caller can dispatch the next step before it reads
them. Only sampled token ids and logprobs come out. A kind besides the serving ones (the oracle's,
`runtime/oracle.py`) gets its programs at first use. Whole pages of the KV pools leave and enter the runner by
`export_pages` / `import_pages` (host-built page ids, one compiled program per page-count bucket). Page allocation
and sampler slots are the caller's; a slot's sampling parameters and seed (`SamplingTable`) are set with
`set_sampling` before its first sampled row.
"""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dcp_jax.config import EngineConfig, ModelConfig, ParallelConfig
from dcp_jax.host import arrays
from dcp_jax.host.layout import DcpLayout
from dcp_jax.host.sampling import SamplingParams
from dcp_jax.host.sampling_metadata import SamplingTable
from dcp_jax.host.step_inputs import StepInputs, step_inputs_sizes
from dcp_jax.host.step_metadata import draft_offsets
from dcp_jax.host.step_plan import ScheduledRows, build_step, fill_decode_rows
from dcp_jax.model import architecture, fp8_linear, mxfp4
from dcp_jax.model.kv_cache import (KVCache, allocate_kv_cache, cache_pools, gather_pages, kv_cache_specs,
                                    page_buckets, scatter_pages)
from dcp_jax.model.mesh import REPLICATED, sharding
from dcp_jax.runtime.context import ModelDef, StepContext
from dcp_jax.runtime.forward import (GREEDY, PROMPT_LOGPROBS, SAMPLED, SERVING_KINDS, DeviceState, ProgramKind,
                                     state_specs, step_body)
from dcp_jax.runtime.sampler import SamplerState
from dcp_jax.runtime.step import Placed, StepProgram


def step_kind(params: Sequence[SamplingParams], *, prompt_logprobs: bool) -> ProgramKind:
    """The serving program of a step whose sampled rows have `params`: the prompt-logprobs one when a chunk wants
    them, else drawing when a row draws or wants logprobs (the greedy program computes no top logprobs), else
    greedy."""
    if prompt_logprobs:
        return PROMPT_LOGPROBS
    return SAMPLED if any(not p.is_greedy or p.logprobs is not None for p in params) else GREEDY


def step_context(cfg: ModelConfig, parallel: ParallelConfig, engine: EngineConfig, backend: str, *, dtype,
                 fp8_block: tuple[int, int] | None = None, mtp_fp8_block: tuple[int, int] | None = None,
                 mxfp4_experts: mxfp4.ExpertsFormat | None = None, channel_fp8: bool = False, drafts: bool = False,
                 unroll_layers: bool = False, enable_tbo: bool = False) -> StepContext:
    """The context of a runner's programs: the model's abstract state in `dtype` (its `fp8_linear.FP8_AXES` leaves
    block fp8 of `fp8_block`, its routed experts MXFP4 of `mxfp4_experts`'s format, its linear leaves per-channel
    fp8 with `channel_fp8`: ptpc_fp8), its MTP layer's when it
    `drafts`; `enable_tbo`: each layer's attention runs as two micro-batches of the step's rows (two-batch
    overlap)."""
    model = architecture.of(cfg).model
    mtp = ModelDef(*model.abstract_mtp(cfg, dtype, mtp_fp8_block)) if drafts else None
    abstract = mxfp4.with_mxfp4_leaves(model.abstract_model(cfg, dtype, fp8_block), mxfp4_experts)
    if channel_fp8:
        graphdef, state = abstract
        nnx.replace_by_pure_dict(state, jax.eval_shape(fp8_linear.quantize_channels_params, nnx.to_pure_dict(state)))
        abstract = graphdef, state
    return StepContext(cfg=cfg, layout=DcpLayout(parallel.dcp, parallel.interleave, engine.page_size),
                       backend=backend, model=ModelDef(*abstract), mtp=mtp,
                       micro_batches=2 if enable_tbo else 1, unroll_layers=unroll_layers)


def param_specs(ctx: StepContext, parallel: ParallelConfig):
    """The PartitionSpecs of the programs' params: the model's, or (the model's, the MTP layer's) when drafting."""
    model = ctx.architecture.model

    def specs(model_def: ModelDef):
        return model.param_specs(ctx.cfg, nnx.to_pure_dict(model_def.abstract),
                                 expert_parallel=parallel.enable_expert_parallel)

    return specs(ctx.model) if ctx.mtp is None else (specs(ctx.model), specs(ctx.mtp))


def step_program(ctx: StepContext, kind: ProgramKind, parallel: ParallelConfig, engine: EngineConfig,
                 mesh: Mesh) -> StepProgram:
    """The step program of one kind for the model of `ctx` (`forward.step_body`), one compiled program per bucket
    of `engine` (nothing is placed or compiled yet)."""
    group = engine.sample_group

    def input_shapes(rows: int) -> StepInputs:
        return arrays.build(StepInputs, step_inputs_sizes(rows, engine.seqs_for(rows), group), jax.ShapeDtypeStruct)

    return StepProgram(functools.partial(step_body, ctx=ctx, kind=kind), mesh, buckets=engine.buckets,
                       seqs_for=engine.seqs_for, layout=ctx.layout, max_blocks=engine.max_blocks_per_seq(parallel.dcp),
                       num_pages=engine.num_pages, param_specs=param_specs(ctx, parallel), input_specs=REPLICATED,
                       output_specs=REPLICATED,
                       state_specs=state_specs(cache_pools(ctx.cfg, engine), drafts=ctx.mtp is not None),
                       input_shapes=input_shapes, draft_offsets=draft_offsets(engine.num_speculative_tokens))


def state_allocator(cfg: ModelConfig, parallel: ParallelConfig, engine: EngineConfig, mesh: Mesh, dtype):
    """A compiled function returning a zeroed `DeviceState` (the KV pools in `engine`'s formats, exact ones of
    `dtype`, the sampler's, and each slot's draft when `engine` drafts) in its sharded placement."""
    drafting = bool(engine.num_speculative_tokens)
    specs = state_specs(cache_pools(cfg, engine), drafts=drafting)
    return jax.jit(
        lambda: DeviceState(allocate_kv_cache(cfg, engine, parallel.dcp, mesh, dtype),
                            SamplerState.zeros(engine.max_num_seqs, cfg.vocab_size),
                            jnp.zeros((engine.max_num_seqs + 1, engine.num_speculative_tokens), jnp.int32)
                            if drafting else None),
        out_shardings=jax.tree.map(lambda spec: sharding(mesh, spec), specs))


def compile_programs(steps: dict[str, StepProgram], programs: Sequence[tuple[str, int]], params, state, *,
                     workers: int = 1, on_compiled=None) -> None:
    """Compile the (kind name, bucket) `programs` of `steps`: each lowered in turn in this thread (tracing is
    single-threaded), its XLA compile started as soon as it is, `workers` at once (they run outside the GIL, beside
    the next one's tracing); on_compiled(kind name, bucket) after each. `params` and `state` may be
    ShapeDtypeStructs in the steps' sharding (`StepProgram.param_shapes`): nothing is read."""
    with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
        compiling = {}
        for name, rows in programs:
            steps[name].lower(params, state, rows)
            compiling[pool.submit(steps[name].compile, params, state, rows)] = (name, rows)
        for done in concurrent.futures.as_completed(compiling):
            done.result()
            if on_compiled:
                on_compiled(*compiling[done])


class ModelRunner:
    """The weights, the device state and the compiled programs of one model on a (tp/dcp, dcp) mesh.

    Every program donates the device state: when one raises, the state may be gone (`kv_cache_is_usable`), and
    `reset_state` allocates a fresh zeroed one (every context it held is lost). `backend` names the kernels'
    implementation (`pallas_kernels.BACKENDS`); `dtype` is the weights' (block fp8 ones apart: `fp8_linear`) and
    the exact caches' dtype. Each layer stack compiles once (`forward._layers`); `unroll_layers` unrolls it (one copy
    per layer: start-up grows with depth, the step runs faster; docs/performance.md). `mtp_params`: the MTP layer's
    (speculative decoding, `engine.num_speculative_tokens` > 0); `enable_tbo`: two-batch overlap in every program."""

    def __init__(self, cfg: ModelConfig, params: dict, parallel: ParallelConfig, engine: EngineConfig, mesh: Mesh,
                 backend: str, *, dtype=jnp.float32, unroll_layers: bool = False, mtp_params: dict | None = None,
                 enable_tbo: bool = False):
        if bool(engine.num_speculative_tokens) != (mtp_params is not None):
            raise ValueError(f"num_speculative_tokens={engine.num_speculative_tokens} needs the MTP layer's params "
                             f"exactly when it is > 0")
        self.cfg, self.parallel, self.engine, self.mesh = cfg, parallel, engine, mesh
        self.ctx = step_context(cfg, parallel, engine, backend, dtype=dtype, fp8_block=fp8_linear.weight_block(params),
                                mtp_fp8_block=fp8_linear.weight_block(mtp_params) if mtp_params is not None else None,
                                mxfp4_experts=mxfp4.experts_format(params),
                                channel_fp8=fp8_linear.has_channel_weights(params),
                                drafts=mtp_params is not None, unroll_layers=unroll_layers, enable_tbo=enable_tbo)
        self.layout = self.ctx.layout
        self.max_blocks = engine.max_blocks_per_seq(parallel.dcp)
        self.scratch_slot = engine.max_num_seqs
        self.sampling_table = SamplingTable(engine.max_num_seqs + 1, scratch_slot=self.scratch_slot,
                                            eos_token_id=cfg.eos_token_id)
        # Keyed by kind name (the serving kinds; others added at first use), one program per bucket each.
        self.steps = {kind.name: step_program(self.ctx, kind, parallel, engine, mesh) for kind in SERVING_KINDS}
        self.params = self.steps[GREEDY.name].place_params(params if mtp_params is None else (params, mtp_params))
        # One compiled allocator, so `reset_state` never compiles while serving.
        self._new_state = state_allocator(cfg, parallel, engine, mesh, dtype)
        self.state = self._new_state()
        self._empty_steps: dict[int, Placed] = {}  # bucket -> its step of pad rows only (`_empty_step`)
        self._page_programs: dict[tuple[str, int], object] = {}  # ("export" | "import", pages) -> compiled
        # A multi-host leader's `multihost.Mirror`: its followers run every program this runner runs.
        self.mirror = None

    @property
    def kv_cache(self) -> KVCache:
        return self.state.kv_cache

    def kv_cache_is_usable(self) -> bool:
        """False when a failed program consumed the donated state (deleted) or left it poisoned by an error."""
        try:
            leaves = jax.tree.leaves(self.state)
            if any(leaf.is_deleted() for leaf in leaves):
                return False
            jax.block_until_ready(leaves)
        except Exception:  # an asynchronous failure surfaces here
            return False
        return True

    def reset_state(self) -> None:
        """A fresh zeroed device state in the same placement (no recompile); every cached context is lost."""
        if self.mirror is not None:
            self.mirror.reset()
        self.state = self._new_state()

    # ---- programs ---------------------------------------------------------------------------------------
    def program(self, kind: ProgramKind) -> StepProgram:
        """The step program of `kind` (built at first use for a kind besides the serving ones)."""
        if kind.name not in self.steps:
            self.steps[kind.name] = step_program(self.ctx, kind, self.parallel, self.engine, self.mesh)
        return self.steps[kind.name]

    def serving_kind(self, kind: ProgramKind, bucket: int) -> ProgramKind:
        """The program a step of `kind` runs in `bucket`: a bucket wider than every decode step
        (`EngineConfig.widest_decode`) only runs steps with prefill chunks, beside which drawing costs nothing, so
        its greedy steps run the drawing program (greedy rows take the argmax there too): one program fewer."""
        return SAMPLED if kind is GREEDY and bucket > self.engine.widest_decode else kind

    def serving_bucket(self, kind: ProgramKind, rows: int) -> int:
        """The bucket a step of `kind` and `rows` rows runs in: the smallest that holds it, but a step with prompt
        logprobs (rare: echo, lm-eval) runs in one wider than every decode step, so their programs compile only for
        those buckets (dsa-tiny's serve: 24 programs, not 28)."""
        engine = self.engine
        bucket = engine.bucket_for(rows)
        if kind is PROMPT_LOGPROBS:
            bucket = max(bucket, engine.bucket_for(min(engine.widest_decode + 1, engine.max_num_batched_tokens)))
        return bucket

    def programs(self, kinds: Sequence[ProgramKind] = (GREEDY, SAMPLED)) -> list[tuple[str, int]]:
        """Every (kind name, bucket) program that steps of `kinds` run (`serving_bucket`, `serving_kind`), each
        once."""
        pairs = []
        for kind in kinds:
            for rows in self.engine.buckets:
                bucket = self.serving_bucket(kind, rows)
                pairs.append((self.serving_kind(kind, bucket).name, bucket))
        return list(dict.fromkeys(pairs))

    def compile_all(self, programs: Sequence[tuple[str, int]], *, workers: int = 1, on_compiled=None) -> None:
        """Compile `programs` (from `programs()`), `workers` at once (`compile_programs`)."""
        compile_programs(self.steps, programs, self.params, self.state, workers=workers, on_compiled=on_compiled)

    # ---- serving: dispatch, read later ----------------------------------------------------------------------
    def set_sampling(self, slot: int, params: SamplingParams, seed: int, prompt_len: int) -> None:
        """Slot `slot` samples with `params` and the 64-bit `seed` from now on (a request of a `prompt_len`-token
        prompt taking the slot)."""
        self.sampling_table.set(slot, params, seed, prompt_len)

    def dispatch(self, rows: ScheduledRows, kind: ProgramKind):
        """Enqueue one step of `rows` in the `kind` program of the smallest bucket that holds them. Returns the
        kind's outputs (the serving kinds: the sampled tokens packed, `sampler.unpack` reads them;
        `engine.sample_group` entries per sequence that samples, in order: its token, or a verify group's emitted
        tokens, then -1; with the rows' `PromptLogprobs` for that kind), on the device, their copy to the host
        already queued behind the step."""
        outputs = self.run(rows, kind)
        for leaf in jax.tree.leaves(outputs):
            leaf.copy_to_host_async()
        return outputs

    def run(self, rows: ScheduledRows, kind: ProgramKind):
        """Run one step of `rows` in the `kind` program of its bucket (compiled at first use); its outputs, on the
        device."""
        bucket = self.serving_bucket(kind, rows.num_rows)
        kind = self.serving_kind(kind, bucket)
        step = self.program(kind)
        step.compile(self.params, self.state, bucket)  # a no-op once compiled (an engine compiles every one first)
        if rows.is_decode and self.engine.sample_group == 1:  # the steady state: written into the empty step
            placed = step.pack_filled(self._empty_step(step, bucket), functools.partial(
                fill_decode_rows, rows=rows, layout=self.layout, table=self.sampling_table))
        else:
            placed = step.pack_inputs(*build_step(rows, bucket=bucket, seqs=self.engine.seqs_for(bucket),
                                                  layout=self.layout, max_blocks=self.max_blocks,
                                                  table=self.sampling_table, group=self.engine.sample_group))
        if self.mirror is not None:
            self.mirror.run(kind.name, bucket, placed.packed)
        outputs, self.state = step.run_placed(self.params, self.state, placed)
        if self.mirror is not None:  # multi-host: replicated over every process; this one's copy, readable here
            outputs = jax.tree.map(lambda a: a.addressable_data(0), outputs)
        return outputs

    def run_mirrored(self, kind_name: str, placed: Placed) -> None:
        """A multi-host follower: run the `kind_name` program on the leader's step buffer (`multihost.follow`)."""
        step = self.steps[kind_name]
        step.compile(self.params, self.state, placed.bucket)
        _, self.state = step.run_placed(self.params, self.state, placed)

    def _empty_step(self, step: StepProgram, bucket: int) -> Placed:
        """The packed step of `bucket` with no rows (every row a pad), built once a bucket (every kind packs
        alike)."""
        if bucket not in self._empty_steps:
            none = ScheduledRows.decode([], [], np.zeros((0, self.max_blocks), np.int32))
            self._empty_steps[bucket] = step.pack_inputs(*build_step(
                none, bucket=bucket, seqs=self.engine.seqs_for(bucket), layout=self.layout,
                max_blocks=self.max_blocks, table=self.sampling_table, group=self.engine.sample_group))
        return self._empty_steps[bucket]

    # ---- whole pages in and out ---------------------------------------------------------------------------
    def _page_ids(self, page_ids: Sequence[int]) -> np.ndarray:
        """`page_ids` checked against the pool and padded with -1 to their page-count bucket."""
        if self.mirror is not None:
            raise ValueError("pages move in and out of a single-process runner only (a multi-host deployment's other "
                             "processes would not run the transfer)")
        ids = np.asarray(page_ids, np.int64).reshape(-1)
        num_pages = self.engine.num_pages
        if ids.size == 0 or ids.min() < 0 or ids.max() >= num_pages or len(np.unique(ids)) != ids.size:
            raise ValueError(f"page ids must be distinct, in [0, {num_pages}), and at least one; got {ids.tolist()}")
        buckets = page_buckets(num_pages)
        if ids.size > buckets[-1]:
            raise ValueError(f"{ids.size} pages are more than the pool's {num_pages}")
        padded = np.full(next(b for b in buckets if b >= ids.size), -1, np.int32)
        padded[: ids.size] = ids
        return padded

    def _page_program(self, direction: str, count: int):
        """The compiled export or import program of `count` pages (a page-count bucket), compiled once."""
        key = (direction, count)
        if key not in self._page_programs:
            placed = jax.tree.map(lambda spec: sharding(self.mesh, spec),
                                  kv_cache_specs(self.state.kv_cache.pools))
            ids = jax.ShapeDtypeStruct((count,), jnp.int32, sharding=sharding(self.mesh, REPLICATED))
            cache = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                                 self.state.kv_cache)
            if direction == "export":
                program = jax.jit(gather_pages, out_shardings=placed).lower(cache, ids)
            else:
                pages = jax.eval_shape(gather_pages, cache, ids)
                pages = jax.tree.map(lambda a, c: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=c.sharding),
                                     pages, cache)
                program = jax.jit(scatter_pages, donate_argnums=0, out_shardings=placed).lower(cache, pages, ids)
            self._page_programs[key] = program.compile()
        return self._page_programs[key]

    def export_pages(self, page_ids: Sequence[int]) -> KVCache:
        """The pages `page_ids` (host ints) of every pool, layer and rank, [W, layers, n, B, ...] each (n the ids'
        page-count bucket: pads past len(page_ids) hold zeros), on this runner's devices."""
        ids = self._page_ids(page_ids)
        return self._page_program("export", len(ids))(self.state.kv_cache, ids)

    def import_pages(self, pages: KVCache, page_ids: Sequence[int]) -> None:
        """Write `pages` (`export_pages` of a runner of the same architecture, cache formats, page size and DCP
        size; on any devices) at `page_ids` of this runner's pools, the first len(page_ids) of them, in place."""
        ids = self._page_ids(page_ids)
        count = len(ids)
        have = jax.tree.leaves(pages)[0].shape[2]
        if have != count:
            raise ValueError(f"{len(page_ids)} page ids take a bucket of {count} pages; the export holds {have}")
        want = jax.eval_shape(gather_pages, self.state.kv_cache, jax.ShapeDtypeStruct((count,), jnp.int32))
        if jax.tree.structure(pages) != jax.tree.structure(want) or any(
                (a.shape, a.dtype) != (b.shape, b.dtype) for a, b in zip(jax.tree.leaves(pages),
                                                                          jax.tree.leaves(want))):
            raise ValueError("the pages are not of this runner's pools (architecture, cache formats, page size, "
                             "DCP size and layers must match)")
        pages = jax.device_put(pages, jax.tree.map(lambda a: a.sharding, self.state.kv_cache))
        kv_cache = self._page_program("import", count)(self.state.kv_cache, pages, ids)
        self.state = DeviceState(kv_cache, self.state.sampler, self.state.drafts)
