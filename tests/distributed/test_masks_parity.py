"""Packed documents and sliding windows across ulysses x ring, against fp64 dense masked
attention (out, dq, dk, dv), one spawn per world size looping over its layouts.

Every layout (u, r) in {(1,1), (2,1), (1,2), (2,2), (4,1), (1,4)} runs zigzag and
contiguous, causal and not, documents of random lengths (boundaries on and off shard
edges, one-token documents, a row with one document), windows shorter than a chunk,
longer than a ring segment and longer than L, with MHA, GQA and MQA heads: fp32 within
2e-5, bf16 within 2x the one-process bf16 kernel's error (``_cases.check_case``). World 4
also checks the ring's bytes under a window against ``masked_attention_bytes`` and that
blocks a mask leaves empty make no kernel call.
"""

import itertools

import torch
import torch.distributed as dist

from usp import SequenceLayout, SPMesh, usp_attention
from usp.launch import spawn_local
from usp.planner.traffic import masked_attention_bytes

from _cases import check_case

L = 64
HEADS = [(4, 2), (4, 1), (4, 4)]
MASKS = [dict(docs=True), dict(window=3), dict(docs=True, window=20), dict(window=40),
         dict(docs=True, window=100)]


def _cases():
    cases = []
    for i, (balance, causal, masks) in enumerate(
            itertools.product(("zigzag", "contiguous"), (True, False), MASKS)):
        hq, hkv = HEADS[i % len(HEADS)]
        cases.append(dict(batch=3, seq_len=L, hq=hq, hkv=hkv, d=8, causal=causal,
                          balance=balance, dtype=torch.float32, kernel="torch", **masks))
    bf16 = dict(batch=3, seq_len=L, d=8, dtype=torch.bfloat16, kernel="torch")
    cases.append(dict(bf16, hq=4, hkv=2, causal=True, balance="zigzag", docs=True, window=20))
    cases.append(dict(bf16, hq=4, hkv=1, causal=False, balance="contiguous", window=3))
    return cases


def _bytes_and_calls(mesh):
    """Ring bytes under a window (fewer hops on contiguous) equal the formula; a window
    shorter than a segment and documents inside segments leave no kernel call past the
    hops the window needs."""
    b, hq, hkv, d = 2, 4, 2, 8
    n = L // mesh.sp_size
    for balance, window, docs in (("contiguous", 5, False), ("contiguous", 20, True),
                                  ("zigzag", 5, True), ("contiguous", None, True)):
        lay = SequenceLayout(mesh, seq_len=L, balance=balance)
        q = torch.randn(b, n, hq, d, requires_grad=True)
        k, v = (torch.randn(b, n, hkv, d, requires_grad=True) for _ in range(2))
        ids = torch.empty(b, L, dtype=torch.long)
        for i in range(mesh.ring):  # each ring segment its own document (two pieces in zigzag)
            ids[:, lay.segment_indices(i)] = i
        seg = lay.shard(ids, dim=1) if docs else None
        mesh.comm.reset()
        out = usp_attention(q, k, v, mesh=mesh, layout=lay, segment_ids=seg, window=window)
        fwd_got = {a: mesh.comm.bytes[a] for a in ("ulysses", "ring", "sp")}
        calls = dict(mesh.comm.kernel_calls)
        mesh.comm.reset()
        out.sum().backward()
        bwd_got = {a: mesh.comm.bytes[a] for a in ("ulysses", "ring", "sp")}
        fwd, bwd = masked_attention_bytes(b, L, hq, hkv, d, mesh.ulysses, mesh.ring, 4,
                                          balance=balance, causal=True, window=window,
                                          segment_ids=docs)
        assert (fwd_got, bwd_got) == (fwd, bwd), (balance, window, docs, fwd_got, fwd)
        if docs:  # no document spans two ring segments: no block past the diagonal runs
            assert all(c == 0 for (_, step), c in calls.items() if step > 0), calls
        if balance == "contiguous" and window == 5:
            assert max(step for _, step in calls) == 1  # one hop reaches 4 tokens back


def _worker(layouts):
    for ulysses, ring in layouts:
        with SPMesh.build(ulysses=ulysses, ring=ring, ranks_per_node=ulysses) as mesh:
            for seed, case in enumerate(_cases()):
                check_case(mesh, seed=seed, **case)
            if ring == 4 or (ring, ulysses) == (2, 2):
                _bytes_and_calls(mesh)
    dist.barrier()


def test_masks_world_1():
    spawn_local(_worker, 1, [(1, 1)])


def test_masks_world_2():
    spawn_local(_worker, 2, [(2, 1), (1, 2)])


def test_masks_world_4():
    spawn_local(_worker, 4, [(2, 2), (4, 1), (1, 4)])
