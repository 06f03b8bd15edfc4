"""The bytes one usp_attention call moves equal the formula, forward and backward."""

import torch
import torch.distributed as dist

from usp import SequenceLayout, SPMesh, usp_attention
from usp.launch import spawn_local


def expected_bytes(b, seq_len, hq, hkv, d, u, r, elem):
    """Bytes this rank sends per call, derived independently of the implementation.

    Ulysses (per rank, to the u-1 others): q,k,v in one all-to-all carrying Hq/u query
    heads and n = max(Hkv/u, 1) KV heads (x2 for K and V) per destination; the output back
    carries Hq/u heads. Backward mirrors both. Ring: r-1 hops of a K+V block [B, L/r, n, d]
    forward and backward, plus r-1 hops of the fp32 dK+dV accumulator in backward (each
    block's accumulator starts at the rank after its owner and ends at the owner).
    """
    P, n_kv = u * r, max(hkv // u, 1)
    n, s = seq_len // P, seq_len // r
    a2a_in = (u - 1) * b * n * (hq // u + 2 * n_kv) * d * elem
    a2a_out = (u - 1) * b * n * (hq // u) * d * elem
    kv_block = 2 * b * s * n_kv * d * elem
    fwd = {"ulysses": a2a_in + a2a_out, "ring": (r - 1) * kv_block}
    bwd = {
        "ulysses": a2a_out + a2a_in,
        "ring": (r - 1) * (kv_block + 2 * b * s * n_kv * d * 4),
    }
    return fwd, bwd


def _volume_worker():
    for u, r, hq, hkv, dtype in (
        (2, 2, 8, 2, torch.bfloat16),
        (4, 1, 8, 2, torch.float32),  # GQA with u > Hkv: KV replicated to 2 ranks each
        (4, 1, 4, 1, torch.bfloat16),  # MQA
        (1, 4, 4, 4, torch.float32),
    ):
        mesh = SPMesh.build(ulysses=u, ring=r)
        b, L, d = 2, 64, 8
        lay = SequenceLayout(mesh, seq_len=L)
        q = torch.randn(b, L // 4, hq, d, dtype=dtype, requires_grad=True)
        k = torch.randn(b, L // 4, hkv, d, dtype=dtype, requires_grad=True)
        v = torch.randn(b, L // 4, hkv, d, dtype=dtype, requires_grad=True)
        fwd, bwd = expected_bytes(b, L, hq, hkv, d, u, r, q.element_size())
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
    dist.barrier()


def test_comm_volume_matches_formula():
    spawn_local(_volume_worker, 4)


def test_formula_gqa_replication_counts_only_needed_heads():
    # Llama-3-8B-like: 32 q heads, 8 KV heads, u=8 -> each rank gets exactly 1 KV head
    fwd, _ = expected_bytes(1, 8 * 1024, 32, 8, 128, 8, 1, 2)
    per_dest = 1 * 1024 * (4 + 2 * 1) * 128 * 2
    assert fwd["ulysses"] == 7 * per_dest + 7 * 1024 * 4 * 128 * 2
