"""Shared helpers for the multi-process parity tests (imported by spawned workers)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from usp import SequenceLayout, SPMesh, usp_attention
from usp.kernels.reference import ReferenceKernel

TOL = {torch.float32: 2e-5, torch.bfloat16: 6e-2}


def dense_reference(q, k, v, dout, causal):
    """fp64 single-process attention and its grads: (out, dq, dk, dv)."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    g = q.shape[2] // k.shape[2]
    ke, ve = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    s = torch.einsum("bshd,bkhd->bhsk", q, ke) * q.shape[-1] ** -0.5
    if causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
        s = s.masked_fill(~mask, float("-inf"))
    out = torch.einsum("bhsk,bkhd->bshd", s.softmax(-1), ve)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def check_case(mesh: SPMesh, *, batch, seq_len, hq, hkv, d, causal, balance, dtype, kernel, seed):
    """Run usp_attention on this mesh and compare out/dq/dk/dv with fp64 dense attention.

    Returns the list of (name, max abs error) and raises AssertionError past tolerance.
    """
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq_len, hq, d, generator=gen)
    k = torch.randn(batch, seq_len, hkv, d, generator=gen)
    v = torch.randn(batch, seq_len, hkv, d, generator=gen)
    dout = torch.randn(batch, seq_len, hq, d, generator=gen)
    ref = dense_reference(q, k, v, dout, causal)

    layout = SequenceLayout(mesh, seq_len=seq_len, balance=balance)
    ql, kl, vl = (layout.shard(t, dim=1).to(dtype).requires_grad_() for t in (q, k, v))
    out = usp_attention(ql, kl, vl, mesh=mesh, layout=layout, causal=causal, kernel=kernel)
    out.backward(layout.shard(dout, dim=1).to(dtype))
    got = [layout.gather(t.detach(), dim=1) for t in (out, ql.grad, kl.grad, vl.grad)]
    errs = []
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref):
        assert g.dtype == dtype, (name, g.dtype)
        errs.append((name, (g.double() - r).abs().max().item()))
    bad = [(n, e) for n, e in errs if not e <= TOL[dtype]]
    assert not bad, (
        f"rank {dist.get_rank()} u={mesh.ulysses} r={mesh.ring} hq={hq} hkv={hkv} "
        f"causal={causal} {balance} {dtype} {kernel}: {bad} > {TOL[dtype]}"
    )
    return errs


def parity_worker(ulysses, ring, cases):
    mesh = SPMesh.build(ulysses=ulysses, ring=ring, ranks_per_node=max(1, ulysses))
    for i, case in enumerate(cases):
        check_case(mesh, seed=i, **case)
    dist.barrier()


def reference_kernel():
    return ReferenceKernel()
