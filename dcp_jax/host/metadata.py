"""Per-step metadata of the decode and prefill programs: one declared dataclass each, one builder each, one
structural check (host only: numpy, no jax; `runtime/step.py` registers the dataclasses as pytrees).

Every index a program needs (positions, lengths, per-rank local lengths, slots, block tables) is computed here
with numpy, padded to the program's bucket, and handed to the jitted program as a required input. The builders
are the only constructors and validate what they are given; `check_*` runs before every step and checks what a
program relies on: the structure (fields, shapes, dtypes, a known bucket) and the pages (every page a row uses is
in the pool and used by that row alone). That the values are the layout's is the builders' job, proven by tests.

Each field is documented once, above it. A field marked `per_rank` is [W, ...], sharded over the "dcp" mesh
axis: inside the program each rank sees its own [...] slice (`rank_view`); every other field is replicated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from dcp_jax.host.layout import DcpLayout
from dcp_jax.host.sampling import seed_words

PER_RANK = dict(per_rank=True)


@dataclasses.dataclass(frozen=True)
class DecodeMetadata:
    """One decode step of R rows (the bucket): row r feeds one token at position context_lens[r] - 1."""

    # [R] int32: global position of the token each row decodes (context_len - 1). Pad rows 0.
    positions: np.ndarray
    # [R] int32: global context length of each row, the decoded token included. Pad rows 0.
    context_lens: np.ndarray
    # [W, R] int32, per rank: tokens of row r held by rank w (sums to context_lens). Pad rows 0.
    local_context_lens: np.ndarray = dataclasses.field(metadata=PER_RANK)
    # [W, R] int32, per rank: physical slot where rank w writes row r's new token; -1 = not the owner (no
    # write). Pad rows -1 on every rank.
    slot_mapping: np.ndarray = dataclasses.field(metadata=PER_RANK)
    # [R, P] int32: virtual-block page ids of each row (one id names the same page on every rank); -1 =
    # unallocated. Pad rows all -1.
    block_tables: np.ndarray

    @property
    def rows(self) -> int:
        """Bucket width R; selects the compiled program."""
        return self.context_lens.shape[0]


@dataclasses.dataclass(frozen=True)
class PrefillMetadata:
    """One prefill program of R prompts padded to T tokens (the bucket): row r writes tokens 0..prompt_len - 1 of
    its prompt."""

    # [R, T] int32: global position of each prompt token (its index in the prompt). Pad tokens 0.
    positions: np.ndarray
    # [W, R, T] int32, per rank: physical slot where rank w writes each token; -1 = not the owner, or a pad
    # token (no write).
    slot_mapping: np.ndarray = dataclasses.field(metadata=PER_RANK)
    # [R] int32: index in the row of the token whose logits are sampled (the prompt's last). Pad rows 0.
    logits_indices: np.ndarray

    @property
    def bucket(self) -> tuple[int, int]:
        """(R, T); selects the compiled program."""
        return tuple(self.positions.shape)


@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    """How each row of a step samples its next token: vLLM's `SamplingParams` as arrays (all replicated), so one
    compiled program serves any mix of them."""

    # [R] f32: 0 = greedy. Pad rows 0.
    temperature: np.ndarray
    # [R] int32: <= 0 = off.
    top_k: np.ndarray
    # [R] f32 in (0, 1]: 1 = off.
    top_p: np.ndarray
    # [R] f32 in [0, 1]: 0 = off.
    min_p: np.ndarray
    # [R] f32 each: 0, 0 and 1 = off.
    presence_penalty: np.ndarray
    frequency_penalty: np.ndarray
    repetition_penalty: np.ndarray
    # [R, 2] uint32: the request's 64-bit seed, low word first; with `positions` it keys the row's draw.
    seeds: np.ndarray
    # [R] int32: position of the token the row samples (its draw's counter). Pad rows 0.
    positions: np.ndarray
    # [R] int32: the request's slot of the device's sampler state (token counts, last token); pad rows the scratch
    # slot.
    slots: np.ndarray


@dataclasses.dataclass(frozen=True)
class DecodeInputs:
    """The decode step's per-row data besides its metadata."""

    # [R] int32: the token each row feeds; -1 = the slot's last sampled token (still on the device).
    tokens: np.ndarray
    sampling: SamplingMetadata


@dataclasses.dataclass(frozen=True)
class PrefillInputs:
    """The prefill program's per-row data besides its metadata."""

    # [R, T] int32: each row's tokens (prompt, then the generated tokens of a resumed request). Pad tokens 0.
    tokens: np.ndarray
    # [R, T] int32: what each token is: 0 pad, 1 prompt, 2 generated (a resumed request's history).
    roles: np.ndarray
    # [R] int32: -1 = sample the row's first token; else the last generated token of a resumed request (the next
    # decode input, never written by a prefill).
    resume_tokens: np.ndarray
    sampling: SamplingMetadata


