"""Head counts that do not divide over the ulysses group, one process: ``head_split``
(contiguous query ranges, exactly the KV heads they use, the local GQA rule, and
optimality against brute-force enumeration), the refusals, and the per-rank byte formula.
Parity on ranks: ``distributed/test_uneven_heads_ranks.py``."""

import itertools

import pytest

from tools.lab.heads import HeadsBench, HeadsRow, even_neighbours, report
from usp.planner.traffic import attention_bytes
from usp.dims.heads import check_heads, head_imbalance, head_split


def _splits(max_q: int):
    for hq in range(1, max_q + 1):
        for hkv in (d for d in range(1, hq + 1) if hq % d == 0):
            for u in range(1, hq + 1):
                yield hq, hkv, u


def _brute_force_best(hq: int, hkv: int, u: int) -> tuple[int, int, int]:
    """(most query heads, most KV heads, total KV heads) of the best contiguous split in
    which every rank's KV heads serve equally many of its query heads, by enumeration."""
    group, best = hq // hkv, None
    for inner in itertools.combinations(range(1, hq), u - 1):
        cuts = (0, *inner, hq)
        ranges = list(itertools.pairwise(cuts))
        kvs = []
        for a, b in ranges:
            per_kv = {}
            for h in range(a, b):
                per_kv[h // group] = per_kv.get(h // group, 0) + 1
            if len(set(per_kv.values())) != 1:
                break
            kvs.append(len(per_kv))
        else:
            key = (max(b - a for a, b in ranges), max(kvs), sum(kvs))
            best = key if best is None or key < best else best
    return best


def test_split_examples():
    s = head_split(28, 4, 8)  # Qwen2.5-7B on 8 GPUs
    assert s.q_counts == (4, 3) * 4 and s.kv_heads == ((0,), (0,), (1,), (1,), (2,), (2,), (3,), (3,))
    s = head_split(8, 2, 3)  # the middle rank straddles both KV groups
    assert s.q_ranges == ((0, 3), (3, 5), (5, 8)) and s.kv_heads == ((0,), (0, 1), (1,))
    s = head_split(6, 6, 4)
    assert s.q_counts == (2, 2, 1, 1) and s.kv_counts == (2, 2, 1, 1)
    s = head_split(24, 6, 4)  # ranges keep whole KV groups: 6 heads would split group 1
    assert s.q_counts == (8, 8, 4, 4) and s.kv_heads == ((0, 1), (2, 3), (4,), (5,))
    assert not s.even and head_split(32, 8, 4).even


def test_split_invariants_and_optimality():
    for hq, hkv, u in _splits(12):
        s = head_split(hq, hkv, u)
        group = hq // hkv
        cuts = [a for a, _ in s.q_ranges] + [hq]  # contiguous, non-empty, covering [0, hq)
        assert s.q_ranges == tuple(itertools.pairwise(cuts)) and cuts[0] == 0, (hq, hkv, u)
        assert all(a < b for a, b in s.q_ranges), (hq, hkv, u, s.q_ranges)
        for (a, b), kv in zip(s.q_ranges, s.kv_heads):
            assert kv == tuple(sorted({h // group for h in range(a, b)})), (hq, hkv, u)
            g = (b - a) // len(kv)
            assert g * len(kv) == b - a  # the kernels' rule: local head i uses kv[i // g]
            assert all(kv[i // g] == (a + i) // group for i in range(b - a)), (hq, hkv, u)
        got = (max(s.q_counts), max(s.kv_counts), sum(s.kv_counts))
        assert got == _brute_force_best(hq, hkv, u), (hq, hkv, u, s)


@pytest.mark.parametrize("hq,hkv,u", [(32, 8, 8), (32, 8, 4), (8, 2, 4), (4, 1, 4),
                                      (64, 8, 16), (32, 8, 2), (6, 6, 3)])
def test_even_split_is_plain_division(hq, hkv, u):
    s = head_split(hq, hkv, u)
    assert s.even and s.q_counts == (hq // u,) * u
    assert s.kv_counts == (max(hkv // u, 1),) * u
    assert check_heads(hq, hkv, u) == max(hkv // u, 1) and head_imbalance(hq, hkv, u) == 1.0


def test_check_heads_and_imbalance_for_uneven_counts():
    assert check_heads(6, 6, 4) == 2 and head_imbalance(6, 6, 4) == pytest.approx(4 / 3)
    assert check_heads(8, 2, 3) == 2 and head_imbalance(8, 2, 3) == pytest.approx(9 / 8)
    assert check_heads(28, 4, 8) == 1 and head_imbalance(28, 4, 8) == pytest.approx(8 / 7)
    assert check_heads(12, 4, 8) == 1  # refused before the uneven split existed


def test_heads_refusals_name_the_numbers_and_a_fix():
    with pytest.raises(ValueError, match=r"ulysses degree \(8\) > query heads \(4\).*<= 4"):
        check_heads(4, 2, 8)
    with pytest.raises(ValueError, match=r"query heads \(6\) must be a multiple of KV heads \(4\)"):
        check_heads(6, 4, 1)
    with pytest.raises(ValueError, match="positive"):
        check_heads(0, 1, 1)
    with pytest.raises(ValueError, match="ulysses degree must be a positive integer"):
        head_split(4, 2, 0)


def test_bytes_per_rank_and_the_slowest_rank():
    b, L, d, e = 1, 96, 8, 2
    for hq, hkv, u, r in ((6, 6, 4, 2), (8, 2, 3, 2), (28, 4, 8, 2), (32, 8, 4, 2)):
        s = head_split(hq, hkv, u)
        per_rank = [attention_bytes(b, L, hq, hkv, d, u, r, e, rank=j) for j in range(u)]
        fwd, bwd = attention_bytes(b, L, hq, hkv, d, u, r, e)
        for got, part in ((fwd, 0), (bwd, 1)):
            assert got == {a: max(p[part][a] for p in per_rank) for a in ("ulysses", "ring")}
        # the ring carries each rank's own KV heads: bytes per KV head equal on every rank
        ring = [p[0]["ring"] for p in per_rank]
        assert min(ring) > 0 and len({x / c for x, c in zip(ring, s.kv_counts)}) == 1
    with pytest.raises(ValueError, match="rank 4"):
        attention_bytes(b, L, 6, 6, d, 4, 1, e, rank=4)


def test_bench_compares_with_the_nearest_even_split():
    assert even_neighbours(6, 6, 4) == [(4, 4), (8, 8)]
    assert even_neighbours(6, 2, 4) == [(12, 4)]  # 3 query heads per KV head kept
    assert even_neighbours(28, 4, 8) == [(56, 8)]
    cfg = HeadsBench(heads=((6, 6), (8, 8)), seq_len=64)
    rows = [HeadsRow(6, 6, (2, 2, 1, 1), [30.0, 10.0, 20.0]), HeadsRow(8, 8, (2,) * 4, [40.0])]
    last = report(cfg, rows).splitlines()[-1].split()
    assert last[:2] == ["8/8", "2,2,2,2"] and last[-3:] == ["2.00", "1.00", "1.33"]
    with pytest.raises(ValueError, match="seq_len 60 is not a multiple of 8"):
        HeadsBench(heads=((6, 6),), seq_len=60)
    with pytest.raises(ValueError, match=r"ulysses degree \(4\) > query heads \(3\)"):
        HeadsBench(heads=((3, 1),))
