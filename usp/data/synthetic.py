"""Long-range associative recall: a task only attention across the whole sequence solves.

Vocabulary (ids in this order; K keys, V values)::

    0                 BOS
    1                 SEP           marks the start of the query section
    [2, 2+V)          value tokens  val(v)
    [.., +K)          query tokens  q(k)
    [.., +K*V)        pair tokens   pair(k, v): one token carrying key k and value v
    [.., vocab_size)  filler tokens (at least one)

A sequence of length L (positions)::

    0                 BOS
    [1, L/4)          random filler
    [L/4, L/2)        the "dictionary": n_pairs pairs with distinct keys and random values,
                      each at least once, in random slots; a fraction ``pair_density`` of
                      the region holds pair tokens (repeats of the same pairs), the rest filler
    [L/2, L-2Q-1)     random filler
    [L-2Q-1, L)       SEP q(k1) val(v1) q(k2) val(v2) ...   (Q = n_queries distinct keys)

Only answers are scored: the label at the position of ``q(k)`` is ``val(v)`` for the pair
``pair(k, v)`` of this sequence; every other label is -100. One attention hop solves it
(the query token matches the pair tokens with its key by content and copies out the
value); nothing local does: the pairs sit at least ``L/2 - 2Q`` tokens back. With ring >= 2
and ``2Q+1 <= L/(2*ring)`` the dictionary and the queries are in different ring segments
for both the contiguous and the zigzag layout, so without the ring pass the accuracy is
chance. Repeating the pairs across the region (density 1 by default) keeps the fraction
of context that holds the right pair at ``1/(4*n_pairs)`` whatever L is; with each pair
only once (density 0) the signal shrinks like 1/L and training sits on a plateau.

Packed rows (``documents_per_row`` D > 1): the row holds D such documents back to back,
of random lengths of at least ``min_document_len``, each laid out as above within its own
span (BOS, dictionary in its second quarter, queries at its end). Neighbouring documents
use the same keys with different values, so a query that also attends to the previous
document's dictionary finds a wrong value for its key: the document mask
(``packed_batch``'s ``segment_ids``) is what makes the task clean.

Measured on CPU (2 layers, dim 128, 8/2 heads, vocab 256, AdamW lr 3e-3 with 20 warmup
steps, batch 8, n_pairs = n_queries = 8, K = V = 8, chance 12.5%): answer accuracy
94% after ~180 steps at L=512 and after 300 steps at L=1024. Batch 4 or n_pairs = 16
are much slower (56% / chance after 300 steps at L=1024).
"""

from __future__ import annotations

import numpy as np
import torch

from .indexing import step_indices
from .packing import IGNORE_INDEX, Batch, packed_rows

BOS, SEP = 0, 1
N_SPECIAL = 2


