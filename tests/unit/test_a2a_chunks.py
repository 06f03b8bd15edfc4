"""Pipelined ulysses all-to-alls (``usp_attention(..., a2a_chunks=c)``), one process:
``head_chunks`` (every query head in exactly one stage, the stage's KV heads are the ones
its query heads use, each KV head travels once and its grads once), the refusals of
``check_a2a_chunks``, and the ring bytes of stages sharing a KV head. On ranks:
``distributed/test_a2a_chunks_ranks.py``."""

import itertools

import pytest
import torch

from usp import usp_attention
from usp.planner.traffic import attention_bytes
from usp.dims.stages import check_a2a_chunks, head_chunks
from usp.dims.heads import head_split

# ---- the stage plan ------------------------------------------------------------------------


def _all_splits(max_q: int):
    for hq in range(1, max_q + 1):
        for hkv in (d for d in range(1, hq + 1) if hq % d == 0):
            for u in range(1, hq + 1):
                split = head_split(hq, hkv, u)
                for c in range(1, max(split.q_counts) + 1):
                    yield hq, hkv, split, c


def test_stages_cover_heads_and_keep_gqa():
    for hq, hkv, split, c in _all_splits(12):
        group = hq // hkv
        for (q0, q1), kv, stages in zip(split.q_ranges, split.kv_heads, head_chunks(split, c)):
            case = (hq, hkv, split.ulysses, c, stages)
            assert len(stages) == c, case
            cuts = [s.q[0] for s in stages] + [stages[-1].q[1]]
            assert cuts[0] == q0 and cuts[-1] == q1 and cuts == sorted(cuts), case
            assert all(s.q[1] == n.q[0] for s, n in itertools.pairwise(stages)), case
            if q1 - q0 >= c:
                assert all(s.q[1] > s.q[0] for s in stages), case  # no empty stage
            firsts, lasts = [], []
            for s in stages:
                heads = range(*s.q)
                used = sorted({h // group for h in heads})
                assert list(range(*s.kv)) == used, case  # exactly the KV heads it uses
                if used:  # the kernels' local GQA rule within the stage
                    g = len(heads) // len(used)
                    assert g * len(used) == len(heads), case
                    assert all(used[i // g] == h // group for i, h in enumerate(heads)), case
                firsts += range(*s.kv_first)
                lasts += range(*s.kv_last)
            assert firsts == list(kv) and lasts == list(kv), case  # each travels once
            for t, s in enumerate(stages):  # KV arrives no later than its first use, and
                seen = {h for p in stages[: t + 1] for h in range(*p.kv_first)}
                assert set(range(*s.kv)) <= seen, case
                later = {h for p in stages[t + 1:] for h in range(*p.kv)}
                assert not set(range(*s.kv_last)) & later, case  # grads leave after last use


def test_stage_examples():
    # 8 query / 2 KV heads on u=4: one KV head per rank serves both single-head stages
    (a0, a1), *_ = head_chunks(head_split(8, 2, 4), 2)
    assert (a0.q, a0.kv, a0.kv_first, a0.kv_last) == ((0, 1), (0, 1), (0, 1), (0, 0))
    assert (a1.q, a1.kv, a1.kv_first, a1.kv_last) == ((1, 2), (0, 1), (1, 1), (0, 1))
    # 8 / 4 on u=2, c=2: whole KV groups per stage
    _, r1 = head_chunks(head_split(8, 4, 2), 2)
    assert [(s.q, s.kv) for s in r1] == [((4, 6), (2, 3)), ((6, 8), (3, 4))]
    # 6 / 6 on u=4: ranks with one head get an empty second stage
    *_, last = head_chunks(head_split(6, 6, 4), 2)
    assert last[0].q == (5, 6) and last[1].q[0] == last[1].q[1]


@pytest.mark.parametrize("chunks,hq,hkv,u,needle", [
    (0, 8, 2, 2, "integer >= 1"),
    (2.0, 8, 2, 2, "integer >= 1"),
    (True, 8, 2, 2, "integer >= 1"),
    (3, 8, 2, 4, "a2a_chunks=3 > 2 query heads per ulysses rank"),
    (5, 16, 4, 4, "use a2a_chunks <= 4"),
])
def test_chunk_count_refused(chunks, hq, hkv, u, needle):
    with pytest.raises(ValueError, match=needle):
        check_a2a_chunks(chunks, hq, hkv, u)


def test_refused_before_any_collective():
    class NoMesh:  # any collective on it would fail loudly, not with the chunk message
        ulysses, ring, sp_size = 4, 1, 4

    q = torch.zeros(1, 4, 8, 8)
    kv = torch.zeros(1, 4, 2, 8)
    lay = type("L", (), {"mesh": None, "local_len": 4, "balance": "zigzag", "seq_len": 16})()
    lay.mesh = mesh = NoMesh()
    with pytest.raises(ValueError, match="use a2a_chunks <= 2"):
        usp_attention(q, kv, kv, mesh=mesh, layout=lay, a2a_chunks=3)


def test_ring_bytes_grow_only_with_shared_kv_heads():
    one = attention_bytes(1, 64, 8, 4, 8, 2, 2, 2)
    assert attention_bytes(1, 64, 8, 4, 8, 2, 2, 2, a2a_chunks=2) == one  # whole KV groups
    fwd, bwd = attention_bytes(1, 64, 8, 4, 8, 2, 2, 2, a2a_chunks=4)  # 2 stages per KV head
    assert fwd["ulysses"] == one[0]["ulysses"] and bwd["ulysses"] == one[1]["ulysses"]
    assert fwd["ring"] == 2 * one[0]["ring"] and bwd["ring"] == 2 * one[1]["ring"]


def test_default_chunks_follow_the_hosts():
    from usp.dims.stages import AUTO_STAGES_ACROSS_HOSTS, default_a2a_chunks
    from usp.rules import check_a2a_setting

    assert AUTO_STAGES_ACROSS_HOSTS == 4
    assert default_a2a_chunks("auto", False, 8, 2, 2) == 1  # inside a host: one stage
    assert default_a2a_chunks("auto", True, 8, 2, 2) == 4  # across: pipelined
    assert default_a2a_chunks("auto", True, 8, 2, 4) == 2  # no deeper than the heads
    assert default_a2a_chunks("auto", True, 6, 6, 4) == 2  # uneven: the busiest rank's 2
    assert default_a2a_chunks("auto", True, 8, 8, 1) == 1  # no ulysses group
    assert default_a2a_chunks(3, False, 8, 2, 2) == 3  # a count is a count
    with pytest.raises(ValueError, match="a2a_chunks=5 > 4 query heads"):
        default_a2a_chunks(5, True, 8, 2, 2)
    for bad in (0, True, 2.0, "four"):
        with pytest.raises(ValueError, match="must be an integer >= 1 or auto"):
            check_a2a_setting(bad)
