"""``usp.bench.balance``: packed rows and the ring's counted work per rank."""

import pytest

from usp.bench.balance import imbalance, mean_p90, packed_rows, rank_work, sample_rows
from usp.dims.balance import visible_pairs
from usp.dims.tokens import segment_ranges


def test_packed_rows_cut_documents_at_window_edges():
    assert packed_rows([5, 3, 9, 2, 7], 8) == [(5, 3), (8,), (1, 2, 5)]  # 26 tokens: 3 rows
    assert packed_rows([4], 8) == []


def test_counted_work_of_one_causal_row_is_even_under_both():
    for balance in ("zigzag", "per_document"):
        work = rank_work((512,), 4, balance)
        assert imbalance(work) == 1.0 and sum(work) == 512 * 513 // 2


def test_per_document_evens_out_what_zigzag_does_not():
    docs = (900, 60, 40, 24)  # one long document first: zigzag's rank 0 and 3 carry it
    zig, per = rank_work(docs, 4, "zigzag"), rank_work(docs, 4, "per_document")
    # documents on tile edges or not, the calls compute at least the visible pairs
    assert sum(zig) >= sum(visible_pairs(segment_ranges(1024, 4, "zigzag", i), docs)
                           for i in range(4))
    assert imbalance(per) < 1.02 < imbalance(zig)


def test_mean_p90():
    assert mean_p90([1.0, 2.0, 3.0]) == pytest.approx((2.0, 2.8))
    with pytest.raises(ValueError, match="balance must be one of"):
        rank_work((64,), 2, "contiguous")


def test_sample_rows_is_a_seeded_draw():
    a = sample_rows(1000, 6, seed=0)
    assert a == sample_rows(1000, 6, seed=0) != sample_rows(1000, 6, seed=1)
    assert a == sorted(set(a)) and len(a) == 6 and 0 <= a[0] and a[-1] < 1000
    assert sample_rows(5, 5, seed=3) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="cannot draw 7 of 5 rows"):
        sample_rows(5, 7, seed=0)