class RecallTask:
    """Batches of the recall task, identical whatever the dp split or SP layout.

    K (``n_keys``) defaults to ``n_pairs`` (every key appears, each sequence with new
    values); V (``n_values``) defaults to the largest value <= 8 that fits the vocabulary.
    Small K*V keeps the number of pair-token embeddings to learn small.
    ``documents_per_row`` > 1 packs that many recall documents of random lengths (each at
    least ``min_document_len``) into a row; the ``pair_lo``/``query_start`` attributes
    describe the one-document row. ``phase``: the length phase the samples are drawn for
    (keyed by it too; 0 for a run without phases). Raises ValueError, naming the numbers, when the
    vocabulary or the sequence is too small.
    """

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        n_pairs: int = 8,
        n_queries: int = 8,
        seed: int = 0,
        n_keys: int | None = None,
        n_values: int | None = None,
        pair_density: float = 1.0,
        documents_per_row: int = 1,
        phase: int = 0,
    ):
        K = n_pairs if n_keys is None else n_keys
        V = min(8, (vocab_size - N_SPECIAL - K - 1) // (K + 1)) if n_values is None else n_values
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.n_pairs, self.n_queries, self.n_keys, self.n_values = n_pairs, n_queries, K, V
        self.pair_density, self.documents_per_row = pair_density, documents_per_row
        # a length phase's samples: keyed by its index too (phase 0: a run without phases)
        self.key = [seed] if phase == 0 else [seed, phase]
        self.value_base = N_SPECIAL
        self.query_base = self.value_base + V
        self.pair_base = self.query_base + K
        self.filler_base = self.pair_base + K * V
        self.n_filler = vocab_size - self.filler_base
        if not 1 <= n_queries <= n_pairs <= K:
            raise ValueError(
                f"need 1 <= n_queries ({n_queries}) <= n_pairs ({n_pairs}) <= n_keys ({K})"
            )
        if V < 2 or self.n_filler < 1:
            raise ValueError(
                f"vocab_size {vocab_size} too small for the recall task: {N_SPECIAL} specials "
                f"+ V={V} values + K={K} queries + K*V={K * V} pair tokens + >= 1 filler "
                f"(and V >= 2) needs {N_SPECIAL + max(V, 2) * (K + 1) + K + 1}; raise "
                f"vocab_size or lower n_pairs/n_keys/n_values"
            )
        if not 0.0 <= pair_density <= 1.0:
            raise ValueError(f"pair_density must be in [0, 1], got {pair_density}")
        self.pair_lo, self.pair_hi = seq_len // 4, seq_len // 2  # the dictionary region
        if self.pair_hi - self.pair_lo < n_pairs:
            raise ValueError(
                f"{n_pairs} pairs do not fit in positions [{self.pair_lo}, {self.pair_hi}) of "
                f"seq_len {seq_len}; raise seq_len or lower n_pairs"
            )
        if 2 * n_queries + 1 > seq_len // 4:
            raise ValueError(
                f"query section (2*n_queries+1 = {2 * n_queries + 1} tokens) must fit in the "
                f"last quarter of seq_len {seq_len} ({seq_len // 4} tokens); raise seq_len "
                f"or lower n_queries"
            )
        need = documents_per_row * self.min_document_len
        if documents_per_row < 1 or need > seq_len:
            raise ValueError(
                f"documents_per_row={documents_per_row} documents of >= {self.min_document_len} "
                f"tokens (4 x max(2*n_queries+1, n_pairs)) need seq_len >= {need}, got "
                f"{seq_len}; raise seq_len or use documents_per_row <= "
                f"{max(1, seq_len // self.min_document_len)}"
            )
        self.query_start = seq_len - 2 * n_queries - 1  # position of SEP

    @property
    def min_document_len(self) -> int:
        """Shortest packed document: its dictionary quarter holds n_pairs, its last quarter
        the query section."""
        return 4 * max(2 * self.n_queries + 1, self.n_pairs)

    @property
    def min_distance(self) -> int:
        """Smallest gap in tokens between a query and any pair token: (L-2Q) - (L/2-1)."""
        return (self.query_start + 1) - (self.pair_hi - 1)

    @property
    def chance_accuracy(self) -> float:
        """Accuracy of guessing a value uniformly: 1 / n_values."""
        return 1.0 / self.n_values

    def _document_lengths(self, rng: np.random.Generator) -> np.ndarray:
        D, m = self.documents_per_row, self.min_document_len
        if D == 1:
            return np.array([self.seq_len])
        spare = self.seq_len - D * m  # tokens shared out at random on top of the minimum
        cuts = np.sort(rng.integers(0, spare + 1, size=D - 1))
        return m + np.diff(np.concatenate([[0], cuts, [spare]]))

    def _write_document(self, rng, tokens, labels, start: int, m: int,
                        prev: np.ndarray | None) -> np.ndarray:
        """One recall document in ``tokens[start:start+m]`` (labels likewise); returns its
        value per key (-1: key absent). ``prev``: the previous document's, whose keys get
        another value here."""
        V, P, Q = self.n_values, self.n_pairs, self.n_queries
        tokens[start] = BOS
        keys = rng.permutation(self.n_keys)[:P]  # distinct keys
        values = rng.integers(0, V, size=P)
        if prev is not None:  # a key the neighbour also holds gets a different value
            shared = prev[keys] >= 0
            values = np.where(shared, (prev[keys] + rng.integers(1, V, size=P)) % V, values)
        lo, hi = start + m // 4, start + m // 2  # the dictionary region
        n_slots = max(P, int(round(self.pair_density * (hi - lo))))
        slots = lo + rng.permutation(hi - lo)[:n_slots]
        # every pair at least once, the other slots repeat random pairs
        which = np.concatenate([np.arange(P), rng.integers(0, P, n_slots - P)])
        tokens[slots] = self.pair_base + keys[which] * V + values[which]
        asked = rng.permutation(P)[:Q]  # distinct keys: no local shortcut
        sep = start + m - 2 * Q - 1
        qpos = sep + 1 + 2 * np.arange(Q)  # query token positions
        tokens[sep] = SEP
        tokens[qpos] = self.query_base + keys[asked]
        tokens[qpos + 1] = self.value_base + values[asked]
        labels[qpos] = self.value_base + values[asked]  # next-token label, already shifted
        held = np.full(self.n_keys, -1)
        held[keys] = values
        return held

    def packed_sample(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Global sample ``index`` -> (tokens, labels, document ids), each [L] int64, from
        (seed, phase, index) only."""
        rng = np.random.default_rng([*self.key, index])
        L = self.seq_len
        tokens = self.filler_base + rng.integers(0, self.n_filler, size=L)
        labels = np.full(L, IGNORE_INDEX, dtype=np.int64)
        ids = np.zeros(L, dtype=np.int64)
        start, held = 0, None
        for d, m in enumerate(self._document_lengths(rng)):
            held = self._write_document(rng, tokens, labels, start, int(m), held)
            ids[start : start + m] = d
            start += m
        return tokens.astype(np.int64), labels, ids

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Global sample ``index`` -> (tokens [L], labels [L]) int64, from (seed, phase, index)
        only."""
        tokens, labels, _ = self.packed_sample(index)
        return tokens, labels

    def packed_batch(self, step: int, batch_per_dp_rank: int, dp_rank: int = 0,
                     dp_size: int = 1, positions: torch.Tensor | None = None) -> Batch:
        """This rank's ``Batch`` with document ids and per-document positions, [B, L] (or
        [B, len(positions)]); the samples are ``batch``'s."""
        return self.rows(step_indices(step, batch_per_dp_rank, dp_rank, dp_size), positions,
                         packed=True)

    def batch(
        self,
        step: int,
        batch_per_dp_rank: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, labels), each [B, L] long (or [B, len(positions)] with ``positions``).

        Sample ``i`` of this rank is global sample
        ``(step * dp_size + dp_rank) * batch_per_dp_rank + i`` (``step_indices``), drawn
        from (seed, that index): the global batch is the same for any dp split of it, and
        independent of the SP layout.
        ``labels[t]`` is the target for the prediction made at token t (already shifted
        on the global sequence), -100 except at query tokens. ``positions`` (global ids,
        e.g. ``layout.positions()``) selects this rank's columns.
        """
        b = self.rows(step_indices(step, batch_per_dp_rank, dp_rank, dp_size), positions)
        return b.tokens, b.labels

    def doc_lengths(self, samples) -> list[tuple[int, ...]]:
        """The document lengths of each row of global samples ``samples`` (in row order, each
        summing to ``seq_len``), from (seed, its id) alone: every rank computes the same."""
        return [tuple(int(n) for n in np.bincount(self.packed_sample(int(i))[2]))
                for i in samples]

    def rows(self, samples, positions: torch.Tensor | None = None,
             packed: bool = False) -> Batch:
        """The ``Batch`` [B, L] (or [B, n] with ``positions`` [n] or [B, n]) of global
        samples ``samples``, each from (seed, its id) alone; ``packed``: with document ids
        and per-document positions."""
        if packed:
            rows = [self.packed_sample(int(i)) for i in samples]
            tokens, labels, seg = (torch.from_numpy(np.stack(x)) for x in zip(*rows))  # [B, L]
            return packed_rows(tokens, labels, seg).columns(positions)  # -> [B, n]
        pairs = [self.sample(int(i)) for i in samples]
        tokens = torch.from_numpy(np.stack([t for t, _ in pairs]))  # [B, L]
        labels = torch.from_numpy(np.stack([lab for _, lab in pairs]))  # [B, L]
        return Batch(tokens, labels).columns(positions)  # [B, L] -> [B, L/P]


def answer_accuracy(
    scores: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> tuple[torch.Tensor, torch.Tensor]:
    """scores: logits [B, n, V] or each token's prediction [B, n] long; labels [B, n] ->
    (correct, answers): 0-dim long tensors on scores' device.

    Logits are reduced by argmax over the full vocabulary; works on a rank's shard, so the
    trainer all-reduces both counts and divides.
    """
    mask = labels != ignore_index  # [B, n]
    pred = scores.argmax(dim=-1) if scores.is_floating_point() else scores  # [B, n]
    correct = ((pred == labels) & mask).sum()
    return correct, mask.sum()
