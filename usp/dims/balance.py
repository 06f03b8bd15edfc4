"""Per-document balance: ring ownership of one packed row, decided from its documents.

Zigzag (``usp.dims.tokens``) evens out the causal work of a row that is one causal
triangle. A row of packed documents under the document mask is many small triangles, and
then the work follows where long documents' later tokens land. ``per_document_segments``
splits every document of the row head-tail instead: each document is cut into 2r
near-equal parts and slot j takes parts j and 2r-1-j (as PyTorch's
``_PerDocumentHeadTailLoadBalancer`` does when every document divides by 2r, with slot
j = ring rank j).

Any document lengths work, with no padding: a document of n = 2r*q + e tokens gives every
part q tokens and e < 2r extra tokens, one each to the head parts of slots 0, 1, ...
and then (e > r) to their tail parts. The ring ranks take the slots in the order of the
fewest extras of the row so far, then the most work so far: so the extras go round the
ranks in turn (the row length is a multiple of 2r, its extras a multiple of r, and every
rank ends with exactly L/r tokens) and the cheapest slot goes to the busiest rank. Parts
of equal size s at j and 2r-1-j cost s*s*(2r-1) + s*(s+1) causal pairs whatever j, so the
work is even up to the extras, and the order evens those out.

Pure and deterministic: every rank computes the same answer from the row's document
lengths (the token file's ``.docs``), with no communication.
"""

from __future__ import annotations

from functools import lru_cache
from itertools import accumulate

import torch

from ..rules import check_balance
from .tokens import _joined


def choose_balance(setting: str, packed: bool, ring_impl: str) -> tuple[str, str]:
    """(the balance a run lays its rows out by, why), from ``parallel.balance``
    (``setting``), whether its rows pack documents under the document mask (``packed``:
    ``data.packing=documents``) and its ring engine. ``auto``: ``per_document`` for packed
    documents on usp's ring, else ``zigzag``; a set balance is checked
    (``rules.check_balance``) and kept."""
    check_balance(setting, ring_impl, packed)
    if setting != "auto":
        return setting, f"parallel.balance={setting}"
    if packed and ring_impl == "usp":
        return "per_document", ("parallel.balance=auto: data.packing=documents or whole packs "
                                "documents under the document mask; each row's ring segments "
                                "follow its documents")
    why = ("the rows are one causal sequence each (data.packing=none)" if not packed else
           f"parallel.ring_impl={ring_impl} runs zigzag or contiguous rows only")
    return "zigzag", f"parallel.balance=auto: {why}"


def sequence_balance(balance: str) -> str:
    """The balance of rows that are one sequence with no document mask (passkey cases,
    usp-eval's rows) in a run laid out by ``balance``: zigzag under per_document (a
    one-document row's per_document segments are zigzag's), else ``balance`` itself."""
    return "zigzag" if balance == "per_document" else balance


def _check(doc_lens: tuple[int, ...], ring: int) -> int:
    seq_len = sum(doc_lens)
    if ring < 1 or any(n < 1 for n in doc_lens):
        raise ValueError(f"per_document balance needs ring >= 1 and document lengths >= 1, got "
                         f"ring={ring}, lengths {sorted(set(doc_lens))[:5]}...; drop empty "
                         f"documents from the row's boundaries")
    if seq_len % (2 * ring):
        m = 2 * ring
        raise ValueError(f"a row of {seq_len} tokens is not divisible by 2 x ring = {m}; "
                         f"use seq_len {seq_len // m * m or m} or {(seq_len // m + 1) * m}")
    return seq_len


def _document_slots(n: int, ring: int, given: list[int], work: list[int]):
    """One document of ``n`` tokens: (the ring rank of each slot, the 2r part sizes); slot j
    holds parts j and 2r-1-j. ``given``/``work`` (extras and causal pairs of each rank so
    far in the row) are updated in place."""
    q, extra = divmod(n, 2 * ring)
    order = sorted(range(ring), key=lambda i: (given[i], -work[i]))  # fewest extras first
    sizes = [q] * (2 * ring)
    for t in range(extra):  # extra < 2r: slot t mod r, its head, then (t >= r) its tail
        j = t % ring
        sizes[j if t < ring else 2 * ring - 1 - j] += 1
        given[order[j]] += 1
    edges = list(accumulate(sizes, initial=0))
    for j, rank in enumerate(order):  # causal pairs of the slot's two parts in the document
        for part in (j, 2 * ring - 1 - j):
            work[rank] += sizes[part] * edges[part] + sizes[part] * (sizes[part] + 1) // 2
    return order, sizes


@lru_cache(maxsize=4096)
def per_document_segments(doc_lens: tuple[int, ...], ring: int) -> tuple[tuple[range, ...], ...]:
    """Each ring rank's segment of a row whose documents have lengths ``doc_lens`` (in row
    order, summing to L, a multiple of 2r): a tuple of ``ring`` segments, each the
    ranges of global positions (increasing) of that rank's L/r tokens."""
    _check(doc_lens, ring)
    held: list[list[range]] = [[] for _ in range(ring)]
    start, given, work = 0, [0] * ring, [0] * ring
    for n in doc_lens:
        order, sizes = _document_slots(n, ring, given, work)
        edges = list(accumulate(sizes, initial=start))  # the 2r + 1 part boundaries
        for j, rank in enumerate(order):
            tail = 2 * ring - 1 - j
            held[rank] += [range(edges[j], edges[j + 1]), range(edges[tail], edges[tail + 1])]
        start += n
    return tuple(_joined(h) for h in held)


def doc_lengths(boundaries, seq_len: int) -> tuple[int, ...]:
    """Document lengths of a row of ``seq_len`` tokens from the positions (within the row,
    any order, 0 and ``seq_len`` allowed) where a document starts."""
    cuts = sorted({int(b) for b in boundaries if 0 < int(b) < seq_len})
    edges = [0, *cuts, seq_len]
    return tuple(b - a for a, b in zip(edges, edges[1:]))


def visible_pairs(ranges: tuple[range, ...], doc_lens: tuple[int, ...]) -> int:
    """(query, key) pairs that the causal document mask leaves visible to the queries at
    ``ranges`` (keys anywhere in the row): the attention work of the rank holding them."""
    starts = torch.tensor([0, *accumulate(doc_lens)][:-1])
    pos = torch.cat([torch.arange(r.start, r.stop) for r in ranges])
    doc_start = starts[torch.searchsorted(starts, pos, right=True) - 1]
    return int((pos - doc_start + 1).sum())
