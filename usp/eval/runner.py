"""The ranks' half of ``usp-eval``: build the scored model once, then for each length its
own ``SequenceLayout``, every case one sharded forward pass through ``usp_attention`` (no
generation, no KV cache; ``usp.eval.sharded``, which the trainer's periodic passkey score
runs too), each token's loss and argmax gathered back to global order and scored
(``usp.eval.passkey.score``, ``usp.eval.position.bucket_losses``); rank 0 writes the
outputs (``usp.eval.results``)."""

from __future__ import annotations

import torch

from ..config import torch_dtype
from ..data.packing import IGNORE_INDEX
from ..layout import SequenceLayout
from ..models.checkpoint import step_of
from ..mesh import SPMesh
from ..run import RunLayout
from ..eval.position import bucket_losses
from ..models.routed import routed_model
from ..models.shard_load import load_shards
from . import results
from .job import EvalJob
from .sharded import passkey_scores, scored


def eval_model(job: EvalJob, run: RunLayout, mesh: SPMesh, device: torch.device):
    """(the scored model in eval mode on ``device``, ``use(layout)`` that routes its attention
    through ``layout``): the run's checkpoint loaded model-only, or the model group's
    (``model.pretrained``), unsharded on every rank."""
    mc = job.cfg.model
    model, _, use = routed_model(mc, mesh, run.attention_options(), job.cfg.trainer.seed)
    if mc.hf is None and mc.pretrained is not None:
        load_shards(model, mc, device)  # the built-in model of model.pretrained: every row
    if job.checkpoint is not None:
        from ..models.export import load_model

        load_model(job.checkpoint, model)
    model.to(device=device, dtype=torch_dtype(run.dtype)).eval()
    return model, use


@torch.no_grad()
def position_loss(model, use, job: EvalJob, mesh: SPMesh, run: RunLayout, device) -> dict:
    """Loss by position bucket at each length, over its windows, weighted by tokens."""
    rows = []
    for length in job.lengths:
        layout = SequenceLayout(mesh, length, run.balance)
        use(layout)
        windows = torch.from_numpy(job.windows[length])  # [W, L + 1]
        losses, _ = scored(model, layout, windows[:, :-1], windows[:, 1:], device)  # [W, L]
        counted = (windows[:, 1:] != IGNORE_INDEX).double()
        rows.append(bucket_losses(losses.double().sum(0).tolist(), counted.sum(0).tolist(),
                                  job.cfg.eval.buckets))
    return {"lengths": list(job.lengths), "buckets": job.cfg.eval.buckets, "loss": rows}


def run_eval(job: EvalJob, run: RunLayout, rank: int, device: torch.device) -> dict:
    """Score ``job`` on this rank (collective over the launch's ranks); rank 0 writes the
    files and prints one line per length. Returns {"passkey": ..., "position_loss": ...}."""
    mesh = run.build_mesh()
    try:
        model, use = eval_model(job, run, mesh, device)
        out = {}
        if job.cases:
            scores = passkey_scores(model, use, job.cases, mesh, run.balance, device)
            step = None if job.checkpoint is None else step_of(job.checkpoint)
            out["passkey"] = results.passkey_result(scores, job.lengths, job.cfg.eval.depths,
                                                   job.train_len, job.cfg.eval.key_digits, step)
        if job.windows:
            out["position_loss"] = position_loss(model, use, job, mesh, run, device)
    finally:
        mesh.close()
    if rank == 0:
        _write(job, out)
    return out


def _write(job: EvalJob, out: dict) -> None:
    job.out.mkdir(parents=True, exist_ok=True)
    for note in job.notes:
        print(f"usp-eval: {note}", flush=True)
    if "passkey" in out:
        results.write_json(job.out / "passkey.json", out["passkey"])
        results.passkey_png(out["passkey"], job.out / "passkey.png")
        for line in results.passkey_lines(out["passkey"]):
            print(line, flush=True)
    if "position_loss" in out:
        results.write_json(job.out / "position_loss.json", out["position_loss"])
        results.position_png(out["position_loss"], job.out / "position_loss.png", job.train_len)
        for line in results.position_lines(out["position_loss"]):
            print(line, flush=True)
    wrote = [n for n in ("passkey.json", "passkey.png", "position_loss.json",
                         "position_loss.png") if (n.split(".")[0] in out)]
    print(f"usp-eval: wrote {', '.join(wrote)} in {job.out}", flush=True)
