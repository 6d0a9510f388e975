"""Host allocator of KV pages, with the prefix cache (no jax). One page id names the same page on every DCP rank, so
one virtual block of page_size * dcp tokens costs one id from this pool.

Pages are reference-counted: a page a request's block table holds counts once per holder, and returns to the pool
when its last holder frees it. With the prefix cache a page that holds a full block of known tokens carries the
block's hash (`block_hashes`: its tokens and every token before it); when its last holder frees it, it stays cached
(evictable, least recently used first) until the pool needs it, and a later request whose prompt starts with the
same blocks takes it back (`take_cached`) instead of computing them again. `num_free` counts both the free and the
evictable pages: an allocation evicts when it must.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Iterable, Sequence

import numpy as np


def block_hashes(tokens: Sequence[int], block_tokens: int, *, parent: bytes = b"") -> list[bytes]:
    """The hash of each full block of `block_tokens` tokens of `tokens`: a chain, each block's hash covering its
    tokens and its parent's hash (the blocks before it), so equal hashes mean equal prefixes."""
    hashes = []
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        block = np.asarray(tokens[start: start + block_tokens], np.int64).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        hashes.append(parent)
    return hashes


class PageAllocator:
    """Reference-counted pages; with `enable_prefix_caching`, a page of a hashed full block stays cached after its
    last holder frees it (`take_cached` reuses it, `allocate` evicts the least recently used)."""

    def __init__(self, num_pages: int, *, enable_prefix_caching: bool = False):
        if num_pages < 1:
            raise ValueError(f"{num_pages=} must be >= 1")
        self.num_pages = num_pages
        self.enable_prefix_caching = enable_prefix_caching
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._refs: dict[int, int] = {}  # page -> holders, for pages in use
        self._page_of: dict[bytes, int] = {}  # block hash -> the page that holds it
        self._hash_of: dict[int, bytes] = {}
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, unheld; LRU first

    @property
    def num_free(self) -> int:
        """Pages an allocation can take: the free ones and the evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Pages some block table holds."""
        return len(self._refs)

    @property
    def num_cached(self) -> int:
        """Pages holding a hashed block (held or evictable)."""
        return len(self._hash_of)

    def refs(self, page: int) -> int:
        return self._refs.get(page, 0)

    def allocate(self, count: int) -> list[int]:
        """`count` page ids, each held once, or ValueError (nothing taken) when fewer are free; evicts the least
        recently used cached pages when the free ones run out."""
        if count < 0:
            raise ValueError(f"{count=} must be >= 0")
        if count > self.num_free:
            raise ValueError(f"need {count} pages, only {self.num_free} free")
        pages = []
        for _ in range(count):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._evictable.popitem(last=False)
                del self._page_of[self._hash_of.pop(page)]
            self._refs[page] = 1
            pages.append(page)
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Drop one hold of each page; a page nobody holds returns to the pool (cached pages stay evictable).
        Freeing a page that is not in use is an error (nothing is freed)."""
        held = collections.Counter(pages)
        if any(self._refs.get(page, 0) < n for page, n in held.items()):
            raise ValueError(f"pages {list(pages)} are not all in use that often")
        released = []
        for page in pages:
            self._refs[page] -= 1
            if self._refs[page] == 0:
                del self._refs[page]
                if page in self._hash_of:
                    self._evictable[page] = None
                else:
                    released.append(page)
        self._free.extend(sorted(released, reverse=True))

    # ---- the prefix cache -------------------------------------------------------------------------------
    def take_cached(self, hashes: Sequence[bytes]) -> list[int]:
        """The pages of the longest prefix of `hashes` that is cached, each now held once more (in order)."""
        pages = []
        if not self.enable_prefix_caching:
            return pages
        for h in hashes:
            page = self._page_of.get(h)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            self._evictable.pop(page, None)
            self._refs[page] = self._refs.get(page, 0) + 1
        return pages

    def cache(self, page: int, block_hash: bytes) -> None:
        """`page` (held) now holds the full block of `block_hash`; a block cached already keeps its page."""
        if not self.enable_prefix_caching or block_hash in self._page_of or page in self._hash_of:
            return
        if page not in self._refs:
            raise ValueError(f"page {page} is not in use")
        self._page_of[block_hash] = page
        self._hash_of[page] = block_hash

    def check_invariants(self, holds: collections.Counter) -> None:
        """Every page is free, evictable or held exactly as often as `holds` (page -> holders) says, never two;
        each cached page holds one hash."""
        assert dict(holds) == self._refs, (dict(holds), self._refs)
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free) and not free & evictable and not free & set(self._refs)
        assert not evictable & set(self._refs) and evictable <= set(self._hash_of)
        assert len(free) + len(evictable) + len(self._refs) == self.num_pages
        assert {p: h for h, p in self._page_of.items()} == self._hash_of


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

    def __getitem__(self, index: int) -> int:
        if not -self._size <= index < self._size:
            raise IndexError(index)
        return int(self._ids[index % self._size])

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
