"""Pipelined ulysses all-to-alls on gloo ranks, one spawn per world size: parity with fp64
dense attention for c in {2, 4} over (u, r) in {(2, 1), (4, 1), (2, 2)}, MHA/GQA/MQA, with
and without masks, fp32 and bf16 (``_cases.check_case``); measured bytes equal
``attention_bytes`` (ulysses: the unpipelined bytes) with c times the calls; an all-to-all
posted before compute records hidden time. The stage plan: ``unit/test_a2a_chunks.py``."""

import contextlib
import functools
import time

import _cases
import torch
import torch.distributed as dist

from usp import SequenceLayout, SPMesh, usp_attention
from usp.comm import CommStats, all_to_all_start
from usp.launch import spawn_local
from usp.planner.traffic import attention_bytes


@contextlib.contextmanager
def _chunked(chunks: int):
    """``_cases.check_case`` calling ``usp_attention(..., a2a_chunks=chunks)``."""
    real = _cases.usp_attention
    _cases.usp_attention = functools.partial(real, a2a_chunks=chunks)
    try:
        yield
    finally:
        _cases.usp_attention = real


HEADS = {2: [(8, 4), (4, 1)], 4: [(8, 2), (16, 4)]}  # u -> (hq, hkv): GQA, MQA, u > Hkv
CHUNKS = (2, 4)


def _parity(u: int, r: int):
    mesh = SPMesh.build(ulysses=u, ring=r, ranks_per_node=u)
    seed = 0
    for hq, hkv in HEADS[u]:
        for chunks in (c for c in CHUNKS if c <= hq // u):
            for dtype, causal, balance, masks in (
                (torch.float32, True, "zigzag", {}),
                (torch.float32, False, "contiguous", {}),
                (torch.bfloat16, True, "zigzag", {}),
                (torch.float32, True, "zigzag", dict(docs=True, window=13)),
                (torch.float32, True, "contiguous", dict(window=9)),
            ):
                with _chunked(chunks):
                    _cases.check_case(mesh, batch=2, seq_len=32, hq=hq, hkv=hkv, d=8,
                                      causal=causal, balance=balance, dtype=dtype,
                                      kernel="torch", seed=seed, **masks)
                seed += 1
    mesh.close()


def _bytes(u: int, r: int):
    mesh = SPMesh.build(ulysses=u, ring=r, ranks_per_node=u)
    b, L, d = 2, 32, 8
    lay = SequenceLayout(mesh, seq_len=L)
    for hq, hkv in HEADS[u] + [(6, 6)] * (u == 4):  # 6/6 on 4: uneven, empty stages
        plain = attention_bytes(b, L, hq, hkv, d, u, r, 4, mesh.ulysses_rank)
        for chunks in (1, 2):
            fwd, bwd = attention_bytes(b, L, hq, hkv, d, u, r, 4, mesh.ulysses_rank, chunks)
            assert (fwd["ulysses"], bwd["ulysses"]) == (plain[0]["ulysses"], plain[1]["ulysses"])
            q = torch.randn(b, L // (u * r), hq, d, requires_grad=True)
            k = torch.randn(b, L // (u * r), hkv, d, requires_grad=True)
            v = torch.randn_like(k, requires_grad=True)
            mesh.comm.reset()
            out = usp_attention(q, k, v, mesh=mesh, layout=lay, a2a_chunks=chunks)
            assert mesh.comm.bytes["ulysses"] == fwd["ulysses"], (hq, hkv, chunks)
            assert mesh.comm.bytes["ring"] == fwd["ring"], (hq, hkv, chunks)
            assert mesh.comm.calls["ulysses"] == 2 * chunks  # q/k/v in, out back, per stage
            mesh.comm.reset()
            out.sum().backward()
            assert mesh.comm.bytes["ulysses"] == bwd["ulysses"], (hq, hkv, chunks)
            assert mesh.comm.bytes["ring"] == bwd["ring"], (hq, hkv, chunks)
            assert mesh.comm.calls["ulysses"] == 2 * chunks
    mesh.close()


def _hidden():
    """A transfer posted before 0.3 s of work and waited for after it is hidden, not exposed."""
    stats = CommStats()
    x = torch.randn(dist.get_world_size(), 1000)
    flight = all_to_all_start(x, None, None, stats)
    time.sleep(0.3)  # the caller computes
    got = flight.wait()
    assert torch.equal(got[dist.get_rank()], x[dist.get_rank()])
    assert stats.calls["ulysses"] == 1
    assert stats.exposed_s["ulysses"] < 0.2  # it had landed long before the wait
    assert 0 < stats.hidden_s["ulysses"] <= 0.3 + 0.05
    blocking = CommStats()
    all_to_all_start(x, None, None, blocking).wait()  # waited at once: nothing hidden
    assert blocking.hidden_s["ulysses"] < 0.05 and blocking.exposed_s["ulysses"] > 0


def _world4():
    _hidden()
    for u, r in ((4, 1), (2, 2)):
        _parity(u, r)
        _bytes(u, r)
    dist.barrier()


def _world2():
    _parity(2, 1)
    _bytes(2, 1)
    dist.barrier()


def test_chunked_world_2():
    spawn_local(_world2, 2)


def test_chunked_world_4():
    spawn_local(_world4, 4)
