"""Seeds and epoch permutations that are pure functions of their inputs, in O(1) memory.

A corpus of 10M records cannot afford an 80 MB permutation array per rank and per epoch, and a
resumed run at another world size must see the same order: so the order is computed, not stored.

- :func:`derive_seed` mixes integers (seed, epoch, sample index, ...) into a 63-bit seed with the
  splitmix64 finaliser, so nearby inputs give unrelated seeds.
- :class:`EpochPermutation` is a bijection of ``[0, n)`` keyed by a seed: a balanced Feistel
  network of 4 rounds on ``2h``-bit integers (``4^h >= n``) with cycle walking (an output ``>= n``
  is encrypted again until it falls in ``[0, n)``; this restricts a permutation of ``[0, 4^h)`` to
  one of ``[0, n)``, with fewer than 4 rounds of walking on average since ``4^h < 4n``).
  ``perm(i)`` for any ``i`` costs a few dozen integer operations; no table is built.
"""

from __future__ import annotations

import numpy as np

from moetrain.validation import require_int

MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
ROUNDS = 4


def mix64(value: int) -> int:
    """The splitmix64 finaliser of ``value mod 2^64`` (a bijection of 64-bit integers)."""
    x = value & MASK64
    x = ((x ^ (x >> 30)) * _M1) & MASK64
    x = ((x ^ (x >> 27)) * _M2) & MASK64
    return x ^ (x >> 31)


def derive_seed(*parts: int) -> int:
    """A seed in ``[0, 2^63)`` from integers: ``h = mix64(h + GOLDEN + part)`` over the parts, so
    ``derive_seed(s, e, i)`` differs from ``derive_seed(s, e, i + 1)`` and ``derive_seed(s, e + 1, i)``
    in about half of its bits."""
    h = 0x243F6A8885A308D3
    for part in parts:
        h = mix64(h + _GOLDEN + (part & MASK64))
    return h >> 1


def _mix64_array(x_N: np.ndarray) -> np.ndarray:
    """:func:`mix64` of a ``uint64`` array (numpy wraps array products modulo 2^64)."""
    x_N = (x_N ^ (x_N >> np.uint64(30))) * np.uint64(_M1)
    x_N = (x_N ^ (x_N >> np.uint64(27))) * np.uint64(_M2)
    return x_N ^ (x_N >> np.uint64(31))


class EpochPermutation:
    """A pseudo-random bijection of ``[0, n)`` determined by ``(n, key)``; see the module docstring.

    ``perm(indices)`` maps an int array (or an int) to the permuted positions (same shape)."""

    def __init__(self, n: int, key: int):
        require_int("n", n, 1, note="(elements to permute)")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half_bits = (bits + 1) // 2
        self._mask = np.uint64((1 << self.half_bits) - 1)
        self._keys = [np.uint64(derive_seed(key, r)) for r in range(ROUNDS)]

    def _encrypt(self, x_N: np.ndarray) -> np.ndarray:
        h = np.uint64(self.half_bits)
        left, right = x_N >> h, x_N & self._mask
        for key in self._keys:
            left, right = right, left ^ (_mix64_array(right ^ key) & self._mask)
        return (left << h) | right

    def __call__(self, indices):
        scalar = np.ndim(indices) == 0
        x_N = np.array(indices, dtype=np.int64, ndmin=1)
        if x_N.size and (x_N.min() < 0 or x_N.max() >= self.n):
            raise IndexError(f"permutation of {self.n} elements indexed with values outside [0, {self.n})")
        x_N = x_N.astype(np.uint64)
        n = np.uint64(self.n)
        x_N = self._encrypt(x_N)
        outside = x_N >= n
        while outside.any():  # cycle walking: at most a few rounds, fewer than 4 on average
            x_N[outside] = self._encrypt(x_N[outside])
            outside = x_N >= n
        result = x_N.astype(np.int64)
        return int(result[0]) if scalar else result
