"""``usp.dims.balance``: per-document head-tail ownership of a packed row."""

import random

import pytest
import torch

from usp.dims.balance import doc_lengths, per_document_segments, visible_pairs
from usp.dims.tokens import position_tensor, segment_ranges


def _ratio(segments, docs) -> float:
    work = [visible_pairs(s, docs) for s in segments]
    return max(work) / (sum(work) / len(work))


def _check_counts(segments, docs, ring):
    seq_len = sum(docs)
    held = torch.cat([position_tensor(s) for s in segments])
    assert sorted(held.tolist()) == list(range(seq_len))  # every token owned once
    for s in segments:
        pos = position_tensor(s)
        assert len(pos) == seq_len // ring  # exactly L/r each
        assert bool((pos[1:] > pos[:-1]).all())  # in increasing order


def test_one_document_dividing_by_2r_is_zigzag():
    for ring in (2, 4, 8):
        got = per_document_segments((64,), ring)
        assert got == tuple(segment_ranges(64, ring, "zigzag", i) for i in range(ring))


def test_small_example():
    # docs 8 and 4 over ring 2: parts of 2 / 1; slot j takes parts j and 3 - j; after the
    # first document both ranks have 14 pairs and no extras, so rank 0 takes slot 0 again
    assert per_document_segments((8, 4), 2) == ((range(0, 2), range(6, 9), range(11, 12)),
                                               (range(2, 6), range(9, 11)))
    # docs 6 and 6: 6 = 4 + 2 extras, one each; rank 1 did more work (parts 1, 2 of the
    # first document), so it takes slot 0 of the second
    assert per_document_segments((6, 6), 2) == ((range(0, 2), range(5, 6), range(8, 11)),
                                               (range(2, 5), range(6, 8), range(11, 12)))


ADVERSARIAL = {
    "one long": (32768,),
    "ones": (1,) * 4096,
    "shorter than 2r": (7, 5, 3, 1) * 64 + (0,),
    "long then short": (30000,) + (11,) * 252,
    "short then long": (3,) * 256 + (31000,),
    "odd lengths": (4095, 4097, 8191, 8193, 3, 5, 8187),
    "longer than L/r": (20001, 12767),
}


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
@pytest.mark.parametrize("ring", [2, 4, 8])
def test_adversarial_rows(name, ring):
    docs = tuple(n for n in ADVERSARIAL[name] if n)
    docs = docs[:-1] + (docs[-1] + (-sum(docs)) % (2 * ring),)  # a multiple of 2r
    segments = per_document_segments(docs, ring)
    _check_counts(segments, docs, ring)
    # a row made only of documents shorter than 2r is all extras: exact counts leave it
    # within 12% (its whole attention work is ~4 pairs a token, so this costs nothing real)
    assert _ratio(segments, docs) <= (1.12 if name == "shorter than 2r" else 1.02)


@pytest.mark.parametrize("ring", [2, 4, 8])
def test_random_rows_beat_zigzag(ring):
    rng = random.Random(ring)
    seq_len, worse = 32768, 0
    for _ in range(20):
        cuts = rng.sample(range(1, seq_len), rng.choice([1, 3, 10, 60]))
        docs = doc_lengths(cuts, seq_len)
        segments = per_document_segments(docs, ring)
        _check_counts(segments, docs, ring)
        ours = _ratio(segments, docs)
        zig = _ratio([segment_ranges(seq_len, ring, "zigzag", i) for i in range(ring)], docs)
        assert ours <= 1.02
        worse += ours > zig + 1e-9
    assert worse == 0


def test_visible_pairs_counts_the_document_mask():
    docs = (3, 5)  # triangles of 6 and 15 pairs
    assert visible_pairs((range(0, 8),), docs) == 21
    assert visible_pairs((range(2, 4),), docs) == 3 + 1  # last of doc 0, first of doc 1


def test_doc_lengths_from_boundaries():
    assert doc_lengths([0, 5, 3, 8, 5], 8) == (3, 2, 3)


def test_refusals():
    with pytest.raises(ValueError, match="not divisible by 2 x ring = 8"):
        per_document_segments((10,), 4)
    with pytest.raises(ValueError, match="lengths >= 1"):
        per_document_segments((8, 0), 2)
