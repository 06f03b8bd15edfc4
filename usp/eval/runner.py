"""The ranks' half of ``usp-eval``: build the scored model once, then for each length its
own ``SequenceLayout``, every case one sharded forward pass through ``usp_attention`` (no
generation, no KV cache), each token's loss and argmax gathered back to global order and
scored (``usp.scoring.passkey.score``, ``usp.scoring.position.bucket_losses``); rank 0 writes the
outputs (``usp.scoring.report``)."""

from __future__ import annotations

from collections import defaultdict
from functools import partial

import torch

from ..attention import usp_attention
from ..config import torch_dtype
from ..data.packing import IGNORE_INDEX, Batch
from ..layout import SequenceLayout
from ..mesh import SPMesh
from ..models.llama import Transformer
from ..run import RunLayout
from ..train.forward import token_losses_and_predictions
from ..scoring import report
from ..scoring.passkey import case_labels, score
from .plan import EvalJob
from ..scoring.position import bucket_losses


class LayoutAttention:
    """The built-in model's attention function whose ``layout`` is set per length."""

    def __init__(self, mesh: SPMesh, options: dict):
        self.mesh, self.options, self.layout = mesh, options, None

    def __call__(self, q, k, v, **masks):
        return usp_attention(q, k, v, mesh=self.mesh, layout=self.layout, causal=True,
                             **self.options, **masks)


def eval_model(job: EvalJob, run: RunLayout, mesh: SPMesh, device: torch.device):
    """(the scored model in eval mode on ``device``, ``use(layout)`` that routes its attention
    through ``layout``): the run's checkpoint loaded model-only, or the model group's
    (``model.pretrained``), unsharded on every rank."""
    mc = job.cfg.model
    if mc.hf is None:
        attention = LayoutAttention(mesh, run.attention_options())
        model = Transformer(mc, attention)
        model.init_weights(job.cfg.trainer.seed)

        def use(layout):
            attention.layout = layout
    else:
        from ..models import hf
        from ..models.hf_model import build_model

        model = build_model(mc, job.cfg.trainer.seed)
        use = partial(_patch, hf.patch, model, mesh, run.attention_options())
    if job.checkpoint is not None:
        from ..models.export import load_model

        load_model(job.checkpoint, model)
    model.to(device=device, dtype=torch_dtype(run.dtype)).eval()
    return model, use


def _patch(patch, model, mesh, options, layout) -> None:
    patch(model, mesh, layout, **options)


def _scored(model, layout: SequenceLayout, tokens: torch.Tensor, labels: torch.Tensor, device):
    """(losses [B, L] fp32, predictions [B, L]) of global rows ``tokens``/``labels`` [B, L]:
    this rank's columns through the model, gathered back to global order on every rank."""
    positions = layout.positions(device)  # [L/P] global ids of this rank's tokens
    batch = Batch(tokens=layout.shard(tokens).to(device), labels=layout.shard(labels).to(device))
    losses, preds = token_losses_and_predictions(model, batch, positions)  # [B, L/P] each
    return layout.gather(losses.float()).cpu(), layout.gather(preds).cpu()  # -> [B, L]


@torch.no_grad()
def passkey_scores(model, use, job: EvalJob, mesh: SPMesh, run: RunLayout, device) -> list[dict]:
    """Every case's score; the cases of one (length, depth) cell in one forward pass."""
    cells = defaultdict(list)
    for case in job.cases:
        cells[(case.length, case.depth)].append(case)
    scores = []
    for (length, _), cases in cells.items():
        layout = SequenceLayout(mesh, length, run.balance)
        use(layout)
        tokens = torch.tensor([c.tokens for c in cases])  # [per_cell, L]
        labels = torch.tensor([case_labels(c) for c in cases])  # [per_cell, L]
        losses, preds = _scored(model, layout, tokens, labels, device)
        scores += [score(c, losses[i].tolist(), preds[i].tolist()) for i, c in enumerate(cases)]
    return scores


@torch.no_grad()
def position_loss(model, use, job: EvalJob, mesh: SPMesh, run: RunLayout, device) -> dict:
    """Loss by position bucket at each length, over its windows, weighted by tokens."""
    rows = []
    for length in job.lengths:
        layout = SequenceLayout(mesh, length, run.balance)
        use(layout)
        windows = torch.from_numpy(job.windows[length])  # [W, L + 1]
        losses, _ = _scored(model, layout, windows[:, :-1], windows[:, 1:], device)  # [W, L]
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
            scores = passkey_scores(model, use, job, mesh, run, device)
            out["passkey"] = report.passkey_result(scores, job.lengths, job.cfg.eval.depths,
                                                   job.train_len, job.cfg.eval.key_digits)
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
        report.write_json(job.out / "passkey.json", out["passkey"])
        report.passkey_png(out["passkey"], job.out / "passkey.png")
        for line in report.passkey_lines(out["passkey"]):
            print(line, flush=True)
    if "position_loss" in out:
        report.write_json(job.out / "position_loss.json", out["position_loss"])
        report.position_png(out["position_loss"], job.out / "position_loss.png", job.train_len)
        for line in report.position_lines(out["position_loss"]):
            print(line, flush=True)
    wrote = [n for n in ("passkey.json", "passkey.png", "position_loss.json",
                         "position_loss.png") if (n.split(".")[0] in out)]
    print(f"usp-eval: wrote {', '.join(wrote)} in {job.out}", flush=True)
