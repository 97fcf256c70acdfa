"""Page ids: who holds each page of a pool.

Decided here: a page pool is a fixed range of page ids, handed out whole
from a free list and returned whole. Every page is, at every moment, free,
held by exactly one request, or owned by the prefix cache; the allocator
records the owner of each page so :meth:`PageAllocator.check_integrity` can
prove it, and so a double free or a free by the wrong owner is an error at
the moment it happens rather than a corrupted KV cache later.

Why ids and not tensors: the arithmetic of who may use which page is the
part that has to be right, and it runs here without torch. The engine maps
ids to slices of its KV tensors.

Deliberately not here: eviction policy (``radix.py``) and admission
(``admission.py``). Allocation never evicts on its own; the caller decides
what to evict and frees it first.
"""

from __future__ import annotations

from typing import Iterable

#: Owner id of pages that belong to the prefix cache rather than a request.
CACHE_OWNER = -1
_FREE = -2


class OutOfPages(RuntimeError):
    """More pages were asked for than are free. With correct admission this
    never happens to an admitted request; seeing it is a scheduler bug."""


class PageAllocator:
    """A free list of page ids ``0 .. num_pages-1`` with per-page owners.

    Pages are handed out last-freed-first, so a busy replica keeps reusing a
    warm subset of its pool.
    """

    __slots__ = ("_num_pages", "_free", "_owner")

    def __init__(self, num_pages: int) -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self._num_pages = num_pages
        # Reversed so that the first pages handed out are 0, 1, 2, ...
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._owner: list[int] = [_FREE] * num_pages

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def owner(self, page: int) -> int | None:
        """The owner of ``page``: a request uid, :data:`CACHE_OWNER`, or ``None`` when free."""
        owner = self._owner[page]
        return None if owner == _FREE else owner

    def allocate(self, count: int, owner: int) -> list[int]:
        """Take ``count`` pages for ``owner``. Raises :class:`OutOfPages` if fewer are free."""
        if count < 0:
            raise ValueError(f"cannot allocate {count} pages")
        if count > len(self._free):
            raise OutOfPages(f"asked for {count} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(count)]
        for page in pages:
            self._owner[page] = owner
        return pages

    def free(self, pages: Iterable[int], owner: int) -> None:
        """Return ``pages`` held by ``owner``. Raises ``ValueError``, freeing
        none of them, if any is free already, held by someone else, or named
        twice (which would put it on the free list twice)."""
        pages = list(pages)
        for page in pages:
            held_by = self._owner[page]
            if held_by != owner:
                state = "free" if held_by == _FREE else f"held by {held_by}"
                raise ValueError(f"page {page} freed by {owner} but it is {state}")
        if len(set(pages)) != len(pages):
            raise ValueError(f"a page is named twice in one free by {owner}: {sorted(pages)[:16]}")
        for page in pages:
            self._owner[page] = _FREE
            self._free.append(page)

    def transfer(self, pages: Iterable[int], from_owner: int, to_owner: int) -> None:
        """Hand ``pages`` from one owner to another (a request's full pages to the cache)."""
        pages = list(pages)
        for page in pages:
            if self._owner[page] != from_owner:
                raise ValueError(f"page {page} is not held by {from_owner}")
        for page in pages:
            self._owner[page] = to_owner

    def pages_of(self, owner: int) -> list[int]:
        return [page for page, held_by in enumerate(self._owner) if held_by == owner]

    def check_integrity(self, expected: dict[int, Iterable[int]] | None = None) -> None:
        """Raise ``AssertionError`` unless every page is free or held by exactly one owner.

        ``expected`` maps each owner to the pages it believes it holds; when
        given, the allocator's records must match it exactly (and the free
        list must hold exactly the remaining pages, each once).
        """
        free = self._free
        if len(set(free)) != len(free):
            raise AssertionError("a page is on the free list twice")
        for page in free:
            if self._owner[page] != _FREE:
                raise AssertionError(f"page {page} is on the free list but held by {self._owner[page]}")
        held = sum(1 for owner in self._owner if owner != _FREE)
        if held + len(free) != self._num_pages:
            raise AssertionError(
                f"{held} held + {len(free)} free != {self._num_pages} pages: a page is lost"
            )
        if expected is not None:
            seen: dict[int, int] = {}
            for owner, pages in expected.items():
                for page in pages:
                    if page in seen:
                        raise AssertionError(f"page {page} is claimed by {seen[page]} and {owner}")
                    seen[page] = owner
                    if self._owner[page] != owner:
                        raise AssertionError(
                            f"page {page} is claimed by {owner} but recorded as {self.owner(page)}"
                        )
            if len(seen) != held:
                unclaimed = [
                    p for p, o in enumerate(self._owner) if o != _FREE and p not in seen
                ]
                raise AssertionError(f"pages held but claimed by nobody: {unclaimed[:16]}")
