"""`ModelRunner`: the placed weights, the paged KV pool and the compiled decode and prefill programs of one model.

It takes host token ids, lengths and block tables, builds the step's metadata (`host/metadata.py`), runs the
program of its bucket and returns host logits (and, when asked, the selected top-k ids: the oracle tests want
them, serving does not). Page allocation is the caller's.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from dcp_jax.config import EngineConfig, ModelConfig, ParallelConfig
from dcp_jax.host.layout import DcpLayout
from dcp_jax.host.metadata import build_decode_metadata, build_prefill_metadata
from dcp_jax.model.deepseek_v32 import abstract_model, param_specs
from dcp_jax.model.kv_cache import allocate_kv_cache
from dcp_jax.runtime.forward import decode_body, prefill_body
from dcp_jax.runtime.step import DecodeStep, PrefillStep

# Prompts per prefill program: one (chunked prefill will pack several requests' tokens into one program).
PREFILL_ROWS = 1


def prefill_lengths(max_model_len: int, smallest: int = 16) -> tuple[int, ...]:
    """Padded prompt lengths (each one prefill program): powers of two from `smallest`, capped by max_model_len."""
    out, t = [], smallest
    while t < max_model_len:
        out.append(t)
        t *= 2
    return tuple(out) + (max_model_len,)


class ModelRunner:
    """The weights, the KV cache and the compiled programs of one model on a (tp/dcp, dcp) mesh.

    Every program donates the KV cache: when one raises, the cache may be gone (`kv_cache_is_usable`), and
    `reset_kv_cache` allocates a fresh zeroed one (every context it held is lost). `backend` names the kernels'
    implementation (`pallas_kernels.BACKENDS`)."""

    def __init__(self, cfg: ModelConfig, params: dict, parallel: ParallelConfig, engine: EngineConfig, mesh: Mesh,
                 backend: str):
        self.cfg, self.parallel, self.engine, self.mesh = cfg, parallel, engine, mesh
        self.layout = DcpLayout(parallel.dcp, parallel.interleave, engine.page_size)
        self.max_blocks = engine.max_blocks_per_seq(parallel.dcp)
        self.prefill_lengths = prefill_lengths(engine.max_model_len)
        graphdef, abstract = abstract_model(cfg)
        specs = param_specs(nnx.to_pure_dict(abstract))
        statics = dict(graphdef=graphdef, abstract=abstract, cfg=cfg)
        self.decode_step = DecodeStep(
            functools.partial(decode_body, layout=self.layout, backend=backend, **statics), mesh,
            buckets=engine.buckets, layout=self.layout, max_blocks=self.max_blocks, param_specs=specs,
            input_specs=P(), output_specs=(P(), P()),
            input_shapes=lambda rows: jax.ShapeDtypeStruct((rows,), jnp.int32))
        # Keyed by all_logits: the logits of every position (prompt logprobs) or of each prompt's last token.
        self.prefill_steps = {
            all_logits: PrefillStep(
                functools.partial(prefill_body, all_logits=all_logits, **statics), mesh,
                buckets=[(PREFILL_ROWS, t) for t in self.prefill_lengths], layout=self.layout, param_specs=specs,
                input_specs=P(), output_specs=(P(), P()),
                input_shapes=lambda bucket: jax.ShapeDtypeStruct(bucket, jnp.int32))
            for all_logits in (False, True)
        }
        self.params = self.decode_step.place_params(params)
        # One compiled allocator, so `reset_kv_cache` never compiles while serving.
        self._new_kv_cache = jax.jit(functools.partial(allocate_kv_cache, cfg, engine, parallel.dcp, mesh))
        self.kv_cache = self._new_kv_cache()

    def kv_cache_is_usable(self) -> bool:
        """False when a failed program consumed the donated cache (deleted) or left it poisoned by an error."""
        try:
            leaves = jax.tree.leaves(self.kv_cache)
            if any(leaf.is_deleted() for leaf in leaves):
                return False
            jax.block_until_ready(leaves)
        except Exception:  # an asynchronous failure surfaces here
            return False
        return True

    def reset_kv_cache(self) -> None:
        """A fresh zeroed KV cache in the same placement (no recompile); every cached context is lost."""
        self.kv_cache = self._new_kv_cache()

    def programs(self, *, prompt_logprobs: bool) -> list[tuple[str, object]]:
        """Every program serving needs, as (kind, bucket): each decode bucket, each prefill length, and with
        `prompt_logprobs` the all-positions prefills too."""
        work = [("decode", rows) for rows in self.decode_step.buckets]
        for all_logits in (False, True) if prompt_logprobs else (False,):
            kind = "prefill (all logits)" if all_logits else "prefill"
            work += [(kind, bucket) for bucket in self.prefill_steps[all_logits].buckets]
        return work

    def compile(self, kind: str, bucket) -> None:
        """Compile one program of `programs()`."""
        step = self.decode_step if kind == "decode" else self.prefill_steps[kind == "prefill (all logits)"]
        step.compile(self.params, self.kv_cache, bucket)

    def compile_decode(self, progress=None) -> None:
        """Compile every decode bucket; `progress` may wrap the loop (tqdm)."""
        buckets = self.decode_step.buckets
        for rows in progress(buckets) if progress else buckets:
            self.decode_step.compile(self.params, self.kv_cache, rows)

    def prefill(self, prompts: Sequence[Sequence[int]], block_tables: Sequence[Sequence[int]], *,
                all_logits: bool = False, return_selected: bool = False):
        """Prefill `prompts` (token ids, lengths >= 1), one program each, into the pages of `block_tables`
        (virtual-block page ids, enough for each prompt). Returns host (logits [n, A] at each prompt's last
        token, or [n, Tmax, A] at every position when all_logits, and selected [layers, n, Tmax, K] global ids,
        -1 padded, when return_selected, else None); Tmax is the longest prompt's padded length."""
        lens = [len(p) for p in prompts]
        if len(prompts) != len(block_tables) or not prompts or min(lens) < 1:
            raise ValueError(f"need one non-empty prompt per block table, got {lens=} and {len(block_tables)} tables")
        if max(lens) > self.engine.max_model_len:
            raise ValueError(f"prompt of {max(lens)} tokens exceeds max_model_len={self.engine.max_model_len}")
        results = [self._prefill_one(prompt, table, all_logits) for prompt, table in zip(prompts, block_tables)]
        tokens = max(r[0].shape[1] for r in results)
        if all_logits:
            logits = np.concatenate([_pad_axis(r[0], 1, tokens, np.nan) for r in results])
        else:
            logits = np.concatenate([r[0] for r in results])
        if not return_selected:
            return logits, None
        return logits, np.concatenate([_pad_axis(np.asarray(r[1]), 2, tokens, -1) for r in results], axis=1)

    def _prefill_one(self, prompt: Sequence[int], table: Sequence[int], all_logits: bool):
        tokens = next(t for t in self.prefill_lengths if t >= len(prompt))
        md = build_prefill_metadata([len(prompt)], [table], rows=PREFILL_ROWS, tokens=tokens, layout=self.layout,
                                    max_blocks=self.max_blocks, num_pages=self.engine.num_pages)
        ids = np.zeros((PREFILL_ROWS, tokens), np.int32)
        ids[0, : len(prompt)] = prompt
        step = self.prefill_steps[all_logits]
        step.compile(self.params, self.kv_cache, md.bucket)  # a no-op once compiled (an engine compiles all first)
        (logits, selected), self.kv_cache = step(self.params, self.kv_cache, ids, md)
        return np.asarray(logits), selected  # one row: nothing to cut (slicing a device array would compile)

    def decode(self, tokens: Sequence[int], context_lens: Sequence[int], block_tables: Sequence[Sequence[int]], *,
               return_selected: bool = False):
        """One decode step: row i feeds `tokens[i]` at position context_lens[i] - 1. Returns host
        (logits [n, A] f32, selected [layers, n, K] global ids when return_selected, else None). The program
        is the same either way (one per bucket); only the host copy of the selected ids is skipped."""
        n = len(tokens)
        if not n == len(context_lens) == len(block_tables):
            raise ValueError(f"{n} tokens, {len(context_lens)} context lengths and {len(block_tables)} block tables "
                             "must match")
        md = build_decode_metadata(context_lens, block_tables, bucket=self.engine.bucket_for(n), layout=self.layout,
                                   max_blocks=self.max_blocks)
        padded = np.zeros(md.rows, np.int32)
        padded[:n] = tokens
        (logits, selected), self.kv_cache = self.decode_step(self.params, self.kv_cache, padded, md)
        return np.asarray(logits)[:n], np.asarray(selected)[:, :n] if return_selected else None


def _pad_axis(a: np.ndarray, axis: int, size: int, value) -> np.ndarray:
    pad = [(0, 0)] * a.ndim
    pad[axis] = (0, size - a.shape[axis])
    return np.pad(a, pad, constant_values=value)
