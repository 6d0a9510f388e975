"""How each sampled row of a step samples: `SamplingMetadata` (vLLM's `SamplingParams` as arrays), its builder, and
`SamplingTable`, every sampler slot's parameters and seed kept as one int32 row, so a decode step gathers its rows'
with one numpy index (host only: numpy, no jax).
Letters: see the legend in `dcp_jax/__init__.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, NamedTuple

import numpy as np

from dcp_jax.host.arrays import spec
from dcp_jax.host.sampling import seed_words

# The stop tokens (EOS and stop_token_ids) a request's min_tokens can hold back on the device.
MIN_TOKENS_STOP_IDS = 16


class SamplingMetadata(NamedTuple):
    """How each of U sampled rows samples its next token: vLLM's `SamplingParams` as arrays (all replicated), so one
    compiled program serves any mix of them."""

    # [U] f32: 0 = greedy. Pad rows 0.
    temperature: Annotated[np.ndarray, spec("U", np.float32)]
    # [U] int32: <= 0 = off.
    top_k: Annotated[np.ndarray, spec("U")]
    # [U] f32 in (0, 1]: 1 = off.
    top_p: Annotated[np.ndarray, spec("U", np.float32)]
    # [U] f32 in [0, 1]: 0 = off.
    min_p: Annotated[np.ndarray, spec("U", np.float32)]
    # [U] f32 each: 0, 0 and 1 = off.
    presence_penalty: Annotated[np.ndarray, spec("U", np.float32)]
    frequency_penalty: Annotated[np.ndarray, spec("U", np.float32)]
    repetition_penalty: Annotated[np.ndarray, spec("U", np.float32)]
    # [U, 2] uint32: the request's 64-bit seed, low word first; with `positions` it keys the row's draw.
    seeds: Annotated[np.ndarray, spec("U 2", np.uint32)]
    # [U, MIN_TOKENS_STOP_IDS] int32: the tokens that would end the request (EOS unless ignore_eos, its stop token
    # ids), which it may not sample before position `stops_from` (vLLM's min_tokens); -1 pads.
    stop_ids: Annotated[np.ndarray, spec(f"U {MIN_TOKENS_STOP_IDS}")]
    # [U] int32: the first position at which stop_ids may be sampled (prompt + min_tokens); 0 = any.
    stops_from: Annotated[np.ndarray, spec("U")]
    # [U] int32: position of the token the row samples (its draw's counter). Pad rows 0.
    positions: Annotated[np.ndarray, spec("U")]
    # [U] int32: the request's slot of the device's sampler state (token counts, last token); pad rows the scratch
    # slot.
    slots: Annotated[np.ndarray, spec("U")]


def padded(values, rows: int, fill, dtype) -> np.ndarray:
    out = np.full(rows, fill, dtype)
    out[: len(values)] = values
    return out


def build_sampling_metadata(params: Sequence, seeds: Sequence[int], positions: Sequence[int], slots: Sequence[int],
                            prompt_lens: Sequence[int], *, rows: int, scratch_slot: int,
                            eos_token_id: int | None) -> SamplingMetadata:
    """`SamplingMetadata` of the scheduled rows (each with its `SamplingParams`, 64-bit seed, sampled position, slot
    and its request's prompt length), padded to `rows` greedy rows on the scratch slot. ValueError for a request
    whose min_tokens would have to hold back more than MIN_TOKENS_STOP_IDS stop tokens."""
    n = len(params)
    if not n == len(seeds) == len(positions) == len(slots) == len(prompt_lens) or n > rows:
        raise ValueError(f"{len(params)} params, {len(seeds)} seeds, {len(positions)} positions, {len(slots)} slots "
                         f"and {len(prompt_lens)} prompt lengths for a bucket of {rows} rows")
    words = np.zeros((rows, 2), np.uint32)
    stop_ids = np.full((rows, MIN_TOKENS_STOP_IDS), -1, np.int32)
    stops_from = np.zeros(rows, np.int32)
    for row, (p, prompt_len) in enumerate(zip(params, prompt_lens)):
        words[row] = seed_words(seeds[row])
        if p.min_tokens:
            ids = ([] if p.ignore_eos or eos_token_id is None else [eos_token_id]) + list(p.stop_token_ids)
            if len(ids) > MIN_TOKENS_STOP_IDS:
                raise ValueError(f"min_tokens holds back at most {MIN_TOKENS_STOP_IDS} stop tokens (EOS included), "
                                 f"got {len(ids)}")
            stop_ids[row, : len(ids)] = ids
            stops_from[row] = prompt_len + p.min_tokens
    return SamplingMetadata(
        temperature=padded([p.temperature for p in params], rows, 0.0, np.float32),
        top_k=padded([p.top_k for p in params], rows, 0, np.int32),
        top_p=padded([p.top_p for p in params], rows, 1.0, np.float32),
        min_p=padded([p.min_p for p in params], rows, 0.0, np.float32),
        presence_penalty=padded([p.presence_penalty for p in params], rows, 0.0, np.float32),
        frequency_penalty=padded([p.frequency_penalty for p in params], rows, 0.0, np.float32),
        repetition_penalty=padded([p.repetition_penalty for p in params], rows, 1.0, np.float32),
        seeds=words, stop_ids=stop_ids, stops_from=stops_from, positions=padded(positions, rows, 0, np.int32),
        slots=padded(slots, rows, scratch_slot, np.int32))


class SamplingTable:
    """Every sampler slot's sampling parameters and seed, set when a request takes its slot (at its prefill), so a
    decode step gathers its rows' with one numpy index. Slots never set, and the scratch slot of pad rows, sample
    greedily with seed 0."""

    _PER_SLOT = tuple(n for n in SamplingMetadata._fields if n not in ("positions", "slots"))

    def __init__(self, num_slots: int, *, scratch_slot: int, eos_token_id: int | None):
        """`num_slots` slots, the scratch one among them; `eos_token_id` the model's (min_tokens holds it back)."""
        self.scratch_slot, self.eos_token_id = scratch_slot, eos_token_id
        unset = build_sampling_metadata([], [], [], [], [], rows=num_slots, scratch_slot=scratch_slot,
                                        eos_token_id=eos_token_id)
        # One int32 row per slot: every per-slot field's bits side by side, at `self._columns[name]`.
        fields = [getattr(unset, name).reshape(num_slots, -1) for name in self._PER_SLOT]
        self._rows = np.concatenate([f.view(np.int32) for f in fields], axis=1)
        ends = np.cumsum([f.shape[1] for f in fields])
        self._columns = {name: (int(end) - f.shape[1], int(end), f.dtype, getattr(unset, name).shape[1:])
                         for name, f, end in zip(self._PER_SLOT, fields, ends)}

    def set(self, slot: int, params, seed: int, prompt_len: int) -> None:
        """Slot `slot` samples with `params` (a `SamplingParams`) and the 64-bit `seed` for a request of a prompt of
        `prompt_len` tokens from now on."""
        row = build_sampling_metadata([params], [seed], [0], [slot], [prompt_len], rows=1,
                                      scratch_slot=self.scratch_slot, eos_token_id=self.eos_token_id)
        for name, (begin, end, _, _) in self._columns.items():
            self._rows[slot, begin:end] = getattr(row, name).reshape(-1).view(np.int32)

    def gather(self, slots: Sequence[int], positions: Sequence[int], *, rows: int) -> SamplingMetadata:
        """`SamplingMetadata` of rows on `slots` sampling the tokens at `positions`, padded to `rows` rows on the
        scratch slot (as `build_sampling_metadata` pads)."""
        if len(slots) != len(positions) or len(slots) > rows:
            raise ValueError(f"{len(slots)} slots and {len(positions)} positions for a bucket of {rows} rows")
        index = padded(slots, rows, self.scratch_slot, np.int32)
        gathered = self._rows[index]
        return SamplingMetadata(**{name: gathered[:, begin:end].view(dtype).reshape((rows, *shape))
                                   for name, (begin, end, dtype, shape) in self._columns.items()},
                                positions=padded(positions, rows, 0, np.int32), slots=index)

    def gather_into(self, out: SamplingMetadata, slots: np.ndarray, positions: np.ndarray) -> None:
        """Write the first len(slots) rows of `out` (views of a padded `SamplingMetadata`) as `gather` would."""
        n = len(slots)
        gathered = self._rows[slots]
        for name, (begin, end, dtype, shape) in self._columns.items():
            getattr(out, name)[:n] = gathered[:, begin:end].view(dtype).reshape((n, *shape))
        out.positions[:n] = positions
        out.slots[:n] = slots
