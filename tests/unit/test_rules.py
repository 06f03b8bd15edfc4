"""Tier 1: layout rules, no process group."""

import re

import pytest
import torch

from usp.rules import check_degrees, check_kernel, check_placement, check_seq_len

from usp.dims.heads import check_heads


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


def test_heads_errors_name_what_cannot_work():
    # any count that leaves each rank at least one query head splits (unit/test_uneven_heads.py)
    assert check_heads(12, 4, 8) == 1 and check_heads(24, 6, 4) == 2
    with pytest.raises(ValueError, match=r"ulysses degree \(4\) > query heads \(2\).*ulysses <= 2"):
        check_heads(2, 1, 4)
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


BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64


@pytest.mark.parametrize(
    "args,kw",
    [
        (("torch", "cpu", FP32, 20), {}),  # CPU kernels take any head dim
        (("torch", "cpu", FP64, 64), {}),
        (("reference", "cuda", FP64, 20), {}),  # the math kernel runs anything
        (("torch", "cuda", BF16, 256), {}),
        (("torch", "cuda", FP32, 512), {}),  # efficient attention: no 256 limit
        (("flash_attn", "cuda:1", FP16, 64), {}),
        (("torch", "cuda", BF16, 128), dict(ring_impl="ring_flash_attn")),
        (("torch", "cuda", BF16, 128),
         dict(ring_impl="ring_flash_attn", causal=False, balance="contiguous")),
        (("torch", "cpu", FP32, 20), dict(ring_impl="usp", causal=False)),
    ],
)
def test_kernel_rules_accept(args, kw):
    check_kernel(*args, **kw)


@pytest.mark.parametrize(
    "args,kw,needles",
    [
        (("torch", "cuda", BF16, 20), {}, ["head dim 20 is not a multiple of 8", "16 or 24"]),
        (("torch", "cuda", FP32, 36), {}, ["head dim 36", "efficient attention", "32 or 40"]),
        (("flash_attn", "cuda", BF16, 4), {}, ["head dim 4", "8 or 16"]),
        (("torch", "cuda", FP16, 264), {}, ["head dim 264 > 256", "<= 256"]),
        (("flash_attn", "cuda", BF16, 512), {}, ["head dim 512 > 256"]),
        (("torch", "cuda", FP64, 64), {}, ["float64", "kernel='reference'"]),
        (("flash_attn", "cuda", FP32, 64), {}, ["float16 or bfloat16", "torch.float32",
                                               "kernel='torch'"]),
        (("flash_attn", "cpu", BF16, 64), {}, ["CUDA only", "cpu"]),
        (("torch", "cpu", BF16, 64), dict(ring_impl="ring_flash_attn"),
         ["CUDA kernels", "on cpu", "ring_impl='usp'"]),
        (("torch", "cuda", FP32, 64), dict(ring_impl="ring_flash_attn"),
         ["float16 or bfloat16", "torch.float32"]),
        (("torch", "cuda", BF16, 64), dict(ring_impl="ring_flash_attn", causal=False),
         ["asserts causal=True", "balance='contiguous'"]),
        (("torch", "cuda", FP16, 64), dict(ring_impl="ring_flash_attn", balance="contiguous"),
         ["dq in bfloat16", "use bfloat16"]),
        (("reference", "cuda", BF16, 20), dict(ring_impl="ring_flash_attn"),
         ["head dim 20 is not a multiple of 8"]),
        (("xformers", "cuda", BF16, 64), {}, ["unknown attention kernel 'xformers'", "torch"]),
        (("torch", "cuda", BF16, 64), dict(ring_impl="stripe"), ["ring_impl must be one of",
                                                                 "'stripe'"]),
    ],
)
def test_kernel_rules_refuse_with_numbers_and_a_fix(args, kw, needles):
    with pytest.raises(ValueError) as e:
        check_kernel(*args, **kw)
    for n in needles:
        assert n in str(e.value), (n, str(e.value))
    suggested = re.search(r"use head dim (\d+) or (\d+)", str(e.value))
    if suggested:  # every suggested head dim passes the same rules
        for d in map(int, suggested.groups()):
            check_kernel(args[0], args[1], args[2], d, **kw)
