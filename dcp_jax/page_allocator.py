"""Host allocator of KV pages (no jax). One page id names the same page on every DCP rank, so one
virtual block of page_size * dcp tokens costs one id from this pool."""

from __future__ import annotations


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
