"""What every rank of the simulated cluster runs for ``tools.lab.train_table``.

Started by torchrun on each node (``SimCluster.run``)::

    python -m tools.lab.train_table_worker OUT/plan.json OUT/worker.json

Measures the two links, builds every row of the plan (its mesh, its model, FSDP2 and
AdamW, its shard of the same batch), checks that the rows agree (a forward's next-token
loss over every position, then one training step's loss and grad norm), then times the
rows' steps round-robin (``usp.bench.timing.round_robin``: the slowest rank's seconds,
the starting row rotated each round). Rank 0 writes the result.
"""

from __future__ import annotations

import json
import socket
import sys
import warnings
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from usp.attention import usp_attention
from usp.bench.timing import round_robin
from usp.config import OptimConfig
from usp.data.dataset import build_dataset
from usp.data.packing import IGNORE_INDEX, Batch
from usp.layout import SequenceLayout
from usp.mesh import SPMesh
from usp.models.decoder import Transformer
from usp.models.tiling import loss_share
from usp.train.build import shard_model
from usp.models.forward import loss_and_predictions

from .cluster_bench import PER_NODE
from .deepspeed_ulysses import deepspeed_calls, import_deepspeed
from .simcluster import gloo_main, p2p_rate
from .train_table import Row, TrainTable, data_config, rel_diff

LINK_BYTES = 8 * 2**20


@dataclass
class RowState:
    """A built row: its model (FSDP2 over the mesh's dp x sp ranks), optimizer, this rank's
    batch and RoPE positions, and the global label count of the batch."""

    row: Row
    mesh: SPMesh
    model: Transformer
    opt: torch.optim.Optimizer
    batch: Batch
    positions: torch.Tensor
    n_shard: int
    count: float
    every_token: Batch  # the same tokens, every one labelled with the next (the check)
    last_loss: float = float("nan")


def deepspeed_attention(DistributedAttention, mesh: SPMesh, layout: SequenceLayout,
                        n_kv_heads: int):
    """The model's ``attn_fn`` through DeepSpeed-Ulysses over all ranks
    (``deepspeed_calls``): q [B, L/u, Hq, d], k/v [B, L/u, Hkv, d] -> [B, L/u, Hq, d].
    DeepSpeed shards the sequence contiguously by global rank; the layout must agree.
    With Hkv < u each KV head is repeated u/Hkv times first (DeepSpeed 0.19.8 refuses
    fewer KV heads than ranks): rank j's query heads use KV head j // (u/Hkv)."""
    u = mesh.ulysses
    _, call, _ = deepspeed_calls(DistributedAttention, layout.seq_len, causal=True)
    span, rank = layout.seq_len // u, dist.get_rank()
    if mesh.ring != 1 or not torch.equal(layout.positions(),
                                         torch.arange(rank * span, (rank + 1) * span)):
        raise RuntimeError(f"the DeepSpeed row needs ring 1 and rank r holding tokens "
                           f"[r L/u, (r+1) L/u); rank {rank} holds {layout.positions()[:4]}...")
    rep = u // n_kv_heads if n_kv_heads < u else 1

    def attn(q, k, v):
        if rep > 1:  # [B, L/u, Hkv, d] -> [B, L/u, u, d]
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        return call(q, k, v)

    return attn


def build_row(row: Row, cfg: TrainTable, data, stack: ExitStack, DistributedAttention
              ) -> RowState:
    """Mesh, layout, attention, model (``cfg.seed``'s weights), FSDP2 and AdamW of ``row``
    (collective)."""
    with warnings.catch_warnings():
        # all-ulysses crosses the nodes on purpose: that is the row
        warnings.filterwarnings("ignore", message="ulysses group .* spans nodes")
        mesh = stack.enter_context(SPMesh.build(ulysses=row.ulysses, ring=row.ring, dp=1,
                                                placement=row.placement))
    layout = SequenceLayout(mesh, seq_len=cfg.seq_len, balance=row.balance)
    positions = layout.positions()  # global ids of this rank's tokens (RoPE, data)
    if row.attention == "deepspeed":
        attn = deepspeed_attention(DistributedAttention, mesh, layout, cfg.n_kv_heads)
    else:
        attn = partial(usp_attention, mesh=mesh, layout=layout, causal=True, kernel="torch",
                       a2a_chunks=row.a2a_chunks)
    model = Transformer(cfg.model, attn)
    model.init_weights(cfg.seed)
    # as usp.train.trainer: FSDP2 over the flattened dp x sp ranks averages the gradients
    shard_model(model, mesh.submesh("dp_sp"), "fp32")
    oc = OptimConfig()
    opt = torch.optim.AdamW(model.parameters(), lr=oc.lr, betas=(oc.beta1, oc.beta2),
                            weight_decay=oc.weight_decay)
    # the same global samples on every row; each rank reads its own tokens, labels shifted
    # on the global sequence
    batch = data.model_rows(range(cfg.batch), positions)  # [B, L/P]
    count = torch.tensor([float((batch.labels != IGNORE_INDEX).sum())], dtype=torch.float64)
    dp_sp = mesh.group("dp_sp")
    dist.all_reduce(count, group=dp_sp)  # the batch's labelled tokens over dp x sp
    return RowState(row, mesh, model, opt, batch, positions, mesh.submesh("dp_sp").size(),
                    count.item(), next_token_batch(data, cfg, positions))


