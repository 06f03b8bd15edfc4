"""The GPU check's exactness sections: usp's attention paths against fp64 dense attention.

- ``check_kernels``: the ``torch`` kernel (aten flash op for bf16, efficient op for fp32) vs
  fp64 math: Hq/Hkv 8/8, 8/2, 4/1, the sizes' head dims and lengths, causal and not, whole
  tensors and the strided halves the ring passes; out, LSE, dq, dk, dv.
- ``check_ring``: ``ring_forward``/``ring_backward`` on the real kernels over an in-process
  ring of threads (r = 2, 4; zigzag and contiguous; causal and not), gathered and compared
  with dense attention; and with the backward's calls forced into one-head groups
  (``usp.dims.work``) at r = 1, 2.
- ``check_usp_attention``: 4 processes sharing the device over gloo (usp's comm stages CUDA
  tensors through the CPU for gloo), layouts (2,2), (1,4), (4,1), GQA with KV replication,
  fp32 and bf16; with 8/2 heads, (2,2) and (4,1) also with the all-to-alls pipelined in 2
  stages (``a2a_chunks=2``).

Tolerances: fp32 errors <= 2e-5 (absolute, as in the CPU tests). bf16 follows the
flash-attention convention: an error at most ``factor`` times the error of the same math done
naively in bf16 (kernels), or of the single-process bf16 kernel on the whole sequence
(distributed paths), plus 1e-5.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from ..attention import local_attention
from ..dims import work
from ..dims.tokens import position_tensor, segment_ranges
from ..kernels import get_kernel
from ..kernels.reference import ReferenceKernel
from ..layout import SequenceLayout
from ..ring import RingPlan, ring_backward, ring_forward
from .gpu_sizes import Sizes

NAMES = ("out", "dq", "dk", "dv")


# ---- numerics -----------------------------------------------------------------------------
def _max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.double() - want.double()).abs().max().item()


def _bound(dtype: torch.dtype, baseline: float, factor: float = 2.0) -> float:
    """The largest error accepted: absolute 2e-5 in fp32; in bf16, relative to a baseline."""
    return 2e-5 if dtype == torch.float32 else factor * baseline + 1e-5


def _reference(q, k, v, dout, causal, scale):
    """fp64 dense attention: (out, lse, dq, dk, dv) with the reference kernel's math."""
    ref = ReferenceKernel()
    q, k, v, dout = (t.double() for t in (q, k, v, dout))
    out, lse = ref.forward(q, k, v, causal, scale)
    return (out, lse, *ref.backward(dout, q, k, v, out, lse, causal, scale))


def _naive(q, k, v, dout, causal, scale):
    """The same attention computed naively in the inputs' dtype (matmuls in that dtype)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    g = q.shape[2] // k.shape[2]
    ke, ve = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    s = torch.einsum("bshd,bkhd->bhsk", q, ke) * scale  # [B, H, S, Sk] in q.dtype
    if causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s.float(), -1)
    p = torch.softmax(s.float(), -1).to(q.dtype)
    out = torch.einsum("bhsk,bkhd->bshd", p, ve)
    out.backward(dout)
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def randn(shape, gen, device, dtype) -> torch.Tensor:
    """``torch.randn`` drawn on the CPU from ``gen`` (same numbers on every device), moved."""
    return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)


# ---- 1. kernels ---------------------------------------------------------------------------
def check_kernels(device: torch.device, sizes: Sizes) -> list[dict]:
    """The ``torch`` kernel's forward and backward on whole and strided blocks vs fp64."""
    kern = get_kernel("torch")
    rows = []
    grid = itertools.product((torch.bfloat16, torch.float32), ((8, 8), (8, 2), (4, 1)),
                             sizes.head_dims, sizes.kernel_lens, (True, False), (False, True))
    for dtype, (hq, hkv), d, s, causal, strided in grid:
        gen = torch.Generator().manual_seed(s * 31 + d + hq + hkv)
        q = randn((2, s, hq, d), gen, device, dtype)
        k, v = (randn((2, s, hkv, d), gen, device, dtype) for _ in range(2))
        dout = randn((2, s, hq, d), gen, device, dtype)
        scale = d ** -0.5
        if strided:  # as the ring passes them: the second half of the queries, first of keys
            h = s // 2
            q, dout, k, v, causal = q[:, h:], dout[:, h:], k[:, :h], v[:, :h], False
        out, lse = kern.forward(q, k, v, causal, scale)
        # backward as the ring calls it: the (final) out and lse of the rows, lse strided
        lse_in = lse if not strided else torch.cat([lse, lse], -1)[..., : lse.shape[-1]]
        grads = kern.backward(dout, q, k, v, out, lse_in, causal, scale)
        got = (out, lse, *grads)
        ref = _reference(q, k, v, dout, causal, scale)
        base = _naive(q, k, v, dout, causal, scale)
        errs = {n: _max_err(g, r) for n, g, r in zip(("out", "lse") + NAMES[1:], got, ref)}
        bases = {n: _max_err(b, r) for n, b, r in zip(("out", "lse") + NAMES[1:], base, ref)}
        shape_ok = (out.shape == q.shape and out.dtype == dtype and lse.dtype == torch.float32
                    and tuple(lse.shape) == (q.shape[0], hq, q.shape[1])
                    and grads[1].shape == k.shape and grads[2].shape == v.shape)
        factor = {n: 2.0 if n in ("out", "lse") else 3.0 for n in errs}
        ok = shape_ok and all(errs[n] <= _bound(dtype, bases[n], factor[n]) for n in errs)
        rows.append(dict(dtype=str(dtype).split(".")[-1], hq=hq, hkv=hkv, d=d, len=s,
                         causal=causal, strided=strided, ok=ok, shape_ok=shape_ok,
                         err={n: float(f"{e:.3g}") for n, e in errs.items()},
                         naive_err={n: float(f"{e:.3g}") for n, e in bases.items()}))
    return rows


