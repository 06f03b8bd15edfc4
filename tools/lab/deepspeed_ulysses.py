"""DeepSpeed-Ulysses as a peer for the attention benchmark (optional, CPU/gloo).

``deepspeed.sequence.layer.DistributedAttention`` over the whole default group, calling
usp's local kernel, so that a comparison with ``usp_attention`` differs only in the
sequence-parallel exchange. Imported lazily: nothing here needs DeepSpeed installed.
"""

from __future__ import annotations

import importlib
import os
from functools import partial

import torch
import torch.distributed as dist

from usp.attention import local_attention


def import_deepspeed():
    """Return DistributedAttention, or the reason it is unavailable (a string).

    DeepSpeed's comm backend builds a C++ shared-memory op on CPU when it starts; only its
    gloo all-to-all is needed, so ``build_shm_op`` is replaced by a no-op first.
    """
    # CPU/gloo only: name the accelerator instead of letting DeepSpeed probe for one (and
    # warn on every rank)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        ds_comm_torch = importlib.import_module("deepspeed.comm.torch")
        ds_comm_torch.build_shm_op = lambda: None
        import deepspeed.comm as ds_dist
        from deepspeed.sequence.layer import DistributedAttention
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel("WARNING")
        # the torch process group exists already: DeepSpeed only wraps it
        ds_dist.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    except Exception as e:  # ImportError, or a broken install
        return f"DeepSpeed is not usable ({type(e).__name__}: {e})"
    return DistributedAttention


def deepspeed_calls(DistributedAttention, seq_len: int, causal: bool):
    """(shard, call, gather) of DeepSpeed-Ulysses over all ranks, for [B, L, H, d] inputs.

    ``shard``: [B, L, H, d] -> this rank's contiguous [B, L/N, H, d] leaf;
    ``call(q, k, v)``: the attention output [B, L/N, Hq, d];
    ``gather``: [B, L/N, H, d] -> [B, L, H, d] (collective).
    """
    n, rank = dist.get_world_size(), dist.get_rank()
    # [B, L, H, d] with batch first: scatter heads (dim 2), gather sequence (dim 1);
    # forward(..., batch_dim_idx=0). DeepSpeed's defaults (2, 0) are for [L, B, H, d].
    attn = DistributedAttention(
        partial(local_attention, causal=causal, kernel="torch"),
        dist.group.WORLD, scatter_idx=2, gather_idx=1,
    )
    span = seq_len // n

    def shard(x):  # [B, L, H, d] -> contiguous [B, L/N, H, d]
        return x[:, rank * span:(rank + 1) * span].detach().clone().requires_grad_(True)

    def call(ql, kl, vl):
        return attn(ql, kl, vl, 0)

    def gather(out):  # [B, L/N, H, d] -> [B, L, H, d]
        parts = [torch.empty_like(out) for _ in range(n)]
        dist.all_gather(parts, out.contiguous())
        return torch.cat(parts, dim=1)

    return shard, call, gather


def skip_reason(bench) -> str | None:
    """Why DeepSpeed-Ulysses cannot run ``bench``'s shapes (None when it can)."""
    n = bench.nprocs
    if bench.heads % n or bench.kv_heads % n:
        return (f"DeepSpeed-Ulysses needs heads ({bench.heads}) and KV heads "
                f"({bench.kv_heads}) divisible by its degree {n}")
    if bench.seq_len % n:
        return f"seq_len {bench.seq_len} is not divisible by {n}"
    return None


def deepspeed_peer(bench):
    """The attention benchmark's peer (``AttentionBench.peer``): (row config or None, skip
    reason or None, DeepSpeed's version or None), agreed by every rank (collective)."""
    from usp.bench.attention import Row

    skip = skip_reason(bench)
    if skip is not None:
        return None, skip, None
    DistributedAttention = import_deepspeed()
    ok = torch.tensor([0 if isinstance(DistributedAttention, str) else 1])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not ok.item():
        return None, (DistributedAttention if isinstance(DistributedAttention, str)
                      else "DeepSpeed failed to import on another rank"), None
    n = dist.get_world_size()
    row = Row(f"deepspeed u={n}", "peer", n, 1)
    calls = deepspeed_calls(DistributedAttention, bench.seq_len, bench.causal)
    return (row, *calls, None), None, importlib.import_module("deepspeed").__version__
