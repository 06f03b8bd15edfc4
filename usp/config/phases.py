"""``trainer.phases``: a run grown in context, one entry per length phase.

Each phase names its ``seq_len`` and its length, in optimizer ``steps`` or in ``tokens``
(one of the two), and may overlay the base config's values for that phase: ``rope_theta``,
``rope_scaling``, ``lr`` (a new peak with its own warmup), ``batch_per_dp_rank``,
``global_batch_tokens``, ``ulysses_degree``, ``ring_degree``, ``expert_degree``,
``loss_chunk``, ``mlp_tiles`` (a number, or ``auto``: re-sized at the phase's length) and ``blend``
(the token files the phase reads, as ``data.blend``: a phase's own data mix). A key a phase leaves unset
keeps its value from the phase before, and the first phase's from the base config
(``parallel=auto`` in the base lets the planner choose the degrees of every phase).
``until`` is the phase's gate: it may end before its steps when every criterion given holds
at a validation.

``phase_config(cfg, k)`` is the base config with phase k's keys overlaid, the config that
phase trains with; ``usp.run.resolve_phases`` resolves a layout for each. Rules on plain
values are here (``check_phases``, run by ``TrainerConfig``); those that need the other
groups, the world or the files are ``usp.run.resolve_phases``'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, List, Optional

from .checks import above, at_least
from .data import BlendSource
from .rope import check_rope_scaling

# phase key -> (group, key) of the base config it overlays
OVERLAY = {
    "seq_len": ("data", "seq_len"),
    "batch_per_dp_rank": ("data", "batch_per_dp_rank"),
    "rope_theta": ("model", "rope_theta"),
    "rope_scaling": ("model", "rope_scaling"),
    "lr": ("optim", "lr"),
    "global_batch_tokens": ("trainer", "global_batch_tokens"),
    "ulysses_degree": ("parallel", "ulysses_degree"),
    "ring_degree": ("parallel", "ring_degree"),
    "expert_degree": ("parallel", "expert_degree"),
    "loss_chunk": ("model", "loss_chunk"),
    "mlp_tiles": ("model", "mlp_tiles"),
    "norm_tiles": ("model", "norm_tiles"),
    "blend": ("data", "blend"),
}


@dataclass
class PhaseGateConfig:
    """``trainer.phases[k].until``: the phase may end early when, at a validation, every
    criterion given holds. ``passkey_acc``: passkey accuracy at the phase's length at least
    this (needs ``eval.during_training=true``); ``val_loss_within``: the validation loss at
    the first phase's length within this relative margin of its value at the end of the
    first phase (0.02: at most 2% above; needs a validation split; not in the first phase)."""

    passkey_acc: Optional[float] = None
    val_loss_within: Optional[float] = None


@dataclass
class PhaseConfig:
    """One entry of ``trainer.phases`` (``seq_len`` and one of ``steps``/``tokens``
    required); an overlay key left None keeps the value of the phase before (the first
    phase: the base config's). ``rope_scaling``: a dict in transformers' names, or
    ``{rope_type: default}`` for plain RoPE after a phase (or base) with a scaling.
    ``blend``: ``[{path, weight}, ...]`` as ``data.blend``, the phase's data mix (token
    files only; it replaces the base's ``data.path`` or ``data.blend``)."""

    seq_len: Optional[int] = None
    steps: Optional[int] = None
    tokens: Optional[int] = None
    rope_theta: Optional[float] = None
    rope_scaling: Any = None
    lr: Optional[float] = None
    batch_per_dp_rank: Optional[int] = None
    global_batch_tokens: Optional[int] = None
    ulysses_degree: Any = None
    ring_degree: Any = None
    expert_degree: Any = None
    loss_chunk: Any = None  # a number or auto (re-sized at this phase's length)
    mlp_tiles: Any = None
    norm_tiles: Any = None
    blend: Optional[List[BlendSource]] = None
    until: Optional[PhaseGateConfig] = None

    def __post_init__(self):
        if self.blend is not None:  # dicts from Python (Hydra gives BlendSource already)
            self.blend = [b if isinstance(b, BlendSource) else BlendSource(**b)
                          for b in self.blend]

    def check(self, k: int) -> None:
        """Refuse the plain values of phase ``k`` (0-based), named ``trainer.phases[k]``."""
        at = f"trainer.phases[{k}]"
        if self.seq_len is None:
            raise ValueError(f"{at} has no seq_len; give each phase its length, e.g. "
                             f"{{seq_len: 4096, steps: 100}}")
        if (self.steps is None) == (self.tokens is None):
            given = ("both steps and tokens" if self.steps is not None
                     else "neither steps nor tokens")
            raise ValueError(f"{at} has {given}; give one of them: steps (optimizer steps) or "
                             f"tokens (converted with the phase's tokens per step)")
        for key in ("seq_len", "steps", "tokens", "batch_per_dp_rank", "global_batch_tokens"):
            if getattr(self, key) is not None:
                at_least(at, 1, **{key: getattr(self, key)})
        for key in ("rope_theta", "lr"):
            if getattr(self, key) is not None:
                above(at, 0, **{key: getattr(self, key)})
        for key in ("ulysses_degree", "ring_degree", "expert_degree"):
            value = getattr(self, key)
            if value is not None and value != "auto" and not (
                    isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"{at}.{key}={value!r} must be a whole number >= 1 or auto")
        if isinstance(self.rope_scaling, str):
            raise ValueError(f"{at}.rope_scaling={self.rope_scaling!r}: a phase gives a dict in "
                             f"transformers' names ({{rope_type: default}} for plain RoPE) or "
                             f"leaves it unset to keep model.rope_scaling")
        if self.rope_scaling is not None:
            try:
                check_rope_scaling(dict(self.rope_scaling) or {"rope_type": "default"})
            except ValueError as e:
                raise ValueError(f"{at}: {e}") from None
        if self.blend is not None and not self.blend:
            raise ValueError(f"{at}.blend is empty; give its sources, e.g. blend: [{{path: "
                             f"data/long, weight: 0.7}}, {{path: data/short, weight: 0.3}}], "
                             f"or leave it unset to read the phase before's data")
        if self.until is not None:
            self._check_gate(at, k)

    def _check_gate(self, at: str, k: int) -> None:
        gate = self.until
        if gate.passkey_acc is None and gate.val_loss_within is None:
            raise ValueError(f"{at}.until names no criterion; give passkey_acc and/or "
                             f"val_loss_within, e.g. until: {{passkey_acc: 0.9}}, or drop it")
        if gate.passkey_acc is not None and not 0 < gate.passkey_acc <= 1:
            raise ValueError(f"{at}.until.passkey_acc={gate.passkey_acc} is an accuracy: give "
                             f"a value in (0, 1], e.g. 0.9")
        if gate.val_loss_within is not None:
            at_least(f"{at}.until", 0, val_loss_within=gate.val_loss_within)
            if k == 0:
                raise ValueError(f"{at}.until.val_loss_within compares the validation loss "
                                 f"with its value at the end of the first phase, which is "
                                 f"this one; gate a later phase on it, or use passkey_acc")


def gate_text(gate) -> str:
    """A gate's criteria as words (``PhaseGateConfig`` or ``usp.run.PhaseGate``), e.g.
    ``passkey_acc >= 0.9 and val_loss_within 0.02``."""
    held = []
    if gate.passkey_acc is not None:
        held.append(f"passkey_acc >= {gate.passkey_acc:g}")
    if gate.val_loss_within is not None:
        held.append(f"val_loss_within {gate.val_loss_within:g}")
    return " and ".join(held)


def phase_heading(k: int, n: int, seq_len: int, first: int, last: int, model, lr, until,
                  layout: str | None = None, blend=None) -> str:
    """Phase ``k``'s (0-based, of ``n``) heading: its length, ``layout`` (the resolved
    layout's words; None in ``usp-plan``, whose choice follows), its global steps
    ``first..last``, its RoPE (``model``'s), a new peak ``lr`` and its gate ``until``
    when it has them, the ``blend`` the phase sets, e.g. ``phase 2/3: seq_len 4096, ulysses 2
    x ring 2 (dp 1), K=2, steps 301..400, rope_theta 40000, rope_scaling yarn x4, lr 0.0004
    (new warmup), blend long 0.7 + short 0.3, until passkey_acc >= 0.9``. The one wording of
    usp-plan, usp-train's plan and its boundaries."""
    words = [f"seq_len {seq_len}"] + ([layout] if layout else [])
    words += [f"steps {first}..{last}", f"rope_theta {model.rope_theta:.10g}"]
    if model.rope_scaling:
        scaling = model.rope_scaling
        words.append(f"rope_scaling {scaling['rope_type']}"
                     + (f" x{scaling['factor']:g}" if "factor" in scaling else ""))
    if lr is not None:
        words.append(f"lr {lr:g} (new warmup)")
    if blend:
        words.append("blend " + " + ".join(f"{Path(b.path).name} {b.weight:g}" for b in blend))
    if until is not None:
        words.append(f"until {gate_text(until)}")
    return f"phase {k + 1}/{n}: " + ", ".join(words)


def check_phases(phases: list[PhaseConfig]) -> None:
    """Each phase's plain values (``PhaseConfig.check``) and their order: lengths that
    never shrink (a phase may repeat the length before it, e.g. to change only RoPE)."""
    for k, p in enumerate(phases):
        p.check(k)
    for k in range(1, len(phases)):
        before, now = phases[k - 1].seq_len, phases[k].seq_len
        if now < before:
            lengths = [p.seq_len for p in phases]
            raise ValueError(f"trainer.phases[{k}].seq_len={now} is shorter than phase {k - 1}'s "
                             f"{before} (lengths {lengths}): phases grow the context; order "
                             f"them by length, shortest first")


def phase_keys(p: PhaseConfig) -> dict[str, Any]:
    """The overlay keys phase ``p`` sets (``OVERLAY``'s names), in that order."""
    return {key: getattr(p, key) for key in OVERLAY if getattr(p, key) is not None}


def phase_config(cfg, k: int):
    """The config phase ``k`` (0-based) of ``cfg.trainer.phases`` trains with: ``cfg`` with
    the keys of phases 0..k overlaid in order on ``data.seq_len``, ``data.batch_per_dp_rank``,
    ``model.rope_theta``, ``model.rope_scaling``, ``optim.lr``,
    ``trainer.global_batch_tokens``, ``parallel.ulysses_degree``, ``parallel.ring_degree``,
    ``parallel.expert_degree``, ``model.loss_chunk``, ``model.mlp_tiles``
    and ``data.blend`` (with ``data.path`` then unset): a key phase k leaves unset keeps its
    value from the phase before (a raised ``rope_theta`` stays raised), the first phase's
    from the base; every
    other value is the base's. Pure: ``cfg`` is unchanged.
    A value the overlaid group refuses (``optim.min_lr`` above a phase's ``lr``) is
    refused naming the phase."""
    phases = cfg.trainer.phases or []
    if not 0 <= k < len(phases):
        raise IndexError(f"phase {k} of {len(phases)}")
    groups: dict[str, dict[str, Any]] = {}
    for p in phases[:k + 1]:  # phase by phase: what a phase leaves unset carries on
        for key, value in phase_keys(p).items():
            group, name = OVERLAY[key]
            groups.setdefault(group, {})[name] = value
    if "blend" in groups.get("data", {}):
        if not hasattr(cfg.data, "blend"):
            raise ValueError(f"trainer.phases[{k}] reads a blend, but data.kind={cfg.data.kind} "
                             f"has no token files; train on token files (data=memmap) or drop "
                             f"the phases' blend")
        groups["data"]["path"] = None  # a phase's blend replaces the base's one corpus
    try:
        return replace(cfg, **{g: replace(getattr(cfg, g), **kw) for g, kw in groups.items()})
    except ValueError as e:
        raise ValueError(f"trainer.phases[{k}] overlaid on the base config: {e}") from None


def steps_for_tokens(k: int, tokens: int, tokens_per_step: int, why: str) -> int:
    """Optimizer steps of phase ``k`` given in ``tokens``: ``ceil(tokens / tokens_per_step)``;
    refused when less than one step (``why``: how a step's tokens come about)."""
    if tokens < tokens_per_step:
        raise ValueError(f"trainer.phases[{k}].tokens={tokens} is less than one optimizer step of "
                         f"that phase ({tokens_per_step} tokens: {why}); give tokens >= "
                         f"{tokens_per_step}, or steps: 1")
    return math.ceil(tokens / tokens_per_step)

