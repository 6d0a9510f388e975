"""Host allocator of KV pages (no jax). One page id names the same page on every DCP rank, so one
virtual block of page_size * dcp tokens costs one id from this pool."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"{num_pages=} must be >= 1")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self, count: int) -> list[int]:
        """`count` page ids, or ValueError (nothing taken) when fewer are free."""
        if count < 0:
            raise ValueError(f"{count=} must be >= 0")
        if count > len(self._free):
            raise ValueError(f"need {count} pages, only {len(self._free)} free")
        pages = [self._free.pop() for _ in range(count)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        """Return pages to the pool; freeing a page that is not in use is an error (nothing is freed)."""
        unknown = [p for p in pages if p not in self._used]
        if unknown or len(set(pages)) != len(pages):
            raise ValueError(f"pages {pages} are not all in use exactly once")
        self._used.difference_update(pages)
        self._free.extend(sorted(pages, reverse=True))


class BlockTable:
    """One request's page ids in virtual-block order, kept in a growable int32 array, so a prefill's metadata
    copies it as a numpy row (converting a Python list of 2K ids cost 60 us here; decode steps read the scheduler's
    per-slot array instead). Appends are amortized O(1); `np.asarray(table)` is a read-only view of the ids;
    compares equal to a sequence of the same ids."""

    def __init__(self, pages: Iterable[int] = ()):
        self._ids = np.empty(16, np.int32)
        self._size = 0
        self.extend(pages)

    def extend(self, pages: Iterable[int]) -> None:
        pages = np.fromiter(pages, np.int32)
        size = self._size + len(pages)
        if size > len(self._ids):
            grown = np.empty(max(size, 2 * len(self._ids)), np.int32)
            grown[: self._size] = self._ids[: self._size]
            self._ids = grown
        self._ids[self._size: size] = pages
        self._size = size

    def clear(self) -> list[int]:
        """Empty the table; returns the ids it held."""
        pages = self._ids[: self._size].tolist()
        self._size = 0
        return pages

    def __array__(self, dtype=None, copy=None):
        """The ids as int32 (a read-only view unless a copy or another dtype is asked for)."""
        view = self._ids[: self._size]
        view.flags.writeable = False
        return np.array(view, dtype=dtype, copy=copy)

    def __len__(self) -> int:
        return self._size

    def __iter__(self):
        return iter(self._ids[: self._size].tolist())

    def __eq__(self, other) -> bool:
        return list(self) == list(other)

    def __repr__(self) -> str:
        return f"BlockTable({list(self)})"
