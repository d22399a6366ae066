"""``autoremat.solvers.kusumoto.interning``: one index per dangling set and per state."""

from __future__ import annotations

import random

import numpy as np

from autoremat.solvers.kusumoto.interning import Ids, Interner


def packed(masks: list[int], width: int) -> np.ndarray:
    return np.frombuffer(b"".join(m.to_bytes(width, "little") for m in masks), dtype=np.uint8).reshape(len(masks), width)


def test_interner_gives_each_set_one_index_from_ints_and_from_rows():
    rng = random.Random(5)
    ix = Interner(words=3)
    masks = [rng.getrandbits(170) for _ in range(60)] + [0]
    rows = packed(masks, 24)
    ks = ix.dangling_rows(rows[:30])
    assert [ix.sets[k] for k in ks.tolist()] == masks[:30]
    for m in masks[20:45]:  # one at a time: the same indices for the rows seen
        ix.dangling(m)
    again = ix.dangling_rows(rows)
    assert [ix.sets[k] for k in again.tolist()] == masks
    assert again[:30].tolist() == ks.tolist() and len(set(again.tolist())) == len(set(masks))
    states = ix.state_ids(np.array([3, 5, 3, 3]), np.array([1, 1, 1, 2]))
    assert states[0] == states[2] and len(set(states.tolist())) == 3
    assert ix.state_set[states].tolist() == [3, 5, 3, 3] and ix.state_dang[states].tolist() == [1, 1, 1, 2]


def test_hash_collisions_fall_back_to_exact_values():
    """With every row hashing alike, each dangling set still gets its own index."""
    ix = Interner(words=2)
    ix.mult = np.zeros(2, dtype=np.uint64)
    masks = [0b1011, 1 << 100, 0, 0b1011 | 1 << 70]
    rows = packed(masks, 16)
    assert [ix.sets[k] for k in ix.dangling_rows(rows).tolist()] == masks
    assert ix.dangling(1 << 100) == ix.dangling_rows(rows[1:2])[0]


def test_ids_number_new_keys_in_order_of_value():
    ids = Ids()
    got, new, new_ids = ids.add(np.array([9, 3, 9, 5], dtype=np.uint64))
    assert new.tolist() == [3, 5, 9] and new_ids.tolist() == [0, 1, 2]
    assert got.tolist() == [2, 0, 2, 1]
    assert ids.get(np.array([5, 4], dtype=np.uint64)).tolist() == [1, -1]
    got, new, _ = ids.add(np.array([4, 3], dtype=np.uint64))
    assert got.tolist() == [3, 0] and new.tolist() == [4] and ids.count == 4
