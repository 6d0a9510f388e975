"""The model-level API the oracle tests and the GPU checks use: every row's logits and each layer's selected
positions (the `DETAILS` program kind), prompts prefilled and decode steps run synchronously on a runner, greedily,
on its scratch slot. Serving never runs these programs; they compile at first use.
Letters: see the legend in `dcp_jax/__init__.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from dcp_jax.host.sampling import SamplingParams
from dcp_jax.host.step_inputs import PROMPT
from dcp_jax.host.step_plan import ScheduledRows
from dcp_jax.runtime.forward import ProgramKind, StepResult


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Details:
    """The detailed outputs of a step: every row's logits [R, A] f32, the global positions [layers, R, K] each row
    attended (-1 padded), and with an MTP layer its logits at every row [R, A] f32 (else None)."""

    logits: jax.Array
    selected: jax.Array
    mtp_logits: jax.Array | None = None


def _details(result: StepResult):
    mtp_logits = None
    if result.mtp is not None:
        mtp_logits = result.model.head(result.mtp.head_input(result.mtp_hidden))
    return result.sampled, Details(result.model.logits(result.hidden), result.selected, mtp_logits)


# Greedy, with the details: (SampledTokens, Details).
DETAILS = ProgramKind("details", draws=False, outputs=_details, keeps_selected=True)
# How the detailed calls sample: greedily, on the scratch slot.
GREEDY_PARAMS = SamplingParams(temperature=0.0)


def run_details(runner, rows: ScheduledRows):
    """Run `rows` in `runner`'s details program and wait: host (SampledTokens, `Details`)."""
    return jax.device_get(runner.run(rows, DETAILS))


def prefill(runner, prompts: Sequence[Sequence[int]], block_tables: Sequence[Sequence[int]], *,
            chunk_size: int | None = None, all_logits: bool = False, return_selected: bool = False):
    """Prefill `prompts` (token ids, lengths >= 1) into the pages of `block_tables`, each in chunks of at most
    `chunk_size` tokens (default: the largest bucket), one step a chunk; the greedy first tokens go to the scratch
    slot. Returns host (logits [n, A] at each prompt's last token, or [n, Tmax, A] at every position when all_logits
    (NaN past a prompt); selected [layers, n, Tmax, K] global ids, -1 padded, when return_selected, else None; the
    first tokens [n] the device sampled)."""
    engine = runner.engine
    lens = [len(p) for p in prompts]
    if len(prompts) != len(block_tables) or not prompts or min(lens) < 1:
        raise ValueError(f"need one non-empty prompt per block table, got {lens=} and {len(block_tables)} tables")
    chunk_size = chunk_size or engine.buckets[-1]
    if not 1 <= chunk_size <= engine.max_num_batched_tokens:
        raise ValueError(f"{chunk_size=} must be in [1, max_num_batched_tokens={engine.max_num_batched_tokens}]")
    runner.set_sampling(runner.scratch_slot, GREEDY_PARAMS, 0, 0)
    logits, selected, first_tokens = [], [], []
    for prompt, table in zip(prompts, block_tables):
        prompt = np.asarray(prompt, np.int32)
        rows_logits, rows_selected = [], []
        for start in range(0, len(prompt), chunk_size):
            end = min(start + chunk_size, len(prompt))
            n = end - start
            rows = ScheduledRows(
                slots=np.array([runner.scratch_slot], np.int32), context_lens=np.array([end], np.int32),
                num_queries=np.array([n], np.int32), block_tables=[table], tokens=prompt[start:end],
                roles=np.full(n, PROMPT, np.int32), next_tokens=np.append(prompt[start + 1:end + 1], -1)[:n],
                is_fresh=np.array([start == 0]), samples=np.array([end == len(prompt)]))
            sampled, details = runner.run(rows, DETAILS)
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


def decode(runner, tokens: Sequence[int], context_lens: Sequence[int], block_tables: Sequence[Sequence[int]], *,
           return_selected: bool = False):
    """One decode step feeding `tokens` (greedy, on the scratch slot). Returns host (logits [n, A] f32, selected
    [layers, n, K] global ids when return_selected, else None, the tokens [n] the device sampled)."""
    n = len(tokens)
    if not n == len(context_lens) == len(block_tables):
        raise ValueError(f"{n} tokens, {len(context_lens)} context lengths and {len(block_tables)} block tables "
                         f"must match")
    runner.set_sampling(runner.scratch_slot, GREEDY_PARAMS, 0, 0)
    rows = ScheduledRows.decode([runner.scratch_slot] * n, context_lens, block_tables, tokens=tokens)
    sampled, details = runner.run(rows, DETAILS)
    selected = np.asarray(details.selected)[:, :n] if return_selected else None
    return np.asarray(details.logits)[:n], selected, np.asarray(sampled.tokens)[::runner.engine.sample_group][:n]


def _pad_axis(a: np.ndarray, axis: int, size: int, value) -> np.ndarray:
    pad = [(0, 0)] * a.ndim
    pad[axis] = (0, size - a.shape[axis])
    return np.pad(a, pad, constant_values=value)
