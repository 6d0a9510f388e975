"""`ModelRunner`: the placed weights, the device state (paged KV pool and sampler state) and the compiled step
programs of one model.

Serving dispatches (`dispatch`): the runner builds the step's metadata and inputs from the scheduled rows
(`host/metadata.py`), enqueues the bucket's program and returns its outputs still on the device (JAX dispatch is
asynchronous), so the caller can dispatch the next step before it reads them. Only sampled token ids and logprobs
come out. `prefill` / `decode` are the detailed, synchronous forms the oracle tests use: host logits, and the
selected top-k ids when asked, from the `details` variant (compiled at first use). Page allocation and sampler
slots are the caller's; a slot's sampling parameters and seed (`SamplingTable`) are set with `set_sampling` before
its first sampled row.
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
from dcp_jax.host.layout import DcpLayout
from dcp_jax.host.metadata import (MIN_TOKENS_STOP_IDS, PROMPT, SamplingMetadata, SamplingTable, ScheduledRows,
                                   StepInputs, build_step, draft_offsets, fill_decode_rows)
from dcp_jax.host.sampling import SamplingParams
from dcp_jax.model import fp8_linear
from dcp_jax.model.deepseek_v32 import abstract_model, param_specs
from dcp_jax.model.kv_cache import allocate_kv_cache
from dcp_jax.model.mesh import REPLICATED, sharding
from dcp_jax.model.mtp import abstract_mtp
from dcp_jax.runtime.forward import (DETAILS, GREEDY, PROMPT_LOGPROBS, SAMPLED, VARIANTS, DeviceState, state_specs,
                                     step_body)
from dcp_jax.runtime.sampler import SamplerState
from dcp_jax.runtime.step import Placed, StepProgram

# How the detailed (test) calls sample: greedily, on the scratch slot.
GREEDY_PARAMS = SamplingParams(temperature=0.0)


def step_variant(params: Sequence[SamplingParams], *, prompt_logprobs: bool) -> str:
    """The serving program of a step whose sampled rows have `params`: the prompt-logprobs one when a chunk wants
    them, else drawing when a row draws, else greedy (`forward.VARIANTS`)."""
    if prompt_logprobs:
        return PROMPT_LOGPROBS
    return SAMPLED if any(not p.is_greedy for p in params) else GREEDY


def serving_variants(params: Sequence[SamplingParams]) -> tuple[str, ...]:
    """The serving programs that steps over requests of `params` (any subset of them) can take, prompt logprobs
    apart: greedy and / or drawing."""
    draws = {not p.is_greedy for p in params}
    return tuple(v for v, needed in ((GREEDY, False in draws), (SAMPLED, True in draws)) if needed)


def sampling_shapes(rows: int) -> SamplingMetadata:
    f32, i32 = (jax.ShapeDtypeStruct((rows,), d) for d in (jnp.float32, jnp.int32))
    return SamplingMetadata(temperature=f32, top_k=i32, top_p=f32, min_p=f32, presence_penalty=f32,
                            frequency_penalty=f32, repetition_penalty=f32,
                            seeds=jax.ShapeDtypeStruct((rows, 2), jnp.uint32),
                            stop_ids=jax.ShapeDtypeStruct((rows, MIN_TOKENS_STOP_IDS), jnp.int32), stops_from=i32,
                            positions=i32, slots=i32)


def step_input_shapes(engine: EngineConfig):
    """rows -> the ShapeDtypeStructs of a bucket's `StepInputs`."""

    def shapes(rows: int) -> StepInputs:
        samples = engine.seqs_for(rows) * engine.sample_group
        per_row, per_seq, per_sample = (jax.ShapeDtypeStruct((n,), jnp.int32)
                                        for n in (rows, engine.seqs_for(rows), samples))
        return StepInputs(tokens=per_row, roles=per_row, row_slots=per_row, next_tokens=per_row,
                          is_position_zero=per_row, fresh_slots=per_seq, sample_rows=per_sample,
                          sampling=sampling_shapes(samples))

    return shapes