def next_token_batch(data, cfg: TrainTable, positions: torch.Tensor) -> Batch:
    """This rank's columns of the batch with every token but the last of a row labelled
    with the next one: the recall task labels only its query tokens, so the check's
    forward covers every position this way."""
    full = data.model_rows(range(cfg.batch), None)  # [B, L]
    labels = torch.full_like(full.tokens, IGNORE_INDEX)
    labels[:, :-1] = full.tokens[:, 1:]  # shifted on the global sequence
    return Batch(full.tokens, labels).columns(positions)  # [B, L] -> [B, L/P]


@torch.no_grad()
def every_token_loss(s: RowState) -> float:
    """Mean next-token loss over every position of the batch (forward only, collective)."""
    loss_sum, _ = loss_and_predictions(s.model, s.every_token, s.positions)
    sums = torch.stack([loss_sum.double(), (s.every_token.labels != IGNORE_INDEX).sum().double()])
    dist.all_reduce(sums, group=s.mesh.group("dp_sp"))
    return (sums[0] / sums[1]).item()


def train_step(s: RowState) -> tuple[float, float]:
    """One optimizer step of ``s`` as ``usp.train.trainer`` takes it; (global loss per
    label, global grad norm before clipping)."""
    loss_sum, _ = loss_and_predictions(s.model, s.batch, s.positions)
    loss_share(loss_sum, s.count, s.n_shard).backward()  # the trainer's normalisation
    gn = torch.nn.utils.clip_grad_norm_(s.model.parameters(), OptimConfig().grad_clip)
    gn = float(gn.full_tensor() if hasattr(gn, "full_tensor") else gn)  # sync: global norm
    loss = loss_sum.detach().double().reshape(1)
    dist.all_reduce(loss, group=s.mesh.group("dp_sp"))  # sync: the global loss, as logged
    s.opt.step()
    s.opt.zero_grad(set_to_none=True)
    s.last_loss = loss.item() / s.count
    return s.last_loss, gn


def _log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def measure(cfg: TrainTable, table_rows: list[Row], stack: ExitStack) -> dict:
    """The links, the checked step and the timed rounds (collective)."""
    links = {"intra": p2p_rate(LINK_BYTES, 0, 1), "inter": p2p_rate(LINK_BYTES, 0, PER_NODE)}
    _log(f"links: intra {links['intra'] / 1e6:.0f} MB/s, inter {links['inter'] / 1e6:.1f} MB/s")
    DistributedAttention = import_deepspeed()
    ok = torch.tensor([0 if isinstance(DistributedAttention, str) else 1])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not ok.item():
        raise RuntimeError(DistributedAttention if isinstance(DistributedAttention, str)
                           else "DeepSpeed failed to import on another rank")
    data = build_dataset(data_config(cfg), cfg.model)
    states = [build_row(r, cfg, data, stack, DistributedAttention) for r in table_rows]
    every = {s.row.name: every_token_loss(s) for s in states}  # same weights: same loss
    checked = {s.row.name: train_step(s) for s in states}
    losses, norms = ([v[i] for v in checked.values()] for i in (0, 1))
    _log("checked step: " + ", ".join(f"{k}: loss {lo:.6f} (every token {every[k]:.6f}), "
                                      f"grad norm {g:.6f}" for k, (lo, g) in checked.items()))
    # every rank holds the same global figures, so every rank refuses alike (no hang)
    worst = max(rel_diff(losses), rel_diff(every.values()))
    if worst > cfg.loss_rtol or rel_diff(norms) > cfg.grad_rtol:
        raise RuntimeError(f"the rows disagree on the same batch: losses {losses}, every-token "
                           f"losses {list(every.values())} (relative {worst:.2e}, limit "
                           f"{cfg.loss_rtol:g}), grad norms {norms} (relative "
                           f"{rel_diff(norms):.2e}, limit {cfg.grad_rtol:g})")
    _log(f"timing {len(states)} rows: {cfg.warmup} warm-up + {cfg.rounds} rounds")

    def progress(i: int) -> None:
        _log(f"round {i + 1}/{cfg.rounds} done" if i >= 0 else "warm-up round done")

    per_round = round_robin([partial(train_step, s) for s in states], cfg.rounds,
                            cfg.warmup, on_round=progress)
    res = {"links": links, "rows": {
        s.row.name: dict(step_s=[r[j] for r in per_round], check_loss=checked[s.row.name][0],
                         check_grad_norm=checked[s.row.name][1],
                         every_token_loss=every[s.row.name], last_loss=s.last_loss)
        for j, s in enumerate(states)}}
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    res["hosts"] = hosts
    for s in states:  # FSDP state holds the mesh's groups: drop it before the meshes close
        s.model = s.opt = None
    states.clear()
    return res


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        raise SystemExit("usage: python -m tools.lab.train_table_worker PLAN.json RESULT.json")
    plan = json.loads(Path(argv[0]).read_text())
    cfg = TrainTable(**plan["table"])
    table_rows = [Row(**r) for r in plan["rows"]]

    def measured() -> dict:
        with ExitStack() as stack:  # meshes close (collectively) before the group goes
            return measure(cfg, table_rows, stack)

    return gloo_main(measured, argv[1], cfg.timeout)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
