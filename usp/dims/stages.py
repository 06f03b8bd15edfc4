"""The ulysses all-to-all's pipeline stages: how many (``check_a2a_chunks``, the default
rule ``default_a2a_chunks``) and which heads each stage carries (``head_chunks``).

Pure (no process group): the planner prices a stage count with these, the mesh carries
the count, ``usp_attention`` runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .counts import even_counts
from .heads import HeadSplit, head_split


@dataclass(frozen=True)
class HeadChunk:
    """One pipeline stage of one ulysses rank: global head ranges as (start, stop).

    ``q``: the query heads it computes; ``kv``: the KV heads they use; ``kv_first``: those
    of ``kv`` that no earlier stage of the rank used (they travel with this stage);
    ``kv_last``: those no later stage uses (their gradients travel back with this stage).
    """

    q: tuple[int, int]
    kv: tuple[int, int]
    kv_first: tuple[int, int]
    kv_last: tuple[int, int]


def check_a2a_chunks(chunks, num_q_heads: int, num_kv_heads: int, ulysses: int) -> int:
    """Check a pipeline depth for the ulysses all-to-all; returns it. Raises ValueError
    unless 1 <= ``chunks`` <= the most query heads a ulysses rank holds (``head_split``)."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"a2a_chunks must be an integer >= 1, got {chunks!r}")
    most = max(head_split(num_q_heads, num_kv_heads, ulysses).q_counts)
    if chunks > most:
        raise ValueError(
            f"a2a_chunks={chunks} > {most} query heads per ulysses rank ({num_q_heads} query "
            f"heads over ulysses {ulysses}): a stage needs at least one head; use "
            f"a2a_chunks <= {most}")
    return chunks


# Stages of ``a2a_chunks="auto"`` when a ulysses group crosses hosts and no planner count is
# given, capped by the heads a rank holds: the measured best with one rank per core (the
# stand-in for one GPU per rank) across the simulated 300 mbit link (docs/measurements.md).
AUTO_STAGES_ACROSS_HOSTS = 4


def default_a2a_chunks(setting, crosses_hosts: bool, num_q_heads: int, num_kv_heads: int,
                       ulysses: int) -> int:
    """The pipeline depth a mesh's ``a2a_chunks`` setting means for these heads: an int is
    checked (``check_a2a_chunks``); ``"auto"`` is 1 when every ulysses group stays inside a
    host, else ``AUTO_STAGES_ACROSS_HOSTS`` or the most query heads a rank holds if fewer.

    The one rule ``usp_attention`` applies to the mesh's setting (``ParallelDims.a2a_chunks``).
    Where a cluster is known (``usp-train``), the planner prices the count instead
    (``usp.planner.cost.choose_a2a_chunks``) and the run puts that int in the mesh's dims;
    ``"auto"`` reaches this default only from a mesh a library user built with it."""
    if setting != "auto":
        return check_a2a_chunks(setting, num_q_heads, num_kv_heads, ulysses)
    if not crosses_hosts or ulysses == 1:
        return 1
    most = max(head_split(num_q_heads, num_kv_heads, ulysses).q_counts)
    return min(AUTO_STAGES_ACROSS_HOSTS, most)


@lru_cache(maxsize=64)
def head_chunks(split: HeadSplit, chunks: int) -> tuple[tuple[HeadChunk, ...], ...]:
    """Each ulysses rank's heads cut into ``chunks`` pipeline stages: [rank][stage].

    Stages follow KV groups so each keeps the local GQA rule: with at least as many KV
    heads as stages a stage holds whole KV groups; with fewer, each KV group's query
    heads are cut into near-equal pieces (the KV head then serves several stages, and
    travels with the first). A rank with fewer query heads than stages gets empty stages.
    """
    out = []
    for (q0, q1), kv_heads in zip(split.q_ranges, split.kv_heads):
        nq, nkv, k0 = q1 - q0, len(kv_heads), kv_heads[0]
        g = nq // nkv  # local query heads per local KV head
        if nkv >= chunks:
            sizes = [n * g for n in even_counts(nkv, chunks)]
        else:
            sizes = [s for per_group in even_counts(chunks, nkv)
                     for s in even_counts(g, per_group)]
        bounds, a = [], 0
        for n in sizes:  # local query ranges -> the local KV heads each uses
            bounds.append((a, a + n, a // g, -(-(a + n) // g) if n else a // g))
            a += n
        stages, seen = [], 0
        for t, (a, b, ka, kb) in enumerate(bounds):
            later = min([la for _, _, la, lb in bounds[t + 1:] if lb > la] or [kb])
            first = (max(ka, seen), max(kb, seen))  # not used by an earlier stage
            last = (ka, max(ka, min(kb, later)))  # not used by a later stage
            stages.append(HeadChunk((q0 + a, q0 + b), (k0 + ka, k0 + kb),
                                    (k0 + first[0], k0 + first[1]), (k0 + last[0], k0 + last[1])))
            seen = max(seen, kb)
        out.append(tuple(stages))
    return tuple(out)