def step_programs(cfg: ModelConfig, parallel: ParallelConfig, engine: EngineConfig, mesh: Mesh, backend: str, *,
                  graphdef, abstract, mtp=None, unroll_layers: bool = False,
                  enable_tbo: bool = False) -> dict[str, StepProgram]:
    """The step program of every variant (`forward.VARIANTS`) of a model (`abstract_model`'s graphdef and abstract
    state; with `mtp`, `abstract_mtp`'s, the programs draft with the MTP layer and take (model, MTP layer) params),
    one compiled program per bucket each; nothing is placed or compiled yet. `enable_tbo`: each layer's attention
    runs as two micro-batches of the step's rows (two-batch overlap)."""
    layout = DcpLayout(parallel.dcp, parallel.interleave, engine.page_size)
    specs = param_specs(nnx.to_pure_dict(abstract), expert_parallel=parallel.enable_expert_parallel)
    mtp_graphdef, mtp_abstract = mtp or (None, None)
    if mtp is not None:
        specs = (specs, param_specs(nnx.to_pure_dict(mtp_abstract), expert_parallel=parallel.enable_expert_parallel))
    return {
        variant: StepProgram(
            functools.partial(step_body, graphdef=graphdef, abstract=abstract, cfg=cfg, layout=layout,
                              backend=backend, variant=variant, unroll_layers=unroll_layers,
                              mtp_graphdef=mtp_graphdef, mtp_abstract=mtp_abstract,
                              micro_batches=2 if enable_tbo else 1),
            mesh, buckets=engine.buckets, seqs_for=engine.seqs_for, layout=layout,
            max_blocks=engine.max_blocks_per_seq(parallel.dcp), num_pages=engine.num_pages, param_specs=specs,
            input_specs=REPLICATED, output_specs=REPLICATED, state_specs=state_specs(drafts=mtp is not None),
            input_shapes=step_input_shapes(engine), draft_offsets=draft_offsets(engine.num_speculative_tokens))
        for variant in VARIANTS
    }


def state_allocator(cfg: ModelConfig, parallel: ParallelConfig, engine: EngineConfig, mesh: Mesh, dtype):
    """A compiled function returning a zeroed `DeviceState` (the KV pools in `engine`'s formats, exact ones of
    `dtype`, the sampler's, and each slot's draft when `engine` drafts) in its sharded placement."""
    drafting = bool(engine.num_speculative_tokens)
    return jax.jit(
        lambda: DeviceState(allocate_kv_cache(cfg, engine, parallel.dcp, mesh, dtype),
                            SamplerState.zeros(engine.max_num_seqs, cfg.vocab_size),
                            jnp.zeros((engine.max_num_seqs + 1, engine.num_speculative_tokens), jnp.int32)
                            if drafting else None),
        out_shardings=jax.tree.map(lambda spec: sharding(mesh, spec), state_specs(drafts=drafting)))


