"""`ModelRunner`: the placed weights, the device state (paged KV pool and sampler state) and the compiled decode
and prefill programs of one model.

Serving dispatches (`dispatch_decode`, `dispatch_prefill`): the runner builds the step's metadata
(`host/metadata.py`), enqueues the bucket's program and returns its outputs still on the device (JAX dispatch is
asynchronous), so the caller can dispatch the next step before it reads them. Only sampled token ids and logprobs
come out. `decode` / `prefill` are the detailed, synchronous forms the oracle tests use: host logits, and the
selected top-k ids when asked, from the programs' `details` variants (compiled at first use). Page allocation and
sampler slots are the caller's; a slot's sampling parameters and seed (`SamplingTable`) are set by its prefill.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dcp_jax.config import EngineConfig, ModelConfig, ParallelConfig
from dcp_jax.host.layout import DcpLayout
from dcp_jax.host.metadata import (DecodeInputs, PrefillInputs, SamplingMetadata, SamplingTable,
                                   build_decode_metadata, build_prefill_metadata)
from dcp_jax.host.sampling import SamplingParams
from dcp_jax.model.deepseek_v32 import abstract_model, param_specs
from dcp_jax.model.kv_cache import allocate_kv_cache
from dcp_jax.model.mesh import REPLICATED, sharding
from dcp_jax.runtime.forward import (DECODE_DETAILS, DECODE_GREEDY, DECODE_SAMPLED, DECODE_VARIANTS, PREFILL_DETAILS,
                                     PREFILL_FIRST_TOKEN, PREFILL_OUTPUTS, PREFILL_PROMPT_LOGPROBS, STATE_SPECS,
                                     DeviceState, decode_body, prefill_body)
from dcp_jax.runtime.sampler import SamplerState
from dcp_jax.runtime.step import DecodeStep, PrefillStep

# The decode variants serving compiles for every bucket.
SERVING_DECODE = (DECODE_GREEDY, DECODE_SAMPLED)
# Prompts per prefill program: one (chunked prefill will pack several requests' tokens into one program).
PREFILL_ROWS = 1
# Token roles of a prefill row (`PrefillInputs.roles`).
PAD, PROMPT, GENERATED = 0, 1, 2
# How the detailed (test) calls sample: greedily, on the scratch slot.
GREEDY = SamplingParams(temperature=0.0)


def decode_variants_for(params: Sequence[SamplingParams]) -> tuple[str, ...]:
    """The serving decode programs that steps over requests of `params` (any subset of them) can take."""
    draws = {not p.is_greedy for p in params}
    return tuple(v for v, needed in ((DECODE_GREEDY, False in draws), (DECODE_SAMPLED, True in draws)) if needed)


def prefill_lengths(max_model_len: int, smallest: int = 16) -> tuple[int, ...]:
    """Padded prompt lengths (each one prefill program): powers of two from `smallest`, capped by max_model_len."""
    out, t = [], smallest
    while t < max_model_len:
        out.append(t)
        t *= 2
    return tuple(out) + (max_model_len,)


def sampling_shapes(rows: int) -> SamplingMetadata:
    f32, i32 = (jax.ShapeDtypeStruct((rows,), d) for d in (jnp.float32, jnp.int32))
    return SamplingMetadata(temperature=f32, top_k=i32, top_p=f32, min_p=f32, presence_penalty=f32,
                            frequency_penalty=f32, repetition_penalty=f32,
                            seeds=jax.ShapeDtypeStruct((rows, 2), jnp.uint32), positions=i32, slots=i32)


def decode_input_shapes(rows: int) -> DecodeInputs:
    return DecodeInputs(tokens=jax.ShapeDtypeStruct((rows,), jnp.int32), sampling=sampling_shapes(rows))


def prefill_input_shapes(bucket: tuple[int, int]) -> PrefillInputs:
    rows, _ = bucket
    return PrefillInputs(tokens=jax.ShapeDtypeStruct(bucket, jnp.int32), roles=jax.ShapeDtypeStruct(bucket, jnp.int32),
                         resume_tokens=jax.ShapeDtypeStruct((rows,), jnp.int32), sampling=sampling_shapes(rows))


class ModelRunner:
    """The weights, the device state and the compiled programs of one model on a (tp/dcp, dcp) mesh.

    Every program donates the device state: when one raises, the state may be gone (`kv_cache_is_usable`), and
    `reset_state` allocates a fresh zeroed one (every context it held is lost). `backend` names the kernels'
    implementation (`pallas_kernels.BACKENDS`); `dtype` is the weights' and the exact caches' dtype."""

    def __init__(self, cfg: ModelConfig, params: dict, parallel: ParallelConfig, engine: EngineConfig, mesh: Mesh,
                 backend: str, *, dtype=jnp.float32, lengths: Sequence[int] | None = None):
        """`lengths`: the padded prompt lengths, one prefill program each (default `prefill_lengths`)."""
        self.cfg, self.parallel, self.engine, self.mesh = cfg, parallel, engine, mesh
        self.layout = DcpLayout(parallel.dcp, parallel.interleave, engine.page_size)
        self.max_blocks = engine.max_blocks_per_seq(parallel.dcp)
        self.prefill_lengths = tuple(lengths) if lengths else prefill_lengths(engine.max_model_len)
        if max(self.prefill_lengths) < engine.max_model_len:
            raise ValueError(f"prefill lengths {self.prefill_lengths} must reach max_model_len={engine.max_model_len}")
        self.scratch_slot = engine.max_num_seqs
        self.sampling_table = SamplingTable(engine.max_num_seqs + 1, scratch_slot=self.scratch_slot)
        graphdef, abstract = abstract_model(cfg, dtype)
        specs = param_specs(nnx.to_pure_dict(abstract))
        statics = dict(graphdef=graphdef, abstract=abstract, cfg=cfg)
        common = dict(num_pages=engine.num_pages, param_specs=specs, input_specs=REPLICATED,
                      state_specs=STATE_SPECS, layout=self.layout)
        # Keyed by variant (`forward.DECODE_VARIANTS`): the serving programs, greedy or drawing (sampled tokens
        # only), and the greedy one that also returns logits and the selected ids.
        self.decode_steps = {
            variant: DecodeStep(functools.partial(decode_body, layout=self.layout, backend=backend, variant=variant,
                                                  **statics),
                                mesh, buckets=engine.buckets, max_blocks=self.max_blocks, output_specs=REPLICATED,
                                input_shapes=decode_input_shapes, **common)
            for variant in DECODE_VARIANTS
        }
        self.prefill_steps = {
            outputs: PrefillStep(functools.partial(prefill_body, outputs=outputs, **statics), mesh,
                                 buckets=[(PREFILL_ROWS, t) for t in self.prefill_lengths], output_specs=REPLICATED,
                                 input_shapes=prefill_input_shapes, **common)
            for outputs in PREFILL_OUTPUTS
        }
        self.params = self.decode_steps[DECODE_GREEDY].place_params(params)
        # One compiled allocator, so `reset_state` never compiles while serving.
        self._new_state = jax.jit(
            lambda: DeviceState(allocate_kv_cache(cfg, engine, parallel.dcp, mesh, dtype),
                                SamplerState.zeros(engine.max_num_seqs, cfg.vocab_size)),
            out_shardings=jax.tree.map(lambda spec: sharding(mesh, spec), STATE_SPECS))
        self.state = self._new_state()

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
        self.state = self._new_state()

    # ---- programs ---------------------------------------------------------------------------------------
    def programs(self, *, prompt_logprobs: bool) -> list[tuple[str, object]]:
        """Every program serving needs, as (kind, bucket): each decode bucket greedy and drawing, each prefill
        length, and with `prompt_logprobs` the prefills that return them too."""
        work = [(f"decode {variant}", rows) for variant in SERVING_DECODE for rows in self.engine.buckets]
        for outputs in (PREFILL_FIRST_TOKEN, PREFILL_PROMPT_LOGPROBS) if prompt_logprobs else (PREFILL_FIRST_TOKEN,):
            work += [(f"prefill {outputs}", bucket) for bucket in self.prefill_steps[outputs].buckets]
        return work

    def _step(self, kind: str):
        family, variant = kind.split(" ")
        return (self.decode_steps if family == "decode" else self.prefill_steps)[variant]

    def compile(self, kind: str, bucket) -> None:
        """Compile one program of `programs()`."""
        self._step(kind).compile(self.params, self.state, bucket)

    def compile_decode(self, variants: Sequence[str] = SERVING_DECODE) -> None:
        """Compile the serving decode programs of `variants` (default greedy and drawing) for every bucket."""
        for variant in variants:
            for rows in self.engine.buckets:
                self.decode_steps[variant].compile(self.params, self.state, rows)

    # ---- serving: dispatch, read later ----------------------------------------------------------------------
    def dispatch_decode(self, context_lens: Sequence[int], block_tables, slots: Sequence[int],
                        tokens: Sequence[int] | None = None):
        """Enqueue one decode step: row i feeds the token at position context_lens[i] - 1 (its slot's last sampled
        token, or tokens[i] when given) and samples the next one with the parameters and seed its slot's prefill
        set. `block_tables`: one table per row, or one [rows, blocks] array (-1 past each row's pages). Returns the
        step's sampled tokens for its bucket's rows, packed (`sampler.unpack` reads them), on the device, their copy
        to the host already queued behind the step."""
        return _start_copy_to_host(self._decode(context_lens, block_tables, slots, tokens, details=False))

    def dispatch_prefill(self, prompt: Sequence[int], prompt_len: int, block_table: Sequence[int], params, seed: int,
                         slot: int, *, resume_token: int = -1, prompt_logprobs: bool = False):
        """Enqueue the prefill of one request: `prompt` holds its prompt (the first prompt_len tokens), then for a
        resumed request its generated tokens but the last, `resume_token` (-1 for a new request, whose first token
        is sampled); its slot samples with `params` and `seed` from now on. Returns its sampled token packed
        (`sampler.unpack`), with the prompt's `PromptLogprobs` when asked, on the device, their copy to the host
        already queued behind the program."""
        outputs = PREFILL_PROMPT_LOGPROBS if prompt_logprobs else PREFILL_FIRST_TOKEN
        return _start_copy_to_host(self._prefill(prompt, prompt_len, block_table, params, seed, slot, resume_token,
                                                 outputs))

    # ---- detailed and synchronous (tests) ------------------------------------------------------------------
    def prefill(self, prompts: Sequence[Sequence[int]], block_tables: Sequence[Sequence[int]], *,
                all_logits: bool = False, return_selected: bool = False):
        """Prefill `prompts` (token ids, lengths >= 1), one program each, into the pages of `block_tables`; the
        greedy first tokens go to the scratch slot. Returns host (logits [n, A] at each prompt's last token, or
        [n, Tmax, A] at every position when all_logits; selected [layers, n, Tmax, K] global ids, -1 padded, when
        return_selected, else None; the first tokens [n] the device sampled); Tmax is the longest prompt's padded
        length."""
        lens = [len(p) for p in prompts]
        if len(prompts) != len(block_tables) or not prompts or min(lens) < 1:
            raise ValueError(f"need one non-empty prompt per block table, got {lens=} and {len(block_tables)} tables")
        results = [self._prefill(prompt, len(prompt), table, GREEDY, 0, self.scratch_slot, -1, PREFILL_DETAILS)
                   for prompt, table in zip(prompts, block_tables)]
        details = [d for _, d in results]
        first_tokens = np.concatenate([np.asarray(sampled.tokens)[:1] for sampled, _ in results])
        tokens = max(d.logits.shape[1] for d in details)
        if all_logits:
            logits = np.concatenate([_pad_axis(np.asarray(d.logits), 1, tokens, np.nan) for d in details])
        else:
            logits = np.stack([np.asarray(d.logits)[0, n - 1] for d, n in zip(details, lens)])
        selected = None
        if return_selected:
            selected = np.concatenate([_pad_axis(np.asarray(d.selected), 2, tokens, -1) for d in details], axis=1)
        return logits, selected, first_tokens

    def decode(self, tokens: Sequence[int], context_lens: Sequence[int], block_tables: Sequence[Sequence[int]], *,
               return_selected: bool = False):
        """One decode step feeding `tokens` (greedy, on the scratch slot). Returns host (logits [n, A] f32,
        selected [layers, n, K] global ids when return_selected, else None, the tokens [n] the device sampled)."""
        n = len(tokens)
        sampled, details = self._decode(context_lens, block_tables, [self.scratch_slot] * n, tokens, details=True)
        selected = np.asarray(details.selected)[:, :n] if return_selected else None
        return np.asarray(details.logits)[:n], selected, np.asarray(sampled.tokens)[:n]

    # ---- building a step ----------------------------------------------------------------------------------
    def _decode(self, context_lens, block_tables, slots, tokens, *, details: bool):
        n = len(context_lens)
        if not n == len(block_tables) == len(slots) or (tokens is not None and len(tokens) != n):
            raise ValueError(f"{n} context lengths, {len(block_tables)} block tables, {len(slots)} slots and "
                             f"{'no' if tokens is None else len(tokens)} tokens must match")
        md = build_decode_metadata(context_lens, block_tables, bucket=self.engine.bucket_for(n), layout=self.layout,
                                   max_blocks=self.max_blocks)
        sampling = self.sampling_table.gather(slots, context_lens, rows=md.rows)
        inputs = DecodeInputs(tokens=_padded_tokens(tokens, n, md.rows), sampling=sampling)
        if details:
            step = self.decode_steps[DECODE_DETAILS]
            step.compile(self.params, self.state, md.rows)  # a no-op once compiled
        else:  # pad rows are greedy: the program draws when a scheduled row does
            step = self.decode_steps[DECODE_SAMPLED if np.any(sampling.temperature > 0) else DECODE_GREEDY]
        outputs, self.state = step(self.params, self.state, inputs, md)
        return outputs

    def _prefill(self, prompt, prompt_len, table, params, seed, slot, resume_token, outputs: str):
        if not 1 <= prompt_len <= len(prompt) <= self.engine.max_model_len:
            raise ValueError(f"a prefill of {len(prompt)} tokens (prompt {prompt_len}) must be in [1, "
                             f"max_model_len={self.engine.max_model_len}]")
        tokens = next(t for t in self.prefill_lengths if t >= len(prompt))
        md = build_prefill_metadata([len(prompt)], [table], rows=PREFILL_ROWS, tokens=tokens, layout=self.layout,
                                    max_blocks=self.max_blocks, num_pages=self.engine.num_pages)
        ids = np.zeros((PREFILL_ROWS, tokens), np.int32)
        ids[0, : len(prompt)] = prompt
        roles = np.full((PREFILL_ROWS, tokens), PAD, np.int32)
        roles[0, :prompt_len] = PROMPT
        roles[0, prompt_len: len(prompt)] = GENERATED
        self.sampling_table.set(slot, params, seed)
        inputs = PrefillInputs(tokens=ids, roles=roles, resume_tokens=np.array([resume_token], np.int32),
                               sampling=self.sampling_table.gather([slot], [len(prompt)], rows=PREFILL_ROWS))
        step = self.prefill_steps[outputs]
        step.compile(self.params, self.state, md.bucket)  # a no-op once compiled (an engine compiles all first)
        result, self.state = step(self.params, self.state, inputs, md)
        return result


def _start_copy_to_host(outputs):
    """Queue the device-to-host copy of `outputs` now, so reading them later waits for the program only."""
    for leaf in jax.tree.leaves(outputs):
        leaf.copy_to_host_async()
    return outputs


def _padded_tokens(tokens, n: int, rows: int) -> np.ndarray:
    out = np.full(rows, -1, np.int32)
    if tokens is not None:
        out[:n] = tokens
    return out


def _pad_axis(a: np.ndarray, axis: int, size: int, value) -> np.ndarray:
    pad = [(0, 0)] * a.ndim
    pad[axis] = (0, size - a.shape[axis])
    return np.pad(a, pad, constant_values=value)