# ---- 2. ring over threads -----------------------------------------------------------------
class ThreadRing:
    """An in-process ring of ``size`` ranks run as threads (a stand-in for ``RingComm``).

    ``comm(i)`` has the ``RingComm`` interface: ``start(send, tag)`` hands a copy of ``send``
    to rank i+1 and returns a handle whose ``wait()`` gives what rank i-1 sent, in order.
    """

    def __init__(self, size: int):
        self.size = size
        self._boxes = {(r, t): queue.Queue() for r in range(size) for t in (0, 1)}

    def comm(self, rank: int) -> _ThreadComm:
        return _ThreadComm(self, rank)


class _ThreadComm:
    def __init__(self, ring: ThreadRing, rank: int):
        self.ring, self.rank = ring, rank

    def start(self, send: torch.Tensor, tag: int = 0):
        self.ring._boxes[((self.rank + 1) % self.ring.size, tag)].put(send.clone())
        return SimpleNamespace(wait=lambda: self.ring._boxes[(self.rank, tag)].get(timeout=120))


def _run_ring(q, k, v, dout, r, causal, balance, kern, scale):
    """Global tensors [B, L, H, d] -> (out, dq, dk, dv) via r threads running the ring."""
    idx = [position_tensor(segment_ranges(q.shape[1], r, balance, i)).to(q.device)
           for i in range(r)]
    ring, results, errors = ThreadRing(r), [None] * r, []

    def rank_fn(i):
        try:
            qi, ki, vi, di = (t.index_select(1, idx[i]) for t in (q, k, v, dout))
            comm = ring.comm(i)
            plan = RingPlan(i, r, qi.shape[1], causal, balance)
            out, lse = ring_forward(qi, ki, vi, comm, plan, kern, scale)
            grads = ring_backward(di, qi, ki, vi, out, lse, comm, plan, kern, scale)
            results[i] = (out, *grads)
        except BaseException as e:  # re-raised in the caller
            errors.append(e)

    threads = [threading.Thread(target=rank_fn, args=(i,)) for i in range(r)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    full = []
    for j, like in enumerate((q, q, k, v)):
        g = torch.empty_like(like)
        for i in range(r):
            g.index_copy_(1, idx[i], results[i][j])
        full.append(g)
    return full


def check_ring(device: torch.device, sizes: Sizes) -> list[dict]:
    """The ring's block plan and merge on the real kernels, against dense attention; with
    ``groups`` the backward's kernel calls forced to one query head each
    (``usp.dims.work.CALL_BYTES`` = 1: the strided head slices the flash op then gets),
    on the ring and on the one-call path (ring 1)."""
    kern, rows = get_kernel("torch"), []
    cases = [(*c, False) for c in itertools.product(
        (torch.bfloat16, torch.float32), (2, 4), ("zigzag", "contiguous"), (True, False))]
    cases += [(*c, True) for c in itertools.product(
        (torch.bfloat16, torch.float32), (1, 2), ("zigzag",), (True, False))]
    for dtype, r, balance, causal, groups in cases:
        L, hq, hkv, d = sizes.ring_len, 8, 2, sizes.head_dims[0]
        gen = torch.Generator().manual_seed(r * 7 + L)
        q, dout = (randn((1, L, hq, d), gen, device, dtype) for _ in range(2))
        k, v = (randn((1, L, hkv, d), gen, device, dtype) for _ in range(2))
        scale = d ** -0.5
        ref = _reference(q, k, v, dout, causal, scale)
        ref = (ref[0], *ref[2:])
        limit = work.CALL_BYTES
        work.CALL_BYTES = 1 if groups else limit
        try:
            got = _run_ring(q, k, v, dout, r, causal, balance, kern, scale)
        finally:
            work.CALL_BYTES = limit
        single = _single_process(q, k, v, dout, causal, scale)
        errs = {n: _max_err(g, w) for n, g, w in zip(NAMES, got, ref)}
        base = {n: _max_err(g, w) for n, g, w in zip(NAMES, single, ref)}
        ok = all(errs[n] <= _bound(dtype, base[n]) for n in NAMES)
        rows.append(dict(dtype=str(dtype).split(".")[-1], ring=r, balance=balance,
                         causal=causal, head_groups=groups, ok=ok,
                         err={n: float(f"{e:.3g}") for n, e in errs.items()},
                         single_err={n: float(f"{e:.3g}") for n, e in base.items()}))
    return rows


def _single_process(q, k, v, dout, causal, scale):
    """The torch kernel on the whole sequence in one call: the baseline error in bf16."""
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = local_attention(qs, ks, vs, causal=causal, kernel="torch", scale=scale)
    out.backward(dout)
    return out.detach(), qs.grad, ks.grad, vs.grad


# ---- 3. usp_attention on processes sharing the GPU ----------------------------------------
LAYOUTS = ((2, 2), (1, 4), (4, 1))
PIPELINED = ((2, 2), (4, 1))  # also run with a2a_chunks=2 where the heads allow it (8/2)


def _usp_worker(device_name: str, seq_len: int, d: int, result_path: str) -> None:
    from ..attention import usp_attention
    from ..mesh import SPMesh

    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(0)  # every process shares the one GPU
    rows = []
    cases = [(lay, heads, dtype, c) for lay, heads, dtype in itertools.product(
        LAYOUTS, ((8, 2), (4, 4)), (torch.float32, torch.bfloat16))
        for c in ((1, 2) if lay in PIPELINED and heads == (8, 2) else (1,))]
    for (u, r), (hq, hkv), dtype, chunks in cases:
        mesh = SPMesh.build(ulysses=u, ring=r, ranks_per_node=u)  # closed below
        layout = SequenceLayout(mesh, seq_len=seq_len, balance="zigzag")
        gen = torch.Generator().manual_seed(u * 10 + r + hq)
        q, dout = (randn((2, seq_len, hq, d), gen, device, dtype) for _ in range(2))
        k, v = (randn((2, seq_len, hkv, d), gen, device, dtype) for _ in range(2))
        scale = d ** -0.5
        ref = _reference(q, k, v, dout, True, scale)
        ref = (ref[0], *ref[2:])
        single = _single_process(q, k, v, dout, True, scale)
        ql, kl, vl = (layout.shard(t, dim=1).requires_grad_() for t in (q, k, v))
        mesh.comm.reset()
        out = usp_attention(ql, kl, vl, mesh=mesh, layout=layout, causal=True, kernel="torch",
                            a2a_chunks=chunks)
        out.backward(layout.shard(dout, dim=1))
        sent = dict(mesh.comm.bytes)
        got = [layout.gather(t.detach(), dim=1) for t in (out, ql.grad, kl.grad, vl.grad)]
        errs = {n: _max_err(g, w) for n, g, w in zip(NAMES, got, ref)}
        base = {n: _max_err(g, w) for n, g, w in zip(NAMES, single, ref)}
        ok = all(errs[n] <= _bound(dtype, base[n]) for n in NAMES) and got[0].dtype == dtype
        flags = torch.tensor([float(ok)])
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)  # a case passes only on every rank
        rows.append(dict(ulysses=u, ring=r, a2a_chunks=chunks, hq=hq, hkv=hkv,
                         dtype=str(dtype).split(".")[-1],
                         ok=bool(flags.item()), err={n: float(f"{e:.3g}") for n, e in errs.items()},
                         single_err={n: float(f"{e:.3g}") for n, e in base.items()},
                         bytes_rank0=sent))
        mesh.close()  # free its groups now, not at interpreter exit
    if dist.get_rank() == 0:
        Path(result_path).write_text(json.dumps(rows))


def check_usp_attention(device: torch.device, sizes: Sizes, nprocs: int = 4) -> list[dict]:
    """usp_attention on ``nprocs`` processes (gloo) sharing ``device``, vs fp64 dense."""
    from ..launch import spawn_local

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.json")
        spawn_local(_usp_worker, nprocs, device.type, sizes.usp_len, sizes.head_dims[0], path,
                    threads=max(1, (os.cpu_count() or 1) // nprocs))
        return json.loads(Path(path).read_text())