def compile_programs(steps: dict[str, StepProgram], programs: Sequence[tuple[str, int]], params, state, *,
                     workers: int = 1, on_compiled=None) -> None:
    """Compile the (variant, bucket) `programs` of `steps`: each lowered in turn (tracing is single-threaded), then
    `workers` XLA compiles at once (they run outside the GIL); on_compiled(variant, bucket) after each. `params` and
    `state` may be ShapeDtypeStructs in the steps' sharding (`StepProgram.param_shapes`): nothing is read."""
    for variant, rows in programs:
        steps[variant].lower(params, state, rows)
    with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
        compiling = {pool.submit(steps[variant].compile, params, state, rows): (variant, rows)
                     for variant, rows in programs}
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
        self.cfg, self.parallel, self.engine, self.mesh = cfg, parallel, engine, mesh
        self.layout = DcpLayout(parallel.dcp, parallel.interleave, engine.page_size)
        self.max_blocks = engine.max_blocks_per_seq(parallel.dcp)
        self.scratch_slot = engine.max_num_seqs
        self.sampling_table = SamplingTable(engine.max_num_seqs + 1, scratch_slot=self.scratch_slot,
                                            eos_token_id=cfg.eos_token_id)
        graphdef, abstract = abstract_model(cfg, dtype, fp8_linear.weight_block(params))
        if bool(engine.num_speculative_tokens) != (mtp_params is not None):
            raise ValueError(f"num_speculative_tokens={engine.num_speculative_tokens} needs the MTP layer's params "
                             f"exactly when it is > 0")
        mtp = abstract_mtp(cfg, dtype, fp8_linear.weight_block(mtp_params)) if mtp_params is not None else None
        # Keyed by variant (`forward.VARIANTS`), one program per bucket each.
        self.steps = step_programs(cfg, parallel, engine, mesh, backend, graphdef=graphdef, abstract=abstract,
                                   mtp=mtp, unroll_layers=unroll_layers, enable_tbo=enable_tbo)
        self.params = self.steps[GREEDY].place_params(params if mtp is None else (params, mtp_params))
        # One compiled allocator, so `reset_state` never compiles while serving.
        self._new_state = state_allocator(cfg, parallel, engine, mesh, dtype)
        self.state = self._new_state()
        self._empty_steps: dict[int, Placed] = {}  # bucket -> its step of pad rows only (`_empty_step`)
        # A multi-host leader's `multihost.Mirror`: its followers run every program this runner runs.
        self.mirror = None

    @property
    def kv_cache(self):
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
    def programs(self, variants: Sequence[str] = (GREEDY, SAMPLED)) -> list[tuple[str, int]]:
        """Every (variant, bucket) program of `variants`."""
        return [(variant, rows) for variant in variants for rows in self.engine.buckets]

    def compile(self, variant: str, rows: int) -> None:
        """Compile one program of `programs()` (once)."""
        self.steps[variant].compile(self.params, self.state, rows)

    def compile_all(self, programs: Sequence[tuple[str, int]], *, workers: int = 1, on_compiled=None) -> None:
        """Compile `programs` (from `programs()`), `workers` at once (`compile_programs`)."""
        compile_programs(self.steps, programs, self.params, self.state, workers=workers, on_compiled=on_compiled)

    # ---- serving: dispatch, read later ----------------------------------------------------------------------
    def set_sampling(self, slot: int, params: SamplingParams, seed: int, prompt_len: int) -> None:
        """Slot `slot` samples with `params` and the 64-bit `seed` from now on (a request of a `prompt_len`-token
        prompt taking the slot)."""
        self.sampling_table.set(slot, params, seed, prompt_len)

    def dispatch(self, rows: ScheduledRows, variant: str):
        """Enqueue one step of `rows` in the `variant` program of the smallest bucket that holds them. Returns the
        step's sampled tokens packed (`sampler.unpack` reads them; `engine.sample_group` entries per sequence that
        samples, in order: its token, or a verify group's emitted tokens, then -1), with the rows'
        `PromptLogprobs` for that variant, on the device, their copy to the host already queued behind the step."""
        outputs = self._run(rows, variant)
        for leaf in jax.tree.leaves(outputs):
            leaf.copy_to_host_async()
        return outputs

    def _run(self, rows: ScheduledRows, variant: str):
        bucket = self.engine.bucket_for(rows.num_rows)
        step = self.steps[variant]
        step.compile(self.params, self.state, bucket)  # a no-op once compiled (an engine compiles every one first)
        if rows.is_decode and self.engine.sample_group == 1:  # the steady state: written into the empty step
            placed = step.pack_filled(self._empty_step(step, bucket), functools.partial(
                fill_decode_rows, rows=rows, layout=self.layout, table=self.sampling_table))
        else:
            placed = step.pack_inputs(*build_step(rows, bucket=bucket, seqs=self.engine.seqs_for(bucket),
                                                  layout=self.layout, max_blocks=self.max_blocks,
                                                  table=self.sampling_table, group=self.engine.sample_group))
        if self.mirror is not None:
            self.mirror.run(variant, bucket, placed.packed)
        outputs, self.state = step.run_placed(self.params, self.state, placed)
        if self.mirror is not None:  # multi-host: replicated over every process; this one's copy, readable here
            outputs = jax.tree.map(lambda a: a.addressable_data(0), outputs)
        return outputs

    def run_mirrored(self, variant: str, placed: Placed) -> None:
        """A multi-host follower: run the `variant` program on the leader's step buffer (`multihost.follow`)."""
        step = self.steps[variant]
        step.compile(self.params, self.state, placed.bucket)
        _, self.state = step.run_placed(self.params, self.state, placed)

    def _empty_step(self, step: StepProgram, bucket: int) -> Placed:
        """The packed step of `bucket` with no rows (every row a pad), built once a bucket (every variant packs
        alike)."""
        if bucket not in self._empty_steps:
            none = ScheduledRows.decode([], [], np.zeros((0, self.max_blocks), np.int32))
            self._empty_steps[bucket] = step.pack_inputs(*build_step(
                none, bucket=bucket, seqs=self.engine.seqs_for(bucket), layout=self.layout,
                max_blocks=self.max_blocks, table=self.sampling_table, group=self.engine.sample_group))
        return self._empty_steps[bucket]

    # ---- detailed and synchronous (tests) ------------------------------------------------------------------
    def run_details(self, rows: ScheduledRows):
        """Run `rows` in the details program and wait: host (SampledTokens, `forward.Details`)."""
        return jax.device_get(self._run(rows, DETAILS))

    def prefill(self, prompts: Sequence[Sequence[int]], block_tables: Sequence[Sequence[int]], *,
                chunk_size: int | None = None, all_logits: bool = False, return_selected: bool = False):
        """Prefill `prompts` (token ids, lengths >= 1) into the pages of `block_tables`, each in chunks of at most
        `chunk_size` tokens (default: the largest bucket), one step a chunk; the greedy first tokens go to the
        scratch slot. Returns host (logits [n, A] at each prompt's last token, or [n, Tmax, A] at every position
        when all_logits (NaN past a prompt); selected [layers, n, Tmax, K] global ids, -1 padded, when
        return_selected, else None; the first tokens [n] the device sampled)."""
        lens = [len(p) for p in prompts]
        if len(prompts) != len(block_tables) or not prompts or min(lens) < 1:
            raise ValueError(f"need one non-empty prompt per block table, got {lens=} and {len(block_tables)} tables")
        chunk_size = chunk_size or self.engine.buckets[-1]
        if not 1 <= chunk_size <= self.engine.max_num_batched_tokens:
            raise ValueError(f"{chunk_size=} must be in [1, max_num_batched_tokens="
                             f"{self.engine.max_num_batched_tokens}]")
        self.set_sampling(self.scratch_slot, GREEDY_PARAMS, 0, 0)
        logits, selected, first_tokens = [], [], []
        for prompt, table in zip(prompts, block_tables):
            prompt = np.asarray(prompt, np.int32)
            rows_logits, rows_selected = [], []
            for start in range(0, len(prompt), chunk_size):
                end = min(start + chunk_size, len(prompt))
                n = end - start
                rows = ScheduledRows(
                    slots=np.array([self.scratch_slot], np.int32), context_lens=np.array([end], np.int32),
                    num_queries=np.array([n], np.int32), block_tables=[table], tokens=prompt[start:end],
                    roles=np.full(n, PROMPT, np.int32), next_tokens=np.append(prompt[start + 1:end + 1], -1)[:n],
                    is_fresh=np.array([start == 0]), samples=np.array([end == len(prompt)]))
                sampled, details = self._run(rows, DETAILS)
                rows_logits.append(np.asarray(details.logits)[:n])
                rows_selected.append(np.asarray(details.selected)[:, :n])
            first_tokens.append(int(np.asarray(sampled.tokens)[0]))
            logits.append(np.concatenate(rows_logits))
            selected.append(np.concatenate(rows_selected, axis=1))
        tokens = max(lens)
        if all_logits:
            out_logits = np.stack([_pad_axis(a, 0, tokens, np.nan) for a in logits])
        else:
            out_logits = np.stack([a[-1] for a in logits])
        out_selected = np.stack([_pad_axis(a, 1, tokens, -1) for a in selected], axis=1) if return_selected else None
        return out_logits, out_selected, np.array(first_tokens, np.int32)

    def decode(self, tokens: Sequence[int], context_lens: Sequence[int], block_tables: Sequence[Sequence[int]], *,
               return_selected: bool = False):
        """One decode step feeding `tokens` (greedy, on the scratch slot). Returns host (logits [n, A] f32,
        selected [layers, n, K] global ids when return_selected, else None, the tokens [n] the device sampled)."""
        n = len(tokens)
        if not n == len(context_lens) == len(block_tables):
            raise ValueError(f"{n} tokens, {len(context_lens)} context lengths and {len(block_tables)} block tables "
                             f"must match")
        self.set_sampling(self.scratch_slot, GREEDY_PARAMS, 0, 0)
        rows = ScheduledRows.decode([self.scratch_slot] * n, context_lens, block_tables, tokens=tokens)
        sampled, details = self._run(rows, DETAILS)
        selected = np.asarray(details.selected)[:, :n] if return_selected else None
        return np.asarray(details.logits)[:n], selected, np.asarray(sampled.tokens)[::self.engine.sample_group][:n]


def _pad_axis(a: np.ndarray, axis: int, size: int, value) -> np.ndarray:
    pad = [(0, 0)] * a.ndim
    pad[axis] = (0, size - a.shape[axis])
    return np.pad(a, pad, constant_values=value)
