"""``usp.dims.tokens``: who holds token t, computed with no mesh."""

import pytest
import torch

from usp.dims.tokens import Ownership, position_tensor, rank_ranges, segment_ranges


def test_zigzag_example_of_the_docstring():
    # L=16, ring=2, ulysses=2: ring 0 owns [0:4]+[12:16], ring 1 owns [4:8]+[8:12]
    assert segment_ranges(16, 2, "zigzag", 0) == (range(0, 4), range(12, 16))
    assert segment_ranges(16, 2, "zigzag", 1) == (range(4, 12),)  # its two parts touch
    assert rank_ranges(16, 2, 2, "zigzag", 0, 1) == (range(12, 16),)
    assert rank_ranges(16, 2, 2, "zigzag", 1, 0) == (range(4, 8),)
    assert segment_ranges(16, 4, "contiguous", 3) == (range(12, 16),)


@pytest.mark.parametrize("balance", ["contiguous", "zigzag"])
@pytest.mark.parametrize("ring,ulysses", [(1, 1), (2, 2), (4, 1), (1, 4), (3, 2)])
def test_every_token_has_one_owner(balance, ring, ulysses):
    owner = Ownership(48, ring, ulysses, balance)
    held = torch.cat([position_tensor(owner.ranges(i, j))
                      for i in range(ring) for j in range(ulysses)])
    assert sorted(held.tolist()) == list(range(48))
    for i in range(ring):  # the ulysses shares of a segment, in order, are the segment
        shares = torch.cat([position_tensor(owner.ranges(i, j)) for j in range(ulysses)])
        assert torch.equal(shares, position_tensor(owner.segment(i)))
        assert len(shares) == owner.segment_len == 48 // ring


def test_resized_checks_the_new_length():
    owner = Ownership(32, ring=2, ulysses=2)
    assert owner.resized(64).local_len == 16
    with pytest.raises(ValueError, match="not divisible by 2 x ring x ulysses = 8"):
        owner.resized(36)
