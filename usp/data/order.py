"""The order in which training reads a token file: epochs of its windows, without replacement.

A token file of N tokens holds ``W = (N - 1) // seq_len`` windows: window w is the tokens
``[w * seq_len, (w + 1) * seq_len)`` read with the token after each (the labels), the
remainder dropped. An epoch visits every window once, in a permutation fixed by
``(seed, epoch)``; the run's position is the number of windows consumed so far, ``c``, and
global sample ``c`` is window ``permutation_e(c mod W)`` of epoch ``e = c // W``. Nothing
depends on how many ranks read the samples or in what micro-batches, so a run resumed
from a checkpoint continues at the same ``c`` under any dp and any accumulation.

Length phases (``trainer.phases``): each phase cuts the file into windows of its own
``seq_len`` and makes its own passes over them, its count ``c`` starting at 0, in the
order ``(seed, phase, epoch)`` fixes. Phase 0's order is the order of a run without
phases; a later phase's permutations are keyed by its index too.

The permutation is a keyed Feistel network over the next power of four, with cycle
walking down to ``[0, W)``: O(1) memory for any W, and vectorised over a batch of ids.
"""

from __future__ import annotations

import numpy as np

_ROUNDS = 4
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijective scramble of uint64s (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def _round_keys(seed: int, epoch: int, phase: int) -> np.ndarray:
    # phase 0 keeps the key of a run without phases (its order must not change)
    key = [seed & 0xFFFFFFFF, seed >> 32, epoch] + ([phase] if phase else [])
    return np.random.SeedSequence(key).generate_state(_ROUNDS, dtype=np.uint64)


def permute(index: np.ndarray, n: int, seed: int, epoch: int, phase: int = 0) -> np.ndarray:
    """The permutation of ``[0, n)`` fixed by ``(seed, phase, epoch)``, applied to ``index``
    (each in ``[0, n)``): a bijection, so an epoch visits every element once."""
    index = np.asarray(index, dtype=np.uint64)
    if n <= 1:
        return index.astype(np.int64)
    half = max(1, (int(n - 1).bit_length() + 1) // 2)  # 4**half >= n
    mask = np.uint64((1 << half) - 1)
    keys = _round_keys(seed, epoch, phase)
    with np.errstate(over="ignore"):
        out = index.copy()
        todo = np.ones(out.shape, dtype=bool)
        while todo.any():  # cycle walking: at most a few rounds, 4**half < 4n
            x = out[todo]
            left, right = x >> np.uint64(half), x & mask
            for k in keys:
                left, right = right, left ^ (_mix(right ^ k) & mask)
            x = (left << np.uint64(half)) | right
            out[todo] = x
            todo = out >= np.uint64(n)
    return out.astype(np.int64)


class WindowOrder:
    """Epochs of ``num_windows`` windows in the order ``(seed, phase, epoch)`` fixes.

    ``lookup(samples)`` -> (epoch [n], window [n]) for the phase's sample ids (windows it
    consumed before them), int64."""

    def __init__(self, num_windows: int, seed: int, phase: int = 0):
        if num_windows < 1:
            raise ValueError(f"num_windows={num_windows}: a token file needs at least one "
                             "window of seq_len + 1 tokens")
        self.num_windows, self.seed, self.phase = num_windows, seed, phase

    def lookup(self, samples) -> tuple[np.ndarray, np.ndarray]:
        samples = np.asarray(samples, dtype=np.int64)
        epoch, within = np.divmod(samples, self.num_windows)
        window = np.empty_like(samples)
        for e in np.unique(epoch):  # a batch spans one epoch, two at a boundary
            sel = epoch == e
            window[sel] = permute(within[sel], self.num_windows, self.seed, int(e), self.phase)
        return epoch, window

    def epochs(self, consumed: int) -> float:
        """Epochs completed after ``consumed`` samples (fractional)."""
        return consumed / self.num_windows
