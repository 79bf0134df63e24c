"""Exact hybrid prefix cache: chain-hashed token blocks -> shared MLA pages + KDA state snapshots.

Hashing: the prompt is cut into match units of `unit` tokens (64 by default); unit i is identified by
h_i = H(h_{i-1}, tokens of unit i) with h_0 = H(salt), so a hash names the whole prefix up to it and a
per-tenant salt (the API key) makes tenants' chains disjoint (no sharing, no probing).

Two kinds of entries under the same hashes:
* MLA: h_i -> the page holding unit i's latents (the entry holds a page reference; pages are shared
  copy-on-write, `block_manager`). Registered for every completed unit.
* KDA: h_i -> a snapshot of every KDA layer's recurrent + conv state after exactly (i+1)*unit tokens
  (the invariant that keeps restored states exact). Registered only where turns resume: prefill chunk
  ends, the last aligned position before the final prompt token, and request finish.

A hit needs both: the hit length is the deepest snapshot whose whole MLA chain is present. Snapshots live
in a byte budget with LRU eviction and a cap per path (the chain of one sequence): when a path holds more
than `per_path_cap` snapshots the shallowest go first, so the deepest (most reusable) ones survive.
This module is pure Python; snapshot handles are opaque objects owned by the model runner.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from k3.infer.cache.block_manager import PagePool


def chain_hashes(
    tokens: list[int], unit: int, salt: str, n_units: int | None = None, start=None, media=()
) -> list[int]:
    """Hashes of the first `n_units` full units of `tokens` (all full units by default). `start` =
    (hashes so far) continues an existing chain. `media` (`k3.infer.media.MediaSpan`s: .start, .stop,
    .key) adds the content key of every span overlapping a unit to that unit's hash."""
    hashes = list(start or [])
    n_units = len(tokens) // unit if n_units is None else n_units
    prev = hashes[-1] if hashes else _h(b"k3-prefix-v1", salt.encode())
    for i in range(len(hashes), n_units):
        block = tokens[i * unit : (i + 1) * unit]
        parts = [prev.to_bytes(16, "little"), b"".join(t.to_bytes(4, "little") for t in block)]
        lo, hi = i * unit, (i + 1) * unit
        keys = [f"{s.start}:{s.stop}:{s.key}" for s in media if s.start < hi and s.stop > lo]
        if keys:
            parts.append(("media|" + "|".join(keys)).encode())
        prev = _h(*parts)
        hashes.append(prev)
    return hashes


def _h(*parts: bytes) -> int:
    d = hashlib.blake2b(digest_size=16)
    for p in parts:
        d.update(len(p).to_bytes(8, "little"))
        d.update(p)
    return int.from_bytes(d.digest(), "little")


@dataclass
class Snapshot:
    length: int  # tokens the state has consumed
    handle: object  # the runner's copy of the KDA states
    nbytes: int


@dataclass
class Hit:
    length: int  # tokens served from the cache (a multiple of unit)
    pages: list[int]  # block-table prefix to share (refs already taken for the caller)
    snapshot: object | None  # handle to restore into the slot
    mla_depth: int = 0  # tokens the MLA chain alone covers (>= length): a junction worth a snapshot


class PrefixCache:
    def __init__(self, pages: PagePool, unit: int, page_size: int, budget_bytes: int, per_path_cap: int = 4):
        if unit < 1 or page_size % unit:
            raise ValueError(f"page_size ({page_size}) must be a multiple of unit ({unit})")
        if per_path_cap < 1:
            raise ValueError(f"per_path_cap must be >= 1, got {per_path_cap}")
        self.pool, self.unit, self.page_size = pages, unit, page_size
        self.budget_bytes, self.per_path_cap = budget_bytes, per_path_cap
        self.mla: OrderedDict[int, int] = OrderedDict()  # hash -> page (LRU order, oldest first)
        self.snaps: OrderedDict[int, Snapshot] = OrderedDict()
        self.snapshot_bytes = 0
        self.queried_tokens = self.hit_tokens = 0  # counted by the scheduler on admission
        self.evicted_pages = self.evicted_snapshots = 0

    # ---- lookup -------------------------------------------------------------------------------------
    def lookup(self, hashes: list[int], num_tokens: int) -> Hit:
        """Longest exact hit for a prompt of `num_tokens` whose unit hashes are `hashes` (only units that
        leave at least one token to compute). Takes page references for the caller."""
        depth = 0
        while depth < len(hashes) and hashes[depth] in self.mla:
            depth += 1
        j = depth
        while j > 0 and hashes[j - 1] not in self.snaps:
            j -= 1
        if j == 0:
            return Hit(0, [], None, depth * self.unit)
        units_per_page = self.page_size // self.unit
        pages = []
        for i in range(j):  # the last hit unit in each page names the page valid for all its units
            self.mla.move_to_end(hashes[i])
            if i % units_per_page == units_per_page - 1 or i == j - 1:
                pages.append(self.mla[hashes[i]])
        for p in pages:
            self.pool.incref(p)
        self.snaps.move_to_end(hashes[j - 1])
        return Hit(j * self.unit, pages, self.snaps[hashes[j - 1]].handle, depth * self.unit)

    # ---- registration -------------------------------------------------------------------------------
    def add_page(self, h: int, page: int) -> None:
        """Unit with hash h is complete in `page`."""
        if h in self.mla:
            self.mla.move_to_end(h)
            return
        self.pool.incref(page)
        self.mla[h] = page

    def add_snapshot(self, path: list[int], length: int, handle: object, nbytes: int) -> None:
        """Snapshot after exactly `length` tokens (a multiple of unit) on the chain `path` (its hashes)."""
        if length % self.unit or length // self.unit > len(path) or length == 0:
            raise ValueError(f"snapshot length {length} is not an aligned position on a chain of {len(path)}")
        h = path[length // self.unit - 1]
        if h in self.snaps:
            self.snaps.move_to_end(h)
            return
        self.snaps[h] = Snapshot(length, handle, nbytes)
        self.snapshot_bytes += nbytes
        on_path = [x for x in path[: length // self.unit] if x in self.snaps]
        for x in on_path[: max(0, len(on_path) - self.per_path_cap)]:  # shallowest first
            self._drop_snapshot(x)
        while self.snapshot_bytes > self.budget_bytes and self.snaps:
            self._drop_snapshot(next(iter(self.snaps)))

    # ---- eviction -----------------------------------------------------------------------------------
    def _drop_snapshot(self, h: int) -> None:
        self.snapshot_bytes -= self.snaps.pop(h).nbytes
        self.evicted_snapshots += 1

    def evict_page(self) -> bool:
        """Free one page by dropping LRU MLA entries (those no sequence uses first). False if none."""
        for h, page in self.mla.items():
            if self.pool.refcount[page] == 1:
                self._drop_mla(h)
                self.evicted_pages += 1
                return True
        while self.mla:
            if self._drop_mla(next(iter(self.mla))):
                self.evicted_pages += 1
                return True
        return False

    def _drop_mla(self, h: int) -> bool:
        page = self.mla.pop(h)
        if h in self.snaps:  # its chain is broken: the snapshot can no longer be hit
            self._drop_snapshot(h)
        return self.pool.decref(page)

    def clear(self) -> None:
        while self.mla:
            self._drop_mla(next(iter(self.mla)))
        self.snaps.clear()
        self.snapshot_bytes = 0
