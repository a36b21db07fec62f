"""A set of 64-bit keys in one numpy array (open addressing): about 16 bytes per key at the
0.5 load factor it keeps, where a Python set of strings costs ~100 bytes per key. Torch-free."""

from __future__ import annotations

import hashlib

import numpy as np

_EMPTY = 0  # a key of 0 is stored as 1 (one more collision in 2**64)


def digest64(data: bytes) -> int:
    """A stable 64-bit digest (BLAKE2b), as a signed int64: the same in every process."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


class Int64Set:
    """Insert-only set of int64 keys (e.g. digest64 of a custom_id)."""

    def __init__(self, initial_capacity: int = 1024) -> None:
        capacity = 1 << max(4, (initial_capacity - 1).bit_length())
        self._slots = np.zeros(capacity, dtype=np.int64)
        self._num_keys = 0

    def add(self, key: int) -> bool:
        """Insert key; False if it was already there."""
        key = key or 1
        slot = self._find(self._slots, key)
        if int(self._slots[slot]) == key:
            return False
        self._slots[slot] = key
        self._num_keys += 1
        if 2 * self._num_keys > self._slots.size:
            self._grow()
        return True

    @staticmethod
    def _find(slots: np.ndarray, key: int) -> int:
        mask = slots.size - 1
        slot = (key ^ (key >> 29)) & mask
        while True:
            value = int(slots[slot])
            if value == _EMPTY or value == key:
                return slot
            slot = (slot + 1) & mask

    def _grow(self) -> None:
        old = self._slots[self._slots != _EMPTY]
        self._slots = np.zeros(2 * self._slots.size, dtype=np.int64)
        for key in old.tolist():
            self._slots[self._find(self._slots, key)] = key
