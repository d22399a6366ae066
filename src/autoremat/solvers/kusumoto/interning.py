"""Dense ids for the states of ``dp-exact``'s searches (:mod:`.exact`, :mod:`.dive`, :mod:`.labels`).

A state is a lower set and its *dangling roots* (a bitset over the nodes, arbitrary width).
:class:`Interner` numbers dangling sets and states, one at a time (from Python ints) and many at
a time (from the rows of packed bits that :class:`~autoremat.cost.batch_pricing.BatchPricer`
returns); :class:`Ids` maps 64-bit keys to dense ids with sorted arrays.
"""

from __future__ import annotations

import numpy as np

__all__ = ["Ids", "Interner"]


class Ids:
    """Dense ids for 64-bit keys, looked up and added many at a time (a sorted key array)."""

    def __init__(self) -> None:
        self.keys = np.zeros(0, dtype=np.uint64)
        self.ids = np.zeros(0, dtype=np.int64)
        self.count = 0

    def get(self, keys: np.ndarray) -> np.ndarray:
        """The id of each key (-1 where it has none)."""
        if not len(self.keys):
            return np.full(len(keys), -1, dtype=np.int64)
        at = np.minimum(np.searchsorted(self.keys, keys), len(self.keys) - 1)
        return np.where(self.keys[at] == keys, self.ids[at], -1)

    def add(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The id of each key, new keys numbered in order of value: ``(ids, new keys, their ids)``."""
        ids = self.get(keys)
        missing = ids < 0
        if not missing.any():
            return ids, keys[:0], ids[:0]
        new, inverse = np.unique(keys[missing], return_inverse=True)
        new_ids = self.count + np.arange(len(new), dtype=np.int64)
        ids[missing] = new_ids[inverse.ravel()]
        self.put(new, new_ids)
        return ids, new, new_ids

    def put(self, keys: np.ndarray, ids: np.ndarray) -> None:
        """Record ``keys -> ids`` (keys absent so far, sorted; ids from :attr:`count` on)."""
        at = np.searchsorted(self.keys, keys)
        self.keys = np.insert(self.keys, at, keys)
        self.ids = np.insert(self.ids, at, ids)
        self.count = max(self.count, int(ids.max()) + 1) if len(ids) else self.count


class Interner:
    """Indices of dangling sets and of states ``(set, dangling set)`` for dp-exact's searches,
    both from Python ints (one at a time) and from rows of packed bits (many at a time).

    A row of packed bits is found by a 64-bit hash of its words, then checked word for word
    against the set the hash points to; a row whose hash belongs to another set (a collision)
    is interned by its exact value in :attr:`index`, like the one-at-a-time path. A state is
    the key ``set << 32 | dangling index`` (exact).
    """

    def __init__(self, words: int, seed: int = 0x5DEECE66D) -> None:
        self.words = words
        rng = np.random.default_rng(seed)
        self.mult = rng.integers(1, 2**63, size=words, dtype=np.uint64) | np.uint64(1)
        self.sets: list[int] = []  # dangling index -> set
        self.index: dict[int, int] = {}  # set -> dangling index
        self.rows = np.zeros((0, words), dtype=np.uint64)  # dangling index -> words
        self.hashed = Ids()
        self.states = Ids()
        self.state_set = np.zeros(0, dtype=np.int64)  # state id -> set index
        self.state_dang = np.zeros(0, dtype=np.int64)  # state id -> dangling index

    def _hash(self, rows: np.ndarray) -> np.ndarray:
        return (rows * self.mult).sum(axis=1, dtype=np.uint64)

    def _new(self, masks: list[int], rows: np.ndarray) -> list[int]:
        start = len(self.sets)
        for k, mask in enumerate(masks):
            self.index[mask] = start + k
        self.sets.extend(masks)
        self.rows = np.concatenate([self.rows, rows])
        return list(range(start, start + len(masks)))

    def dangling(self, mask: int) -> int:
        """The index of the dangling set ``mask`` (added when new)."""
        k = self.index.get(mask)
        if k is None:
            row = np.frombuffer(mask.to_bytes(8 * self.words, "little"), dtype="<u8").astype(np.uint64)[None]
            k = self._new([mask], row)[0]
            h = self._hash(row)
            if self.hashed.get(h)[0] < 0:  # else a collision: found through index
                self.hashed.put(h, np.array([k]))
        return k

    def dangling_rows(self, packed: np.ndarray) -> np.ndarray:
        """The index of each row of packed bits (rows of :meth:`BatchPricer.price`)."""
        rows = np.ascontiguousarray(packed).view(np.uint64)
        hashes = self._hash(rows)
        ks = self.hashed.get(hashes)
        missing = ks < 0
        if missing.any():
            new, first, inverse = np.unique(hashes[missing], return_index=True, return_inverse=True)
            fresh_rows = rows[np.flatnonzero(missing)[first]]
            masks = [int.from_bytes(r.tobytes(), "little") for r in fresh_rows]
            known = [self.index.get(m) for m in masks]  # added one at a time, hash taken
            ids = np.array([k if k is not None else -1 for k in known], dtype=np.int64)
            add = ids < 0
            if add.any():
                ids[add] = self._new([m for m, k in zip(masks, known) if k is None], fresh_rows[add])
                self.hashed.put(new[add], ids[add])
            ks[missing] = ids[inverse.ravel()]
        wrong = np.flatnonzero((self.rows[ks] != rows).any(axis=1))
        for at in wrong.tolist():  # hash collisions: by exact value
            ks[at] = self.dangling(int.from_bytes(rows[at].tobytes(), "little"))
        return ks

    def state_ids(self, sets: np.ndarray, dangs: np.ndarray) -> np.ndarray:
        """The id of each state ``(sets[k], dangs[k])`` (added when new)."""
        keys = (sets.astype(np.uint64) << np.uint64(32)) | dangs.astype(np.uint64)
        ids, new, new_ids = self.states.add(keys)
        if len(new):
            size = self.states.count
            self.state_set = np.resize(self.state_set, size)
            self.state_dang = np.resize(self.state_dang, size)
            self.state_set[new_ids] = (new >> np.uint64(32)).astype(np.int64)
            self.state_dang[new_ids] = (new & np.uint64(0xFFFFFFFF)).astype(np.int64)
        return ids