def field_names(cls) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def is_per_rank(field: dataclasses.Field) -> bool:
    return bool(field.metadata.get("per_rank"))


def _check_lengths(lens: np.ndarray, rows: int, what: str) -> None:
    if lens.ndim != 1 or lens.shape[0] > rows:
        raise ValueError(f"{lens.shape[0] if lens.ndim == 1 else lens.shape} scheduled rows do not fit bucket {rows}")
    if np.any(lens < 1):
        raise ValueError(f"{what} of scheduled rows must be >= 1, got {lens.tolist()}")


def _padded_tables(lens: np.ndarray, block_tables, layout: DcpLayout, rows: int, max_blocks: int) -> np.ndarray:
    """[rows, max_blocks] int32 of the rows' page ids, -1 past each table and on pad rows, after checking that
    each table covers its row's tokens. `block_tables` is a sequence of tables (arrays, `page_allocator.BlockTable`
    or lists; lists convert slowly when long) or one [n, m] int array, -1 past each row's ids (one copy)."""
    n = lens.shape[0]
    if len(block_tables) != n:
        raise ValueError(f"{len(block_tables)} block tables for {n} rows")
    needed = layout.virtual_blocks(lens)
    too_long = np.flatnonzero(needed > max_blocks)
    if too_long.size:
        row = int(too_long[0])
        raise ValueError(f"row {row}: a length of {lens[row]} needs {needed[row]} blocks > {max_blocks=}")
    tables = np.full((rows, max_blocks), -1, np.int32)
    if isinstance(block_tables, np.ndarray):
        if block_tables.ndim != 2:
            raise ValueError(f"block tables as one array must be [rows, blocks], got shape {block_tables.shape}")
        tables[:n, : block_tables.shape[1]] = block_tables[:, :max_blocks]
        # -1 past each row's ids: a row holds its needed blocks when the last one is set.
        is_short = tables[np.arange(n), np.maximum(needed - 1, 0)] < 0
    else:
        sizes = np.zeros(n, np.int64)
        for row, table in enumerate(block_tables):
            table = np.asarray(table, np.int32)[:max_blocks]
            tables[row, : len(table)] = table
            sizes[row] = len(table)
        is_short = sizes < needed
    short = np.flatnonzero(is_short)
    if short.size:
        row = int(short[0])
        raise ValueError(f"row {row}: a length of {lens[row]} needs {needed[row]} blocks, its block table has "
                         f"{np.count_nonzero(tables[row] >= 0)} page ids")
    return tables


def build_decode_metadata(context_lens: Sequence[int], block_tables: Sequence[Sequence[int]], *, bucket: int,
                          layout: DcpLayout, max_blocks: int) -> DecodeMetadata:
    """`DecodeMetadata` (numpy) for the scheduled rows, padded to `bucket` inert rows.

    context_lens[i]: global length of request i after this step's token is appended (>= 1).
    block_tables[i]: its virtual-block page ids (at least ceil(context_len / (page_size * dcp_size)) of them).
    """
    lens = np.asarray(context_lens, dtype=np.int64).reshape(-1)
    _check_lengths(lens, bucket, "context_lens")
    tables = _padded_tables(lens, block_tables, layout, bucket, max_blocks)
    padded_lens = np.zeros(bucket, np.int32)
    padded_lens[: lens.shape[0]] = lens
    positions = np.where(padded_lens > 0, padded_lens - 1, 0).astype(np.int32)
    return DecodeMetadata(
        positions=positions,
        context_lens=padded_lens,
        local_context_lens=layout.local_context_lens(padded_lens),
        slot_mapping=layout.slot_mapping(np.where(padded_lens > 0, positions, -1), tables),
        block_tables=tables,
    )


