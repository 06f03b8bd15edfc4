"""Shared helpers for the multi-process parity tests (imported by spawned workers)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import usp.ring
from usp import SequenceLayout, SPMesh, usp_attention
from usp.attention import local_attention
from usp.kernels.reference import ReferenceKernel

TOL = {torch.float32: 2e-5, torch.bfloat16: 6e-2}  # bf16: kernel-contract stand-ins only
BF16_FACTOR = 2.0  # distributed bf16 error <= this x the one-process bf16 kernel's error


def visible(seq_len, causal, segment_ids=None, window=None):
    """bool [B or 1, L, L]: query i sees key j (the masks' rule, written out densely)."""
    i, j = torch.arange(seq_len)[:, None], torch.arange(seq_len)[None, :]
    ok = (j <= i) if causal else torch.ones(seq_len, seq_len, dtype=torch.bool)
    if window is not None:
        ok = ok & ((i - j).abs() < window)
    ok = ok[None]
    if segment_ids is not None:
        ok = ok & (segment_ids[:, :, None] == segment_ids[:, None, :])
    return ok


def dense_reference(q, k, v, dout, causal, segment_ids=None, window=None, sinks=None):
    """fp64 single-process attention and its grads: (out, dq, dk, dv), and dsinks after
    them when ``sinks`` [Hq] are given (gpt-oss's eager formula: the softmax of [scores,
    sink], the sink column dropped)."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    g = q.shape[2] // k.shape[2]
    ke, ve = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    s = torch.einsum("bshd,bkhd->bhsk", q, ke) * q.shape[-1] ** -0.5
    ok = visible(q.shape[1], causal, segment_ids, window)[:, None]  # [B|1, 1, L, L]
    s = s.masked_fill(~ok, float("-inf"))
    if sinks is None:
        p = s.softmax(-1)
    else:
        sinks = sinks.detach().double().requires_grad_()
        col = sinks[None, :, None, None].expand(*s.shape[:3], 1)  # [B, H, L, 1]
        p = torch.cat([s, col], -1).softmax(-1)[..., :-1]
    out = torch.einsum("bhsk,bkhd->bshd", p, ve)
    out.backward(dout.double())
    grads = (out.detach(), q.grad, k.grad, v.grad)
    return grads if sinks is None else grads + (sinks.grad,)


def document_ids(batch, seq_len, gen, edge):
    """[B, L] long: row 0 packs random lengths (some of one token), row 1 has boundaries on
    multiples of ``edge`` (shard edges) and one token documents, row 2+ one document."""
    rows = []
    for b in range(batch):
        if b == 0:
            starts = torch.rand(seq_len, generator=gen) < 0.12
        elif b == 1:
            starts = torch.zeros(seq_len, dtype=torch.bool)
            starts[::edge] = True
            starts[edge // 2 :: 2 * edge] = True  # off the edge too
            starts[-1] = starts[-2] = True  # one token documents at the end
        else:
            starts = torch.zeros(seq_len, dtype=torch.bool)
        rows.append(torch.cumsum(starts.long(), 0) + 7 * b)  # rows use different ids
    return torch.stack(rows)


def draw(batch, seq_len, hq, hkv, d, seed, docs=False, edge=8):
    """(q, k, v, dout, segment_ids or None) for ``seed``, fp32 [B, L, H, d]."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq_len, hq, d, generator=gen)
    k = torch.randn(batch, seq_len, hkv, d, generator=gen)
    v = torch.randn(batch, seq_len, hkv, d, generator=gen)
    dout = torch.randn(batch, seq_len, hq, d, generator=gen)
    ids = document_ids(batch, seq_len, gen, edge) if docs else None
    return q, k, v, dout, ids


def _errors(got, ref):
    return [(name, (g.double() - r).abs().max().item())
            for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref)]


def single_process_errors(q, k, v, dout, ref, causal, dtype, kernel, ids=None, window=None):
    """(name, max abs error) of one-process attention in ``dtype`` against ``ref``."""
    ql, kl, vl = (t.to(dtype).requires_grad_() for t in (q, k, v))
    out = local_attention(ql, kl, vl, causal=causal, kernel=kernel, segment_ids=ids,
                          window=window)
    out.backward(dout.to(dtype))
    return _errors((out.detach(), ql.grad, kl.grad, vl.grad), ref)


class _MergeDtypes:
    """Records the accumulator dtypes ``usp.ring.merge`` is handed while installed."""

    def __init__(self):
        self.seen, self.real = set(), usp.ring.merge

    def __call__(self, out, lse, *blk):
        self.seen.add((out.dtype, lse.dtype))
        return self.real(out, lse, *blk)

    def __enter__(self):
        usp.ring.merge = self
        return self

    def __exit__(self, *exc):
        usp.ring.merge = self.real


def check_case(mesh: SPMesh, *, batch, seq_len, hq, hkv, d, causal, balance, dtype, kernel, seed,
               docs=False, window=None):
    """Run usp_attention on this mesh and compare out/dq/dk/dv with fp64 dense attention.

    fp32: each max abs error <= 2e-5. bf16: each <= BF16_FACTOR x the error of one-process
    attention with the same kernel in bf16 on the same inputs, and every merge accumulates
    in fp32. ``docs``: packed documents (``document_ids``); ``window``: sliding window.
    Returns the list of (name, max abs error); raises AssertionError past the bound.
    """
    q, k, v, dout, ids = draw(batch, seq_len, hq, hkv, d, seed, docs,
                              edge=max(1, seq_len // (2 * mesh.sp_size)))
    ref = dense_reference(q, k, v, dout, causal, ids, window)

    layout = SequenceLayout(mesh, seq_len=seq_len, balance=balance)
    ql, kl, vl = (layout.shard(t, dim=1).to(dtype).requires_grad_() for t in (q, k, v))
    seg = None if ids is None else layout.shard(ids, dim=1)
    with _MergeDtypes() as merges:
        out = usp_attention(ql, kl, vl, mesh=mesh, layout=layout, causal=causal, kernel=kernel,
                            segment_ids=seg, window=window)
        out.backward(layout.shard(dout, dim=1).to(dtype))
    got = [layout.gather(t.detach(), dim=1) for t in (out, ql.grad, kl.grad, vl.grad)]
    for name, g in zip(("out", "dq", "dk", "dv"), got):
        assert g.dtype == dtype, (name, g.dtype)
    assert not any(torch.isnan(g).any() for g in got), "NaN in a result"
    errs = _errors(got, ref)
    if dtype == torch.float32:
        bound = [TOL[dtype]] * 4
    else:
        assert merges.seen <= {(torch.float32, torch.float32)}, merges.seen  # fp32 merges
        single = single_process_errors(q, k, v, dout, ref, causal, dtype, kernel, ids, window)
        bound = [BF16_FACTOR * e for _, e in single]
    bad = [(n, e, b) for (n, e), b in zip(errs, bound) if not e <= b]
    assert not bad, (
        f"rank {dist.get_rank()} u={mesh.ulysses} r={mesh.ring} hq={hq} hkv={hkv} "
        f"causal={causal} {balance} {dtype} {kernel} docs={docs} window={window}: "
        f"(name, error, bound) {bad}"
    )
    return errs


def parity_worker(ulysses, ring, cases):
    mesh = SPMesh.build(ulysses=ulysses, ring=ring, ranks_per_node=max(1, ulysses))
    for i, case in enumerate(cases):
        check_case(mesh, seed=i, **case)
    dist.barrier()


def reference_kernel():
    return ReferenceKernel()
