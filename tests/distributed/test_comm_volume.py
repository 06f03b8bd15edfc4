"""The bytes one usp_attention call moves equal the planner's formula
(``usp.planner.traffic``), forward and backward, on every rank: also when the heads do not
divide over the ulysses group and ranks send different amounts. GQA replication in the
formula: ``unit/test_comm_volume_formula.py``."""

import torch
import torch.distributed as dist

from usp import SequenceLayout, SPMesh, usp_attention
from usp.launch import spawn_local
from usp.planner.traffic import attention_bytes as expected_bytes


def _volume_worker():
    for u, r, hq, hkv, dtype in (
        (2, 2, 8, 2, torch.bfloat16),
        (4, 1, 8, 2, torch.float32),  # GQA with u > Hkv: KV replicated to 2 ranks each
        (4, 1, 4, 1, torch.bfloat16),  # MQA
        (1, 4, 4, 4, torch.float32),
        (4, 1, 6, 6, torch.bfloat16),  # uneven: 2, 2, 1, 1 query and KV heads
        (4, 1, 6, 2, torch.float32),  # uneven GQA: 2, 1, 2, 1 query heads, 1 KV head each
        (2, 2, 3, 1, torch.float32),  # uneven MQA with a ring
        (2, 2, 3, 3, torch.bfloat16),
    ):
        mesh = SPMesh.build(ulysses=u, ring=r)
        b, L, d = 2, 64, 8
        lay = SequenceLayout(mesh, seq_len=L)
        q = torch.randn(b, L // 4, hq, d, dtype=dtype, requires_grad=True)
        k = torch.randn(b, L // 4, hkv, d, dtype=dtype, requires_grad=True)
        v = torch.randn(b, L // 4, hkv, d, dtype=dtype, requires_grad=True)
        fwd, bwd = expected_bytes(b, L, hq, hkv, d, u, r, q.element_size(), mesh.ulysses_rank)
        mesh.comm.reset()
        out = usp_attention(q, k, v, mesh=mesh, layout=lay)
        got_fwd = {a: mesh.comm.bytes[a] for a in ("ulysses", "ring")}
        assert got_fwd == fwd, (u, r, hq, hkv, got_fwd, fwd)
        mesh.comm.reset()
        out.sum().backward()
        got_bwd = {a: mesh.comm.bytes[a] for a in ("ulysses", "ring")}
        assert got_bwd == bwd, (u, r, hq, hkv, got_bwd, bwd)
        # one fused all-to-all for q, k, v plus one for the output
        assert mesh.comm.calls["ulysses"] == (2 if u > 1 else 0)
        mesh.close()
    dist.barrier()


def test_comm_volume_matches_formula():
    spawn_local(_volume_worker, 4)


def test_formula_uneven_heads_per_rank():
    # 6 heads (MHA) on u=4: ranks hold 2, 2, 1, 1 heads. One head of one peer's chunk:
    token = 1 * (64 // 4) * 8 * 2
    per_rank = [expected_bytes(1, 64, 6, 6, 8, 4, 1, 2, rank=j) for j in range(4)]
    # forward, rank 0: q+k+v heads of its peers (6 to rank 1, 3 to ranks 2 and 3) + its 2
    # output heads to 3 peers = 18; rank 3: (6 + 6 + 3) + 3 x 1 = 18. Backward mirrors:
    # rank 0: output grads of peers' heads (2 + 1 + 1) + 3 x (2 + 2 + 2) = 22; rank 3: 5 + 9
    assert [f["ulysses"] for f, _ in per_rank] == [18 * token, 18 * token, 18 * token, 18 * token]
    assert [b["ulysses"] for _, b in per_rank] == [22 * token, 22 * token, 14 * token, 14 * token]
    fwd, bwd = expected_bytes(1, 64, 6, 6, 8, 4, 1, 2)  # the slowest rank
    assert fwd["ulysses"] == 18 * token and bwd["ulysses"] == 22 * token
