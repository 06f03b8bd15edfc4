"""Tier 1: layout rules, no process group."""

import pytest

from usp.validate import check_degrees, check_heads, check_placement, check_seq_len


def test_degrees_derive_dp():
    assert check_degrees(8, ulysses=2, ring=2) == 2
    assert check_degrees(4, ulysses=4, ring=1) == 1
    assert check_degrees(4, ulysses=2, ring=2, dp=1) == 1


@pytest.mark.parametrize(
    "world,u,r,dp,needles",
    [
        (4, 3, 1, None, ["ulysses (3)", "ring (1)", "world size 4"]),
        (6, 2, 2, None, ["= 4", "world size 6"]),
        (8, 2, 2, 3, ["dp (3)", "12", "world size 8"]),
        (4, 0, 1, None, ["ulysses", "positive"]),
    ],
)
def test_degrees_errors_name_the_numbers(world, u, r, dp, needles):
    with pytest.raises(ValueError) as e:
        check_degrees(world, u, r, dp)
    for n in needles:
        assert n in str(e.value)


def test_heads_split_and_replication():
    assert check_heads(32, 8, 8) == 1  # Llama-3-8B, u = KV heads
    assert check_heads(32, 8, 4) == 2
    assert check_heads(8, 2, 4) == 1  # GQA with u > Hkv: each rank gets 1 KV head
    assert check_heads(4, 1, 4) == 1  # MQA


def _suggested(msg: str) -> list[int]:
    return [int(x) for x in msg.split("[")[1].split("]")[0].split(",")]


def test_heads_errors_suggest_a_degree_that_works():
    with pytest.raises(ValueError, match=r"query heads \(12\).*ulysses degree \(8\)") as e:
        check_heads(12, 4, 8)
    suggested = _suggested(str(e.value))
    assert suggested[0] == 4  # the nearest working degree first
    for u in suggested:
        check_heads(12, 4, u)  # every suggestion is valid
    with pytest.raises(ValueError, match=r"KV heads \(6\) and ulysses degree \(4\)"):
        check_heads(24, 6, 4)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        check_heads(6, 4, 1)


def test_seq_len_rules():
    check_seq_len(64, 2, 2, "zigzag")
    check_seq_len(36, 3, 2, "contiguous")
    with pytest.raises(ValueError, match=r"100 is not divisible by 2 x ring x ulysses = 8.*96 or 104"):
        check_seq_len(100, 2, 2, "zigzag")
    with pytest.raises(ValueError, match=r"ring x ulysses = 6"):
        check_seq_len(32, 3, 2, "contiguous")
    with pytest.raises(ValueError, match="balance"):
        check_seq_len(32, 1, 1, "striped")


def test_placement():
    check_placement("ring_inner")
    with pytest.raises(ValueError, match="ulysses_inner"):
        check_placement("outer")
