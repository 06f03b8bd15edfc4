"""Attention sinks in ``usp_attention`` against fp64 dense attention with gpt-oss's formula
(softmax of [scores, sink], the sink column dropped): out, dq, dk, dv, and dsinks summed
over the SP group (each rank's ``sinks.grad`` is its share), fp32 within 2e-5.

Layouts (2,2), (1,4), (4,1) on 4 ranks and (3,2) on 6, one spawn per world size running
every case: zigzag and contiguous, causal and not, packed documents, sliding windows,
uneven head splits with ulysses > KV heads ((4,1) with 6 query heads, (3,2) with 4),
pipelined all-to-all stages, and ``per_document`` balance. In two cases per layout the
bytes each rank sends with sinks equal those without and the planner's formula
(``masked_attention_bytes``): sinks add nothing on the wire.
"""

import torch
import torch.distributed as dist

from usp import SequenceLayout, SPMesh, usp_attention
from usp.launch import spawn_local
from usp.layout import DocumentLayout
from usp.planner.traffic import masked_attention_bytes

from _cases import TOL, draw, dense_reference

L, D = 48, 8
HEADS = {(2, 2): [(4, 2), (3, 1)], (1, 4): [(4, 2), (4, 1)], (4, 1): [(6, 2), (8, 2)],
         (3, 2): [(4, 2), (6, 3)]}  # per (ulysses, ring): the second divides into 2 stages
CASES = [  # (usp_attention keywords, heads index); docs: packed documents
    (dict(balance="zigzag", traffic=True), 0),
    (dict(balance="contiguous", window=5, docs=True, traffic=True), 0),
    (dict(balance="zigzag", docs=True, window=20), 1),
    (dict(balance="contiguous", causal=False, window=7), 1),
    (dict(balance="zigzag", causal=False), 0),
    (dict(balance="zigzag", a2a_chunks=2, docs=True), 1),
    (dict(balance="contiguous", a2a_chunks=2, window=9), 1),
    (dict(balance="per_document", rows=[(48,), (20, 3, 1, 2, 22)]), 0),
    (dict(balance="per_document", rows=[(20, 3, 1, 2, 22)] * 2, window=5), 1),
]


def _call(mesh, layout, inputs, sinks, kw):
    """Sharded usp_attention with ``sinks`` (or None): the gathered (out, dq, dk, dv), the
    sinks' gradient summed over the SP group, and the bytes sent (forward, backward)."""
    q, k, v, dout, ids = inputs
    ql, kl, vl = (layout.shard(t, dim=1).requires_grad_() for t in (q, k, v))
    s = None if sinks is None else sinks.clone().requires_grad_()
    seg = None if ids is None else layout.shard(ids, dim=1)
    mesh.comm.reset()
    out = usp_attention(ql, kl, vl, mesh=mesh, layout=layout, sinks=s, segment_ids=seg, **kw)
    fwd = dict(mesh.comm.bytes)
    mesh.comm.reset()
    out.backward(layout.shard(dout, dim=1))
    bwd = dict(mesh.comm.bytes)
    got = [layout.gather(t.detach(), dim=1) for t in (out, ql.grad, kl.grad, vl.grad)]
    if s is not None:
        ds = s.grad.clone()  # this rank's share
        dist.all_reduce(ds, group=mesh.group("sp"))
        got.append(ds)
    return got, (fwd, bwd)


def _check(mesh, seed, case, heads):
    case = dict(case)
    traffic, rows, docs = case.pop("traffic", False), case.pop("rows", None), case.pop("docs", False)
    balance, causal, window = case.pop("balance"), case.get("causal", True), case.get("window")
    hq, hkv = heads
    if rows is None:
        layout = SequenceLayout(mesh, seq_len=L, balance=balance)
        inputs = draw(2, L, hq, hkv, D, seed, docs, edge=L // (2 * mesh.sp_size))
    else:
        layout = DocumentLayout(mesh, rows)
        q, k, v, dout, _ = draw(len(rows), L, hq, hkv, D, seed)
        ids = torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r))
                           for r in rows])
        inputs = (q, k, v, dout, ids)
    sinks = 2 * torch.randn(hq, generator=torch.Generator().manual_seed(100 + seed))
    ref = dense_reference(*inputs[:4], causal, inputs[4], window, sinks)
    got, sent = _call(mesh, layout, inputs, sinks, case)
    errs = [(n, (g.double() - r).abs().max().item())
            for n, g, r in zip(("out", "dq", "dk", "dv", "dsinks"), got, ref)]
    where = (mesh.ulysses, mesh.ring, heads, balance, docs, rows is not None, case)
    assert all(e <= TOL[torch.float32] for _, e in errs), (where, errs)
    if traffic:
        _, plain = _call(mesh, layout, inputs, None, case)
        chunks = case.get("a2a_chunks", 1)
        planned = masked_attention_bytes(2, L, hq, hkv, D, mesh.ulysses, mesh.ring, 4,
                                         balance=balance, causal=causal, window=window,
                                         segment_ids=docs, rank=mesh.ulysses_rank,
                                         a2a_chunks=chunks)
        axes = ("ulysses", "ring", "sp")
        assert sent == plain, (where, sent, plain)
        assert tuple({a: b.get(a, 0) for a in axes} for b in sent) == planned, (where, sent)


def _worker(layouts):
    for ulysses, ring in layouts:
        with SPMesh.build(ulysses=ulysses, ring=ring, ranks_per_node=ulysses) as mesh:
            for seed, (case, h) in enumerate(CASES):
                _check(mesh, seed, case, HEADS[(ulysses, ring)][h])
    dist.barrier()


def test_sinks_world_4():
    spawn_local(_worker, 4, [(2, 2), (1, 4), (4, 1)])


def test_sinks_world_6():
    spawn_local(_worker, 6, [(3, 2)])
