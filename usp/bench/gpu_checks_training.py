"""The GPU check's training and speed sections: the trainer on one device, and timings.

- ``check_training``: the trainer on one GPU (NCCL, world 1), bf16 and fp32, with and without
  activation checkpointing: the loss falls and the metrics are finite and in range; then
  ``check_state_offload``: three AdamW steps with ``trainer.state_offload``'s FSDP2 CPU
  offload give the losses of steps without it, the state in host memory, on CUDA with a
  lower peak; on CUDA also ``check_offload``: activation offload gives the same gradients
  with a lower peak.
- ``check_throughput``: bf16 fwd+bwd of our kernel path vs the bare SDPA flash kernel on the
  same shapes (our overhead as a ratio), and the MFU of a 1B-class model shape.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..attention import local_attention
from .gpu_checks_attention import randn
from .gpu_sizes import Sizes

H200_BF16_PEAK = 989e12  # dense bf16 tensor-core FLOP/s, NVIDIA's H200 SXM datasheet


# ---- 4. training --------------------------------------------------------------------------
def _train_once(dtype: str, ckpt: bool, sizes: Sizes, run_dir: str, device_type: str) -> dict:
    from ..config import (LoggingConfig, ModelConfig, ParallelConfig, RecallData, RunConfig,
                          TrainerConfig)
    from ..train.phase_runner import train

    cfg = RunConfig(
        model=ModelConfig(vocab_size=320),
        parallel=ParallelConfig(ulysses_degree=1, ring_degree=1),
        data=RecallData(seq_len=sizes.train_seq_len, batch_per_dp_rank=8, eval_batches=1),
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
        rows.append(check_state_offload(device))
    finally:
        dist.destroy_process_group()
    if device.type == "cuda":
        rows.append(check_offload(device))
    return rows


def _decoder_case(device: torch.device, cuda_len: int):
    """(config, length, tokens, labels, positions) of the offload checks' decoder: 8 layers,
    dim 1024 and ``cuda_len`` tokens on CUDA, tiny on the CPU; the data seeded."""
    from ..config import ModelConfig

    cuda = device.type == "cuda"
    cfg = ModelConfig(vocab_size=512, dim=1024 if cuda else 32, n_layers=8, n_heads=8,
                      n_kv_heads=4, ffn_dim=2816 if cuda else 64)
    n = cuda_len if cuda else 48
    gen = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, cfg.vocab_size, (1, n), generator=gen).to(device)
                      for _ in range(2))
    return cfg, n, tokens, labels, torch.arange(n, device=device)


def check_offload(device: torch.device, copier=None) -> dict:
    """One fwd+bwd of a checkpointed decoder with and without ``ActivationOffload``: the
    gradients match (rel <= 1e-6, fp32) and nothing stays parked after backward; on CUDA
    the peak allocated memory is lower with offload. ``copier``: default ``StreamCopier``
    (CUDA); tests pass a plain one to run this on the CPU."""
    from functools import partial

    from ..models.families import builtin_model
    from ..models.offload import ActivationOffload, StreamCopier

    cuda = device.type == "cuda"
    cfg, n, tokens, labels, positions = _decoder_case(device, 8192)
    grads, peaks, held = [], [], 0
    for offload in (None, ActivationOffload(copier or StreamCopier(device))):
        model = builtin_model(cfg, partial(local_attention, causal=True, kernel="torch"),
                              checkpoint_activations=True, offload=offload).to(device)
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        loss, _ = model(tokens, positions, labels=labels)
        loss.backward()
        if cuda:
            torch.cuda.synchronize(device)
            peaks.append(torch.cuda.max_memory_allocated(device) / 2**20)
        grads.append({k: p.grad.detach().double() for k, p in model.named_parameters()})
        held = offload.held() if offload is not None else held
        del model, loss
    err = max(((grads[1][k] - g).norm() / g.norm().clamp(min=1e-30)).item()
              for k, g in grads[0].items())
    peak_plain, peak_offload = (round(p, 1) for p in peaks) if cuda else (None, None)
    lower = peak_offload < peak_plain if cuda else True
    return dict(what="activation offload fwd+bwd fp32", len=n, layers=cfg.n_layers,
                grads_match=err <= 1e-6, max_rel_err=err, held_after_backward=held,
                peak_mb_plain=peak_plain, peak_mb_offload=peak_offload,
                ok=err <= 1e-6 and held == 0 and lower)


def check_state_offload(device: torch.device, steps: int = 3) -> dict:
    """``steps`` AdamW steps (grad clipping as the trainer's) of a decoder FSDP2-sharded on a
    world-1 mesh of ``device`` (a process group exists), without and with the state offload
    (``usp.train.build.shard_model(state_offload=True)``): the losses match (rel <= 1e-5:
    AdamW on the host rounds unlike on the GPU); with it the sharded parameters and their
    gradients are host tensors, pinned on CUDA, and AdamW's state host tensors (pageable:
    ``zeros_like`` of a pinned tensor is not pinned); on CUDA the peak
    allocated memory is lower with it. On the CPU (the dry run) it runs the same path with
    unpinned host memory, where every tensor is a host tensor anyway."""
    from functools import partial

    from torch.distributed.device_mesh import init_device_mesh

    from ..models.families import builtin_model
    from ..train.build import shard_model
    from ..train.grads import clip_grad_norm

    cuda = device.type == "cuda"
    cfg, n, tokens, labels, positions = _decoder_case(device, 2048)
    mesh = init_device_mesh(device.type, (1,))
    losses, peaks, on_host = [], [], False

    def host(t, pinned: bool = True) -> bool:  # a DTensor's shard in (pinned) host memory
        local = t.to_local()
        return local.device.type == "cpu" and (local.is_pinned() or not (cuda and pinned))

    for offload in (False, True):
        torch.manual_seed(0)
        model = builtin_model(cfg, partial(local_attention, causal=True, kernel="torch"))
        shard_model(model.to(device), mesh, "fp32", state_offload=offload)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        run = []
        for _ in range(steps):
            loss, _ = model(tokens, positions, labels=labels)
            loss.backward()
            clip_grad_norm(model.parameters(), 1.0, host=offload)
            grads = all(host(p.grad) for p in model.parameters())
            opt.step()
            opt.zero_grad()
            run.append(loss.item())
        if cuda:
            torch.cuda.synchronize(device)
            peaks.append(torch.cuda.max_memory_allocated(device) / 2**20)
        if offload:
            state = [t for st in opt.state.values() for t in st.values() if t.dim() > 0]
            on_host = (grads and all(host(p) for p in model.parameters())
                       and bool(state) and all(host(t, pinned=False) for t in state))
        losses.append(run)
        del model, opt
    err = max(abs(b - a) / abs(a) for a, b in zip(*losses))
    peak_plain, peak_offload = (round(p, 1) for p in peaks) if cuda else (None, None)
    lower = peak_offload < peak_plain if cuda else True
    return {"what": "state offload (FSDP2 CPU offload) AdamW steps fp32", "len": n,
            "layers": cfg.n_layers, "steps": steps, "losses_match": err <= 1e-5,
            "max_rel_err": err, "state_on_host": on_host, "peak_mb_plain": peak_plain,
            "peak_mb_offload": peak_offload, "ok": err <= 1e-5 and on_host and lower}


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
    q = randn((1, L, hq, d), gen, device, dtype).requires_grad_()
    k, v = (randn((1, L, hkv, d), gen, device, dtype).requires_grad_() for _ in range(2))
    dout = randn((1, L, hq, d), gen, device, dtype)

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
    from ..models.families import builtin_model

    cfg = ModelConfig(vocab_size=32000, dim=2048, n_layers=2, n_heads=16, n_kv_heads=8,
                      ffn_dim=5632)
    if device.type == "cpu":
        cfg = ModelConfig(vocab_size=512, dim=128, n_layers=1, n_heads=4, n_kv_heads=2,
                          ffn_dim=256)
    model = builtin_model(cfg, partial(local_attention, causal=True, kernel="torch")).to(device)
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
