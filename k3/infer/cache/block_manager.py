"""Reference-counted pool of fixed-size MLA pages and the pool of KDA state slots (pure Python).

A page holds `page_size` consecutive tokens' latents for every MLA layer (the tensors live in the model
runner; here only ids and counts). Holders are running sequences (their block tables) and prefix-cache
entries; a page is free when no one holds it. A sequence may write into a page only while it is the sole
holder: `writable_page` says when the scheduler must copy first (copy-on-write).
"""

from collections import deque


class PagePool:
    """Free list + reference counts over page ids 0..num_pages-1."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self.refcount = [0] * num_pages
        self._free = deque(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        """A fresh page with refcount 1, or None when none is free."""
        if not self._free:
            return None
        page = self._free.popleft()
        self.refcount[page] = 1
        return page

    def incref(self, page: int) -> None:
        if self.refcount[page] <= 0:
            raise ValueError(f"page {page} is free; cannot share it")
        self.refcount[page] += 1

    def decref(self, page: int) -> bool:
        """Drop one holder; True when the page became free."""
        if self.refcount[page] <= 0:
            raise ValueError(f"page {page} is already free")
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            self._free.append(page)
            return True
        return False

    def shared(self, page: int) -> bool:
        return self.refcount[page] > 1


class SlotPool:
    """KDA state slots: one per running sequence (recurrent + conv state of every KDA layer)."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        if slot in self._free:
            raise ValueError(f"slot {slot} is already free")
        self._free.append(slot)
