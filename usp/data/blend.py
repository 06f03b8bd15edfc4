"""A weighted blend of token files: which corpus each global sample comes from.

The samples are dealt in blocks of ``BLOCK``: corpus j gets ``quota_j`` slots of every
block (its weight's share, rounded by largest remainder so the quotas fill the block), in
an interleave that spreads each corpus evenly over the block (the slot goes to the corpus
furthest behind its share). Sample c is slot ``c mod BLOCK`` of block ``c // BLOCK``, so
its corpus and its ordinal inside that corpus (how many of the corpus's samples came
before it) follow from c alone: a blend resumes from a count of samples exactly as one
file does, and each corpus then reads its ordinals in its own epochs
(``usp.data.order``).
"""

from __future__ import annotations

import numpy as np
import torch

from .packing import Batch

BLOCK = 4096


def quotas(weights, block: int = BLOCK) -> np.ndarray:
    """Slots per block of each corpus: ``block`` x its share, by largest remainder."""
    w = np.asarray(weights, dtype=np.float64)
    share = w / w.sum() * block
    q = np.floor(share).astype(np.int64)
    short = block - int(q.sum())
    order = np.argsort(-(share - q), kind="stable")  # largest remainders first, ties by index
    q[order[:short]] += 1
    return q


class BlendOrder:
    """The corpus and ordinal of each global sample for the blend ``weights``."""

    def __init__(self, weights, block: int = BLOCK):
        self.block = block
        self.quota = quotas(weights, block)
        if (self.quota == 0).any():
            j = int(np.flatnonzero(self.quota == 0)[0])
            raise ValueError(f"data.blend weight {weights[j]} of source {j} is under one sample "
                             f"in {block} (weights {list(weights)}); raise it or drop the source")
        pattern = np.empty(block, dtype=np.int64)
        taken = np.zeros(len(self.quota), dtype=np.int64)
        for t in range(block):  # the corpus furthest behind its share takes the slot
            j = int(np.argmax(self.quota * (t + 1) / block - taken))
            pattern[t] = j
            taken[j] += 1
        self.pattern = pattern
        # rank[t]: earlier slots of the same corpus in the block
        self.rank = np.empty(block, dtype=np.int64)
        for j in range(len(self.quota)):
            slots = np.flatnonzero(pattern == j)
            self.rank[slots] = np.arange(slots.size)

    def lookup(self, samples) -> tuple[np.ndarray, np.ndarray]:
        """(corpus [n], ordinal within that corpus [n]) of global samples ``samples``."""
        block, slot = np.divmod(np.asarray(samples, dtype=np.int64), self.block)
        corpus = self.pattern[slot]
        return corpus, block * self.quota[corpus] + self.rank[slot]

    def counts(self, consumed: int) -> np.ndarray:
        """Samples each corpus has given after ``consumed`` global samples."""
        block, slot = divmod(consumed, self.block)
        return block * self.quota + np.bincount(self.pattern[:slot],
                                                minlength=len(self.quota))


class Blend:
    """Token files blended by weight, read like one: ``rows(samples, positions, packed)``.

    ``sources``: ``MemmapTokens`` of the same vocabulary; ``names``: how the metrics call
    each (``epoch/<name>``)."""

    def __init__(self, sources: list, weights, names: list[str]):
        self.sources, self.names = sources, names
        self.weights = np.asarray(weights, dtype=np.float64) / np.sum(weights)
        self.order = BlendOrder(weights)
        self.vocab_size = max(s.vocab_size for s in sources)

    def rows(self, samples, positions: torch.Tensor | None = None,
             packed: bool = False) -> Batch:
        """Each sample from its corpus (``BlendOrder``), in the order of ``samples``;
        ``positions`` [n] for every row, or [B, n] each row its own."""
        corpus, ordinal = self.order.lookup(samples)
        parts, where = [], []
        for j in np.unique(corpus):
            sel = np.flatnonzero(corpus == j)
            cols = positions if positions is None or positions.dim() == 1 else \
                positions[torch.from_numpy(sel).to(positions.device)]  # [B, n] -> its rows
            parts.append(self.sources[j].rows(ordinal[sel], cols, packed))
            where.append(sel)
        back = torch.from_numpy(np.argsort(np.concatenate(where), kind="stable"))
        fields = {}
        for name in ("tokens", "labels", "segment_ids", "doc_positions", "weights"):
            got = [getattr(p, name) for p in parts]
            fields[name] = None if got[0] is None else torch.cat(got)[back]
        return Batch(**fields)

    def doc_lengths(self, samples) -> list[tuple[int, ...]]:
        """Each sample's document lengths, from its corpus, in the order of ``samples``."""
        corpus, ordinal = self.order.lookup(samples)
        return [self.sources[j].doc_lengths([o])[0] for j, o in zip(corpus, ordinal)]

    def epochs(self, consumed: int) -> dict[str, float]:
        """Epochs each corpus has completed after ``consumed`` global samples."""
        counts = self.order.counts(consumed)
        return {name: float(n) / s.num_windows
                for name, n, s in zip(self.names, counts, self.sources)}