def build_prefill_metadata(prompt_lens: Sequence[int], block_tables: Sequence[Sequence[int]], *, rows: int,
                           tokens: int, layout: DcpLayout, max_blocks: int, num_pages: int) -> PrefillMetadata:
    """`PrefillMetadata` (numpy) for prompts of `prompt_lens` tokens (each >= 1, at most `tokens`), padded to the
    bucket (rows, tokens); block_tables[i] holds at least the blocks of prompt i's tokens, pages of a pool of
    `num_pages` used by that row alone (checked here: the metadata keeps only the slots)."""
    lens = np.asarray(prompt_lens, dtype=np.int64).reshape(-1)
    _check_lengths(lens, rows, "prompt_lens")
    if lens.max() > tokens:
        raise ValueError(f"a prompt of {int(lens.max())} tokens does not fit a prefill of {tokens}")
    tables = _padded_tables(lens, block_tables, layout, rows, max_blocks)
    padded_lens = np.zeros(rows, np.int64)
    padded_lens[: lens.shape[0]] = lens
    _check_pages(padded_lens, tables, layout, num_pages)
    index = np.arange(tokens)[None, :]
    is_token = index < padded_lens[:, None]  # [R, T]
    return PrefillMetadata(
        positions=np.where(is_token, index, 0).astype(np.int32),
        slot_mapping=layout.slot_mapping(np.where(is_token, index, -1), tables),
        logits_indices=np.maximum(padded_lens - 1, 0).astype(np.int32),
    )


def _padded(values, rows: int, fill, dtype) -> np.ndarray:
    out = np.full(rows, fill, dtype)
    out[: len(values)] = values
    return out


def build_sampling_metadata(params: Sequence, seeds: Sequence[int], positions: Sequence[int], slots: Sequence[int], *,
                            rows: int, scratch_slot: int) -> SamplingMetadata:
    """`SamplingMetadata` of the scheduled rows (each with its `SamplingParams`, 64-bit seed, sampled position and
    slot), padded to `rows` greedy rows on the scratch slot."""
    n = len(params)
    if not n == len(seeds) == len(positions) == len(slots) or n > rows:
        raise ValueError(f"{len(params)} params, {len(seeds)} seeds, {len(positions)} positions and {len(slots)} slots "
                         f"for a bucket of {rows} rows")
    words = np.zeros((rows, 2), np.uint32)
    if n:
        words[:n] = [seed_words(s) for s in seeds]
    return SamplingMetadata(
        temperature=_padded([p.temperature for p in params], rows, 0.0, np.float32),
        top_k=_padded([p.top_k for p in params], rows, 0, np.int32),
        top_p=_padded([p.top_p for p in params], rows, 1.0, np.float32),
        min_p=_padded([p.min_p for p in params], rows, 0.0, np.float32),
        presence_penalty=_padded([p.presence_penalty for p in params], rows, 0.0, np.float32),
        frequency_penalty=_padded([p.frequency_penalty for p in params], rows, 0.0, np.float32),
        repetition_penalty=_padded([p.repetition_penalty for p in params], rows, 1.0, np.float32),
        seeds=words, positions=_padded(positions, rows, 0, np.int32),
        slots=_padded(slots, rows, scratch_slot, np.int32))


class SamplingTable:
    """Every sampler slot's sampling parameters and seed, set when a request takes its slot (at its prefill), so a
    decode step gathers its rows' with one numpy index. Slots never set, and the scratch slot of pad rows, sample
    greedily with seed 0."""

    _PER_SLOT = tuple(n for n in field_names(SamplingMetadata) if n not in ("positions", "slots"))

    def __init__(self, num_slots: int, *, scratch_slot: int):
        """`num_slots` slots, the scratch one among them."""
        self.scratch_slot = scratch_slot
        unset = build_sampling_metadata([], [], [], [], rows=num_slots, scratch_slot=scratch_slot)
        # One int32 row per slot: every per-slot field's bits side by side, at `self._columns[name]`.
        fields = [getattr(unset, name).reshape(num_slots, -1) for name in self._PER_SLOT]
        self._rows = np.concatenate([f.view(np.int32) for f in fields], axis=1)
        ends = np.cumsum([f.shape[1] for f in fields])
        self._columns = {name: (int(end) - f.shape[1], int(end), f.dtype, getattr(unset, name).shape[1:])
                         for name, f, end in zip(self._PER_SLOT, fields, ends)}

    def set(self, slot: int, params, seed: int) -> None:
        """Slot `slot` samples with `params` (a `SamplingParams`) and the 64-bit `seed` from now on."""
        row = build_sampling_metadata([params], [seed], [0], [slot], rows=1, scratch_slot=self.scratch_slot)
        for name, (begin, end, _, _) in self._columns.items():
            self._rows[slot, begin:end] = getattr(row, name).reshape(-1).view(np.int32)

    def gather(self, slots: Sequence[int], positions: Sequence[int], *, rows: int) -> SamplingMetadata:
        """`SamplingMetadata` of rows on `slots` sampling the tokens at `positions`, padded to `rows` rows on the
        scratch slot (as `build_sampling_metadata` pads)."""
        if len(slots) != len(positions) or len(slots) > rows:
            raise ValueError(f"{len(slots)} slots and {len(positions)} positions for a bucket of {rows} rows")
        index = _padded(slots, rows, self.scratch_slot, np.int32)
        gathered = self._rows[index]
        return SamplingMetadata(**{name: gathered[:, begin:end].view(dtype).reshape((rows, *shape))
                                   for name, (begin, end, dtype, shape) in self._columns.items()},
                                positions=_padded(positions, rows, 0, np.int32), slots=index)


