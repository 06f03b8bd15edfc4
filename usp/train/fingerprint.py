"""The run fingerprint: what must not change between a checkpoint and its resume.

``usp.models.checkpoint`` writes it into each checkpoint's manifest and refuses a resume
whose fingerprint differs (``check_resume``). A run of length phases (``trainer.phases``)
adds the plan (``phases_key``), so a checkpoint of any of its phases resumes and one of
another plan is refused; a run without phases keeps the fingerprint it always had."""

from __future__ import annotations

import json

from ..config.model import PLANNED_FIELDS
from ..run.phases import Phase, PhasePlan


def run_fingerprint(cfg, plan: PhasePlan | None = None) -> dict:
    """The settings a resumed run must share with its checkpoint, as ``{"section.key": value}``:
    every ``model`` field but the tilings (``PLANNED_FIELDS``: ``loss_chunk``, ``mlp_tiles``,
    ``norm_tiles``, which change how a step holds its memory, not what it computes, and which
    an ``auto`` re-sizes on another layout or device), ``data.kind``/``seq_len``/``seed``, the optimizer and schedule
    (lr, min_lr, warmup_steps, weight_decay, beta1, beta2, grad_clip), ``trainer.steps`` and
    ``trainer.dtype``, all of the base config ``cfg``; with a ``plan`` of phases, also
    ``trainer.phases``: ``phases_key(plan)``. Not the parallel degrees: a checkpoint resumes
    under any layout. ``cfg`` is a ``RunConfig`` (anything with ``model``, ``data``,
    ``optim``, ``trainer``)."""
    out = {f"model.{k}": v for k, v in vars(cfg.model).items() if k not in PLANNED_FIELDS}
    out.update({"data.kind": cfg.data.kind, "data.seq_len": cfg.data.seq_len,
                "data.seed": cfg.data.seed})  # the seed fixes the order the position counts in
    for k in ("lr", "min_lr", "warmup_steps", "weight_decay", "beta1", "beta2", "grad_clip"):
        out[f"optim.{k}"] = getattr(cfg.optim, k)
    out.update({"trainer.steps": cfg.trainer.steps, "trainer.dtype": cfg.trainer.dtype})
    if plan is not None and phases_key(plan) != phases_key(PhasePlan.single(cfg, plan[0].run)):
        out["trainer.phases"] = phases_key(plan)
    return out


def _phase_key(p: Phase) -> str:
    m, gate = p.cfg.model, p.until
    until = None if gate is None else (f"passkey_acc>={gate.passkey_acc},"
                                       f"val_loss_within={gate.val_loss_within}")
    blend = getattr(p.cfg.data, "blend", None)  # a phase's data mix (or the base's)
    mix = "" if not blend else " blend=" + ",".join(f"{b.path}:{b.weight}" for b in blend)
    return (f"seq_len={p.seq_len} steps={p.steps} lr={p.lr} rope_theta={m.rope_theta} "
            f"rope_scaling={json.dumps(m.rope_scaling, sort_keys=True)} until={until}" + mix)


def phases_key(plan: PhasePlan) -> str:
    """The plan's phases in one canonical line (a string, so that it reads back from the
    manifest's JSON equal): each phase's seq_len, steps, lr, RoPE settings and gate."""
    return "; ".join(_phase_key(p) for p in plan.phases)
