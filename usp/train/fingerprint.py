"""The run fingerprint: what must not change between a checkpoint and its resume.

``usp.models.checkpoint`` writes it into each checkpoint's manifest and refuses a resume
whose fingerprint differs (``check_resume``)."""

from __future__ import annotations


def run_fingerprint(cfg) -> dict:
    """The settings a resumed run must share with its checkpoint, as ``{"section.key": value}``:
    every ``model`` field, ``data.kind``/``seq_len``/``seed``, the optimizer and schedule
    (lr, min_lr, warmup_steps, weight_decay, beta1, beta2, grad_clip), ``trainer.steps`` and
    ``trainer.dtype``. Not the parallel degrees: a checkpoint resumes under any layout.
    ``cfg`` is a ``RunConfig`` (anything with ``model``, ``data``, ``optim``, ``trainer``)."""
    out = {f"model.{k}": v for k, v in vars(cfg.model).items()}
    out.update({"data.kind": cfg.data.kind, "data.seq_len": cfg.data.seq_len,
                "data.seed": cfg.data.seed})  # the seed fixes the order the position counts in
    for k in ("lr", "min_lr", "warmup_steps", "weight_decay", "beta1", "beta2", "grad_clip"):
        out[f"optim.{k}"] = getattr(cfg.optim, k)
    out.update({"trainer.steps": cfg.trainer.steps, "trainer.dtype": cfg.trainer.dtype})
    return out