def _check_structure(md, cls, expected: dict[str, tuple[int, ...]]) -> None:
    if not isinstance(md, cls):
        raise TypeError(f"expected {cls.__name__}, got {type(md).__name__}")
    for name, shape in expected.items():
        value = getattr(md, name)
        if value is None or not hasattr(value, "shape") or not hasattr(value, "dtype"):
            raise TypeError(f"{cls.__name__}.{name} must be an array, got {type(value).__name__}")
        if tuple(value.shape) != shape:
            raise ValueError(f"{cls.__name__}.{name} has shape {tuple(value.shape)}, expected {shape}")
        if np.dtype(value.dtype) != np.int32:
            raise TypeError(f"{cls.__name__}.{name} has dtype {value.dtype}, expected int32")


def check_decode_metadata(md, *, buckets: Sequence[int], layout: DcpLayout, max_blocks: int,
                          num_pages: int) -> None:
    """TypeError/ValueError unless `md` is a complete, well-shaped DecodeMetadata of a known bucket whose rows
    use pages of the pool, each page by one row only (either fault would make a row read or overwrite another
    request's KV). Runs on the host before anything is traced; the page check needs host (numpy) arrays."""
    rows = np.shape(md.context_lens)[0] if isinstance(md, DecodeMetadata) and np.ndim(md.context_lens) == 1 else None
    if isinstance(md, DecodeMetadata) and rows not in buckets:
        raise ValueError(f"context_lens shape {np.shape(md.context_lens)} is not [R] for a bucket R in {list(buckets)}")
    w = layout.dcp_size
    _check_structure(md, DecodeMetadata, dict(positions=(rows,), context_lens=(rows,), local_context_lens=(w, rows),
                                              slot_mapping=(w, rows), block_tables=(rows, max_blocks)))
    if not isinstance(md.block_tables, np.ndarray):
        return
    if np.any(md.context_lens < 0):
        raise ValueError(f"context_lens must be >= 0, got {md.context_lens.tolist()}")
    _check_pages(md.context_lens, md.block_tables, layout, num_pages)


def _check_pages(lens: np.ndarray, block_tables: np.ndarray, layout: DcpLayout, num_pages: int) -> None:
    """ValueError unless the blocks that rows of `lens` tokens use name pages in [0, num_pages), each page in one
    block only."""
    needed = layout.virtual_blocks(lens)  # virtual blocks in use per row
    in_use = np.arange(block_tables.shape[1])[None, :] < needed[:, None]
    pages = block_tables[in_use]
    if pages.size and (pages.min() < 0 or pages.max() >= num_pages):
        row = int(np.argwhere(in_use & ((block_tables < 0) | (block_tables >= num_pages)))[0, 0])
        raise ValueError(f"row {row}: block table {block_tables[row, : needed[row]].tolist()} needs page ids in "
                         f"[0, num_pages={num_pages}) for its {int(needed[row])} blocks")
    is_used = np.zeros(num_pages, np.bool_)  # O(pages), no sort: this runs before every step
    is_used[pages] = True
    if np.count_nonzero(is_used) != len(pages):
        uses = np.bincount(pages, minlength=num_pages)
        raise ValueError(f"page ids used by two blocks (one row or two): {np.flatnonzero(uses > 1)[:16].tolist()}")


def check_prefill_metadata(md, *, buckets: Sequence[tuple[int, int]], layout: DcpLayout, num_pages: int) -> None:
    """TypeError/ValueError unless `md` is a complete, well-shaped PrefillMetadata of a known (R, T) bucket whose
    slots lie in the pool (host arrays: checked by value)."""
    bucket = tuple(np.shape(md.positions)) if isinstance(md, PrefillMetadata) else None
    if isinstance(md, PrefillMetadata) and bucket not in buckets:
        raise ValueError(f"positions shape {bucket} is not a prefill bucket (R, T) in {list(buckets)}")
    rows, tokens = bucket if bucket is not None else (None, None)
    _check_structure(md, PrefillMetadata, dict(positions=(rows, tokens), slot_mapping=(layout.dcp_size, rows, tokens),
                                               logits_indices=(rows,)))
    if isinstance(md.slot_mapping, np.ndarray) and np.any(md.slot_mapping >= num_pages * layout.page_size):
        raise ValueError(f"slot_mapping names slots past the pool's {num_pages * layout.page_size}")
