"""The GPU check: every CUDA path of usp on one GPU, against fp64 dense attention.

Sections, each a list of rows (dicts with ``ok``):

1. ``kernels``: the ``torch`` kernel (aten flash op for bf16, efficient op for fp32) vs fp64
   math: Hq/Hkv 8/8, 8/2, 4/1, head dims 64 and 128, odd lengths, causal and not, whole
   tensors and the strided halves the ring passes; out, LSE, dq, dk, dv.
2. ``ring``: ``ring_forward``/``ring_backward`` on the real kernels over an in-process ring
   of threads (r = 2, 4; zigzag and contiguous; causal and not), gathered and compared with
   dense attention.
3. ``usp_attention``: 4 processes sharing the GPU over gloo (usp's comm stages CUDA tensors
   through the CPU for gloo), layouts (2,2), (1,4), (4,1), GQA with KV replication, fp32 and
   bf16.
4. ``training``: the trainer on one GPU (NCCL, world 1), bf16 and fp32, with and without
   activation checkpointing: the loss falls and the metrics are finite and in range.
5. ``throughput``: bf16 fwd+bwd of our kernel path vs the bare SDPA flash kernel on the same
   shapes (our overhead as a ratio), and the MFU of a 1B-class model shape.

Tolerances: fp32 errors <= 2e-5 (absolute, as in the CPU tests). bf16 follows the
flash-attention convention: an error at most ``factor`` times the error of the same math done
naively in bf16 (kernels), or of the single-process bf16 kernel on the whole sequence
(distributed paths), plus 1e-5.

``dry_run=True`` runs the same code on the CPU with tiny shapes (CI keeps it from rotting).
Imports only torch and usp (no Hydra, OmegaConf, wandb or flash-attn).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import platform
import queue
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from ..kernels import get_kernel, local_attention
from ..kernels.reference import ReferenceKernel
from ..layout import SequenceLayout
from ..ring import ring_backward, ring_forward

H200_BF16_PEAK = 989e12  # dense bf16 tensor-core FLOP/s, NVIDIA's H200 SXM datasheet
NAMES = ("out", "dq", "dk", "dv")


@dataclass
class Sizes:
    """Shapes per section: the real check and the CPU dry run differ only here."""

    kernel_lens: tuple = (33, 100, 256)
    head_dims: tuple = (64, 128)
    ring_len: int = 512
    usp_len: int = 256
    train_steps: int = 80
    train_seq_len: int = 512
    bench_len: int = 8192
    bench_iters: int = 20
    mfu_len: int = 8192

    @classmethod
    def dry(cls) -> "Sizes":
        return cls(kernel_lens=(33, 20), head_dims=(16,), ring_len=64, usp_len=64,
                   train_steps=40, train_seq_len=128, bench_len=256, bench_iters=2, mfu_len=256)


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


def _randn(shape, gen, device, dtype):
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
        q = _randn((2, s, hq, d), gen, device, dtype)
        k, v = (_randn((2, s, hkv, d), gen, device, dtype) for _ in range(2))
        dout = _randn((2, s, hq, d), gen, device, dtype)
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

    def comm(self, rank: int) -> "_ThreadComm":
        return _ThreadComm(self, rank)


class _ThreadComm:
    def __init__(self, ring: ThreadRing, rank: int):
        self.ring, self.rank = ring, rank

    def start(self, send: torch.Tensor, tag: int = 0):
        self.ring._boxes[((self.rank + 1) % self.ring.size, tag)].put(send.clone())
        return SimpleNamespace(wait=lambda: self.ring._boxes[(self.rank, tag)].get(timeout=120))


def _run_ring(q, k, v, dout, r, causal, balance, kern, scale):
    """Global tensors [B, L, H, d] -> (out, dq, dk, dv) via r threads running the ring."""
    layout = SequenceLayout(SimpleNamespace(ulysses=1, ring=r, sp_size=r), q.shape[1], balance)
    idx = [layout.segment_indices(i).to(q.device) for i in range(r)]
    ring, results, errors = ThreadRing(r), [None] * r, []

    def rank_fn(i):
        try:
            qi, ki, vi, di = (t.index_select(1, idx[i]) for t in (q, k, v, dout))
            comm = ring.comm(i)
            out, lse = ring_forward(qi, ki, vi, comm, i, r, causal, balance, kern, scale)
            grads = ring_backward(di, qi, ki, vi, out, lse, comm, i, r, causal, balance, kern,
                                  scale)
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
    """The ring's block plan and merge on the real kernels, against dense attention."""
    kern, rows = get_kernel("torch"), []
    for dtype, r, balance, causal in itertools.product(
        (torch.bfloat16, torch.float32), (2, 4), ("zigzag", "contiguous"), (True, False)
    ):
        L, hq, hkv, d = sizes.ring_len, 8, 2, sizes.head_dims[0]
        gen = torch.Generator().manual_seed(r * 7 + L)
        q, dout = (_randn((1, L, hq, d), gen, device, dtype) for _ in range(2))
        k, v = (_randn((1, L, hkv, d), gen, device, dtype) for _ in range(2))
        scale = d ** -0.5
        ref = _reference(q, k, v, dout, causal, scale)
        ref = (ref[0], *ref[2:])
        got = _run_ring(q, k, v, dout, r, causal, balance, kern, scale)
        single = _single_process(q, k, v, dout, causal, scale)
        errs = {n: _max_err(g, w) for n, g, w in zip(NAMES, got, ref)}
        base = {n: _max_err(g, w) for n, g, w in zip(NAMES, single, ref)}
        ok = all(errs[n] <= _bound(dtype, base[n]) for n in NAMES)
        rows.append(dict(dtype=str(dtype).split(".")[-1], ring=r, balance=balance,
                         causal=causal, ok=ok, err={n: float(f"{e:.3g}") for n, e in errs.items()},
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


def _usp_worker(device_name: str, seq_len: int, d: int, result_path: str) -> None:
    from ..attention import usp_attention
    from ..mesh import SPMesh

    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(0)  # every process shares the one GPU
    rows = []
    for (u, r), (hq, hkv), dtype in itertools.product(
        LAYOUTS, ((8, 2), (4, 4)), (torch.float32, torch.bfloat16)
    ):
        mesh = SPMesh.build(ulysses=u, ring=r, ranks_per_node=u)  # closed below
        layout = SequenceLayout(mesh, seq_len=seq_len, balance="zigzag")
        gen = torch.Generator().manual_seed(u * 10 + r + hq)
        q, dout = (_randn((2, seq_len, hq, d), gen, device, dtype) for _ in range(2))
        k, v = (_randn((2, seq_len, hkv, d), gen, device, dtype) for _ in range(2))
        scale = d ** -0.5
        ref = _reference(q, k, v, dout, True, scale)
        ref = (ref[0], *ref[2:])
        single = _single_process(q, k, v, dout, True, scale)
        ql, kl, vl = (layout.shard(t, dim=1).requires_grad_() for t in (q, k, v))
        mesh.comm.reset()
        out = usp_attention(ql, kl, vl, mesh=mesh, layout=layout, causal=True, kernel="torch")
        out.backward(layout.shard(dout, dim=1))
        sent = dict(mesh.comm.bytes)
        got = [layout.gather(t.detach(), dim=1) for t in (out, ql.grad, kl.grad, vl.grad)]
        errs = {n: _max_err(g, w) for n, g, w in zip(NAMES, got, ref)}
        base = {n: _max_err(g, w) for n, g, w in zip(NAMES, single, ref)}
        ok = all(errs[n] <= _bound(dtype, base[n]) for n in NAMES) and got[0].dtype == dtype
        flags = torch.tensor([float(ok)])
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)  # a case passes only on every rank
        rows.append(dict(ulysses=u, ring=r, hq=hq, hkv=hkv, dtype=str(dtype).split(".")[-1],
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


# ---- 4. training --------------------------------------------------------------------------
def _train_once(dtype: str, ckpt: bool, sizes: Sizes, run_dir: str, device_type: str) -> dict:
    from ..config import DataConfig, LoggingConfig, ModelConfig, ParallelConfig, TrainerConfig
    from ..train.trainer import RunConfig, train

    cfg = RunConfig(
        model=ModelConfig(vocab_size=320),
        parallel=ParallelConfig(ulysses_degree=1, ring_degree=1),
        data=DataConfig(seq_len=sizes.train_seq_len, batch_size=8, eval_batches=1),
        trainer=TrainerConfig(steps=sizes.train_steps, dtype=dtype, log_every=0,
                              activation_checkpointing=ckpt, run_dir=run_dir,
                              nprocs=1, device=device_type),
        logging=LoggingConfig(wandb="disabled", progress=False, plot=False),
    )
    cfg.optim.warmup_steps = 10
    t0 = time.perf_counter()
    summary = train(cfg)
    wall = time.perf_counter() - t0
    recs = [json.loads(ln) for ln in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in recs]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    finite = all(math.isfinite(r[key]) for r in recs for key in ("loss", "grad_norm"))
    sane = all(r["tokens_per_s"] > 0 and r["peak_mem_mb"] > 0 and 0 <= r["attn_comm_share"] <= 1
               for r in recs)
    return dict(dtype=dtype, activation_checkpointing=ckpt, steps=len(recs),
                loss_first5=round(first, 4), loss_last5=round(last, 4),
                tokens_per_s=round(sorted(r["tokens_per_s"] for r in recs)[len(recs) // 2]),
                peak_mem_mb=round(max(r["peak_mem_mb"] for r in recs), 1),
                eval_acc=summary.get("eval_acc"), wall_s=round(wall, 1),
                ok=finite and sane and last < 0.8 * first)


def check_training(device: torch.device, sizes: Sizes) -> list[dict]:
    """The trainer in this process on a world of 1 (NCCL on CUDA, gloo on the CPU)."""
    from ..launch import free_port

    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}",
                            rank=0, world_size=1)
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i, (dtype, ckpt) in enumerate(itertools.product(("bf16", "fp32"), (False, True))):
                rows.append(_train_once(dtype, ckpt, sizes, os.path.join(tmp, str(i)),
                                        device.type))
    finally:
        dist.destroy_process_group()
    return rows


# ---- 5. throughput ------------------------------------------------------------------------
def _time_ms(fn, iters: int, device: torch.device) -> float:
    """Median milliseconds of ``fn()`` after 3 warm-ups (CUDA events on the GPU)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def check_throughput(device: torch.device, sizes: Sizes) -> list[dict]:
    """Our kernel path vs the bare SDPA kernel (bf16 fwd+bwd), and a 1B-class model's MFU."""
    import torch.nn.functional as F

    dtype = torch.bfloat16
    L, hq, hkv, d = sizes.bench_len, 16, 8, 128
    gen = torch.Generator().manual_seed(0)
    q = _randn((1, L, hq, d), gen, device, dtype).requires_grad_()
    k, v = (_randn((1, L, hkv, d), gen, device, dtype).requires_grad_() for _ in range(2))
    dout = _randn((1, L, hq, d), gen, device, dtype)

    def ours():
        local_attention(q, k, v, causal=True, kernel="torch").backward(dout)

    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))  # [B, H, L, d]
    dt = dout.transpose(1, 2)
    # KV heads expanded once, outside the timing, for a build whose flash SDPA lacks GQA
    ke, ve = (t.detach().repeat_interleave(hq // hkv, 1).requires_grad_() for t in (kt, vt))

    def bare(gqa: bool):
        if device.type == "cuda":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                bare_call(gqa)
        else:
            bare_call(gqa)

    def bare_call(gqa: bool):
        if gqa:
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(qt, ke, ve, is_causal=True)
        out.backward(dt)

    try:
        bare(True)
        gqa = "native"
    except RuntimeError:  # no flash kernel for enable_gqa in this torch build
        gqa = "expanded"
    ms_ours = _time_ms(ours, sizes.bench_iters, device)
    ms_bare = _time_ms(lambda: bare(gqa == "native"), sizes.bench_iters, device)
    attn_flops = 4 * hq * d * L * (L + 1) / 2 * 3.5  # fwd 4*H*d per pair (causal), bwd 2.5x
    rows = [dict(what="attention fwd+bwd bf16", len=L, heads=f"{hq}/{hkv}", head_dim=d,
                 usp_ms=round(ms_ours, 3), bare_sdpa_ms=round(ms_bare, 3), bare_gqa=gqa,
                 ratio=round(ms_ours / ms_bare, 3), usp_tflops=round(attn_flops / ms_ours / 1e9, 1),
                 ok=math.isfinite(ms_ours) and ms_ours > 0)]
    rows.append(_mfu_row(device, sizes))
    return rows


def _mfu_row(device: torch.device, sizes: Sizes) -> dict:
    """fwd+bwd of a 1B-class decoder shape (dim 2048, 16/8 heads, SwiGLU 5632, 2 layers)."""
    from functools import partial

    from ..config import ModelConfig
    from ..model import Transformer

    cfg = ModelConfig(vocab_size=32000, dim=2048, n_layers=2, n_heads=16, n_kv_heads=8,
                      ffn_dim=5632)
    if device.type == "cpu":
        cfg = ModelConfig(vocab_size=512, dim=128, n_layers=1, n_heads=4, n_kv_heads=2,
                          ffn_dim=256)
    model = Transformer(cfg, partial(local_attention, causal=True, kernel="torch")).to(device)
    L = sizes.mfu_len
    tokens = torch.randint(0, cfg.vocab_size, (1, L), device=device)
    positions = torch.arange(L, device=device)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(tokens, positions)
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()

    ms = _time_ms(step, max(2, sizes.bench_iters // 4), device)
    flops = model.flops_per_token(L) * L
    peak = H200_BF16_PEAK if device.type == "cuda" else float("nan")
    return dict(what="model step fwd+bwd bf16 autocast", len=L, dim=cfg.dim, layers=cfg.n_layers,
                step_ms=round(ms, 2), tflops=round(flops / ms / 1e9, 1),
                mfu_vs_989=round(flops / (ms / 1e3) / peak, 3) if device.type == "cuda" else None,
                ok=math.isfinite(ms) and ms > 0)


# ---- the whole check ----------------------------------------------------------------------
SECTIONS = {
    "kernels": check_kernels,
    "ring": check_ring,
    "usp_attention": check_usp_attention,
    "training": check_training,
    "throughput": check_throughput,
}


def environment(device: torch.device) -> dict:
    env = dict(torch=torch.__version__, python=platform.python_version(), device=str(device))
    if device.type == "cuda":
        env.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda,
                   gpus=torch.cuda.device_count())
    return env


def run(dry_run: bool = False, sections=None, log=print) -> dict:
    """Run the named sections (all by default); returns the report (``ok`` overall)."""
    if not dry_run and not torch.cuda.is_available():
        raise ValueError("the GPU check needs CUDA; on a CPU run it with --dry-run")
    device = torch.device("cpu" if dry_run else "cuda", None if dry_run else 0)
    sizes = Sizes.dry() if dry_run else Sizes()
    names = list(SECTIONS) if sections is None else list(sections)
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        raise ValueError(f"unknown sections {unknown}; choose from {list(SECTIONS)}")
    report = dict(env=environment(device), dry_run=dry_run, sections={}, seconds={})
    for name in names:
        t0 = time.perf_counter()
        rows = SECTIONS[name](device, sizes)
        report["sections"][name] = rows
        report["seconds"][name] = round(time.perf_counter() - t0, 1)
        bad = sum(not r["ok"] for r in rows)
        log(f"[{name}] {len(rows) - bad}/{len(rows)} ok in {report['seconds'][name]} s")
    report["ok"] = all(r["ok"] for rows in report["sections"].values() for r in rows)
    return report


def summarize(report: dict) -> str:
    """A readable summary: per section the worst error against its bound, or the figures."""
    lines = [f"usp GPU check ({'dry run, CPU' if report['dry_run'] else 'CUDA'}): "
             + ", ".join(f"{k}={v}" for k, v in report["env"].items())]
    for name, rows in report["sections"].items():
        bad = [r for r in rows if not r["ok"]]
        lines.append(f"\n## {name}: {len(rows) - len(bad)}/{len(rows)} ok "
                     f"({report['seconds'][name]} s)")
        if name in ("kernels", "ring", "usp_attention"):
            for dtype in ("float32", "bfloat16"):
                sel = [r for r in rows if r["dtype"] == dtype]
                if not sel:
                    continue
                worst = {n: max(r["err"][n] for r in sel) for n in sel[0]["err"]}
                key = "naive_err" if name == "kernels" else "single_err"
                base = {n: max(r[key][n] for r in sel) for n in sel[0][key]}
                lines.append(f"  {dtype}: max error " + ", ".join(
                    f"{n} {worst[n]:.2e} (baseline {base[n]:.2e})" for n in worst))
        else:
            lines.extend("  " + json.dumps({k: v for k, v in r.items()}) for r in rows)
        lines.extend("  FAILED " + json.dumps(r) for r in bad if name != "training"
                     and name != "throughput")
    lines.append(f"\noverall: {'PASS' if report['ok'] else 'FAIL'}")
    return "\n".join(lines)
