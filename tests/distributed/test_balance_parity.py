"""``balance="per_document"`` (``DocumentLayout``) across ulysses x ring, against fp64 dense
attention with the document mask (out, dq, dk, dv within 2e-5, fp32).

Rows: one long document, many short ones (one-token documents among them), documents
longer than L/r next to ones shorter than 2r; B=3 with different documents per row (a
ring pass per row) and B=2 with the same documents (one pass); MHA, GQA and MQA; sliding
windows shorter than a part and longer than a segment; one-token documents, where the
ring drops every hop. Layouts (1,4), (2,2) on 4 ranks and
(2,4), (1,8) on 8.
"""

import torch
import torch.distributed as dist

from usp import SPMesh, usp_attention
from usp.dims.balance import doc_lengths
from usp.launch import spawn_local
from usp.layout import DocumentLayout

from _cases import TOL, _errors, dense_reference

L = 64
ROWS = [
    (64,),  # one long document
    doc_lengths([3, 4, 9, 10, 11, 20, 27, 28, 40, 41, 47, 55, 63], L),  # many short
    (37, 3, 1, 2, 21),  # longer than L/r = 16, and shorter than 2r
]
CASES = [dict(rows=ROWS, hq=4, hkv=2, window=None), dict(rows=ROWS, hq=4, hkv=1, window=5),
         dict(rows=ROWS[1:], hq=4, hkv=4, window=20),
         dict(rows=[ROWS[2], ROWS[2]], hq=4, hkv=2, window=100),
         dict(rows=[(1,) * L] * 2, hq=2, hkv=1, window=None)]  # every hop dropped


def _ids(rows):
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r))
                        for r in rows])


def _check(mesh, seed, rows, hq, hkv, window, d=8):
    gen = torch.Generator().manual_seed(seed)
    b = len(rows)
    q, dout = (torch.randn(b, L, hq, d, generator=gen) for _ in range(2))
    k, v = (torch.randn(b, L, hkv, d, generator=gen) for _ in range(2))
    ids = _ids(rows)
    ref = dense_reference(q, k, v, dout, True, ids, window)
    layout = DocumentLayout(mesh, rows)
    ql, kl, vl = (layout.shard(t).requires_grad_() for t in (q, k, v))
    mesh.comm.reset()
    out = usp_attention(ql, kl, vl, mesh=mesh, layout=layout, segment_ids=layout.shard(ids),
                        window=window)
    out.backward(layout.shard(dout))
    ring = mesh.ring
    got = [layout.gather(t.detach()) for t in (out, ql.grad, kl.grad, vl.grad)]
    if all(n == 1 for n in rows[0]):  # one pass, nothing to see on another rank
        assert mesh.comm.hops_dropped == {"forward": ring - 1, "backward": ring - 1}
        assert mesh.comm.bytes["ring"] == 0
    errs = _errors(got, ref)
    assert all(e <= TOL[torch.float32] for _, e in errs), (mesh.ulysses, mesh.ring, seed, errs)
    # every rank holds its rows' L/P tokens: the positions are a permutation per row
    pos = layout.gather(layout.positions())
    assert torch.equal(pos.sort(1).values, torch.arange(L).expand(b, L))
    return mesh.comm.kernel_pairs


def _worker(layouts):
    for ulysses, ring in layouts:
        with SPMesh.build(ulysses=ulysses, ring=ring, ranks_per_node=ulysses) as mesh:
            for seed, case in enumerate(CASES):
                _check(mesh, seed, **case)
    dist.barrier()


def test_per_document_world_4():
    spawn_local(_worker, 4, [(1, 4), (2, 2)])


def test_per_document_world_8():
    spawn_local(_worker, 8, [(2, 4), (1, 8)])
