"""The resolver of a run in length phases: the config and the launcher's world -> one
``PhasePlan``, a ``RunLayout`` per phase, every rule run before any process group."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

from ..config import MemmapData, RunConfig, phase_config
from ..config.phases import PhaseConfig
from ..data.dataset import build_validation
from ..planner.phase_report import phase_refused, phase_steps, step_tokens_text
from ..eval.grid import passkey_lengths
from ..rules import check_seq_len
from .decide import detected_cluster
from .run_layout import RunLayout
from .phases import Phase, PhaseGate, PhasePlan
from .preflight import check_task
from .resolve import decide_in_group, resolve_run


def _silent(text: str) -> None:
    """``say`` that says nothing."""


_print = partial(print, flush=True)


def resolve_phases(cfg: RunConfig, world: int, device: str, env=None, *,
                   scheduler_hosts: bool = False, run_dir: str | None = None,
                   say=_silent) -> PhasePlan:
    """The run's ``PhasePlan`` for ``world`` ranks on ``device`` (the parameters are
    ``resolve_run``'s); raises ``ValueError`` before any process group.

    Without ``trainer.phases``: one phase, ``PhasePlan.single`` of ``resolve_run``'s layout.
    Each phase's config carries its layout's tilings (``tiled_config``: an ``auto``
    ``model.loss_chunk``/``mlp_tiles`` re-sized at each phase's length).
    With phases: for each, its config (``phase_config``), its gate checked against the
    evaluations configured (``check_gate``), its layout (``resolve_run`` on that config: a
    refusal names the phase, and a length no layout of the world fits says the longest that
    fits and the nodes that would fit it), its steps (``tokens``: ``ceil(tokens /
    tokens_per_step)`` of its layout); then ``trainer.steps`` is their total, which
    ``trainer.stop_after`` must not pass. ``say(text)``: each phase's heading
    (``PhasePlan.describe``) and the planner's table when it chose a degree, then the
    total."""
    if not cfg.trainer.phases:
        run = resolve_run(cfg, world, device, env, scheduler_hosts=scheduler_hosts,
                          run_dir=run_dir, say=say)
        return PhasePlan.single(tiled_config(cfg, run), run)
    resolved, said = [], []
    for k, entry in enumerate(cfg.trainer.phases):
        pcfg = phase_config(cfg, k)
        check_gate(cfg, k)
        lines: list[str] = []
        try:
            run = resolve_run(pcfg, world, device, env, scheduler_hosts=scheduler_hosts,
                              run_dir=run_dir, say=lines.append)
        except (ValueError, FileNotFoundError) as e:
            rpn = None if scheduler_hosts else cfg.parallel.ranks_per_node
            raise phase_refused(k, pcfg, str(e),  # auto degrees: says what would fit
                                lambda: detected_cluster(pcfg, world, rpn, env)[0],
                                world) from None
        pcfg = tiled_config(pcfg, run)  # an auto loss_chunk/mlp_tiles sized for the phase
        check_short_length(cfg, k, run)
        why = step_tokens_text(run.seq_len, run.batch_per_dp_rank, run.dp, run.grad_accum)
        steps = phase_steps(cfg, k, run.tokens_per_step, why)
        resolved.append((pcfg, run, steps, entry))
        said.append(lines)
    total = sum(steps for _, _, steps, _ in resolved)
    stop = cfg.trainer.stop_after
    if stop is not None and stop > total:
        raise ValueError(f"trainer.stop_after={stop} is beyond the {total} steps of the phases "
                         f"({' + '.join(str(s) for _, _, s, _ in resolved)}); set it in "
                         f"1..{total} or to null")
    base = replace(tiled_config(cfg, resolved[0][1]), trainer=replace(cfg.trainer, steps=total))
    plan = PhasePlan(tuple(
        Phase(k, replace(pcfg, trainer=replace(pcfg.trainer, steps=total)), run, steps,
              lr=entry.lr, until=_gate(entry))
        for k, (pcfg, run, steps, entry) in enumerate(resolved)), base)
    for k, lines in enumerate(said):
        say(plan.describe(k))
        for line in lines:
            say(line)
    say(f"phases: {len(plan)}, trainer.steps {total} = "
        f"{' + '.join(str(p.steps) for p in plan.phases)}")
    return plan


def tiled_config(cfg: RunConfig, run: RunLayout) -> RunConfig:
    """``cfg`` with the model's ``loss_chunk`` and ``mlp_tiles`` as ``run`` decided them (an
    ``auto`` one sized by the planner): what the phase's model is built from; ``cfg`` itself
    when it set them."""
    model = run.model_config(cfg.model)
    return cfg if model == cfg.model else replace(cfg, model=model)


def _gate(entry: PhaseConfig) -> PhaseGate | None:
    if entry.until is None:
        return None
    return PhaseGate(passkey_acc=entry.until.passkey_acc,
                     val_loss_within=entry.until.val_loss_within)


def check_gate(cfg: RunConfig, k: int) -> None:
    """Refuse phase ``k``'s gate (``until``) when an evaluation it names is not configured:
    any gate without validations during the run (``trainer.eval_every=0``); ``passkey_acc``
    without ``eval.during_training`` scoring the phase's length; ``val_loss_within``
    without a validation split at the first phase's length."""
    gate = cfg.trainer.phases[k].until
    if gate is None:
        return
    at, length = f"trainer.phases[{k}].until", cfg.trainer.phases[k].seq_len
    if not cfg.trainer.eval_every:
        raise ValueError(f"{at} is checked at validations, but trainer.eval_every=0 validates "
                         f"only after the last step; set trainer.eval_every (e.g. 50) or drop "
                         f"the gate")
    if gate.passkey_acc is not None:
        pcfg = phase_config(cfg, k)
        if not cfg.eval.during_training:
            raise ValueError(f"{at}.passkey_acc={gate.passkey_acc} reads the passkey accuracy "
                             f"at {length} tokens, but eval.during_training=false scores none; "
                             f"set eval.during_training=true or drop passkey_acc")
        lengths = passkey_lengths(pcfg, length)
        if length not in lengths:
            raise ValueError(f"{at}.passkey_acc={gate.passkey_acc} reads the passkey accuracy "
                             f"at the phase's {length} tokens, but eval.lengths={lengths} "
                             f"does not score it; add {length} to eval.lengths or leave "
                             f"eval.lengths empty (each phase's own length)")
    if gate.val_loss_within is not None:
        first = phase_config(cfg, 0)
        what = (f"{at}.val_loss_within={gate.val_loss_within} reads the validation loss at "
                f"the first phase's {first.data.seq_len} tokens")
        if not isinstance(first.data, MemmapData):
            raise ValueError(f"{what}, but data={first.data.kind} has no validation split; "
                             f"train on token files (data=memmap) or drop val_loss_within")
        try:
            splits = build_validation(first.data, first.model, cfg.trainer.eval_windows)
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
        if not splits:
            raise ValueError(f"{what}, but no source has a validation split (PREFIX.val.bin); "
                             f"usp-prepare writes it beside the training split "
                             f"(--val-fraction), or drop val_loss_within")


def check_short_length(cfg: RunConfig, k: int, run: RunLayout) -> None:
    """A later phase with validation splits scores ``short_val_loss``: the first phase's
    windows, at the first phase's length, on phase ``k``'s layout ``run``. Refuse a layout
    that cannot hold that length (``check_seq_len``), naming both phases and the fixes:
    the loss is the first phase's own windows, so that it compares with their loss at the
    end of the first phase (``val_loss_within``); it is never scored at another length."""
    first = phase_config(cfg, 0)
    if k == 0 or not build_validation(first.data, first.model, cfg.trainer.eval_windows):
        return
    length = first.data.seq_len
    try:
        check_seq_len(length, run.ulysses, run.ring, run.balance)
    except ValueError as e:
        raise ValueError(
            f"trainer.phases[{k}] (seq_len {run.seq_len}) on ulysses {run.ulysses} x ring "
            f"{run.ring} scores short_val_loss, the validation loss of the first phase's "
            f"{length}-token windows, on its own layout: {e}; give trainer.phases[0] such a "
            f"seq_len, or trainer.phases[{k}] degrees that hold {length} tokens") from None


def check_phase_tasks(plan: PhasePlan) -> None:
    """What a task other than the resolving one checks against rank 0's ``plan``: its own
    config, files and device on each phase's layout (``check_task``), the phase named."""
    for p in plan.phases:
        try:
            check_task(p.cfg, p.run)
        except (ValueError, FileNotFoundError) as e:
            if len(plan) == 1:
                raise
            raise ValueError(f"trainer.phases[{p.index}] (seq_len {p.seq_len}): {e}") from None


def resolve_phases_group(cfg: RunConfig, device_type: str, env=None,
                         say=_print) -> PhasePlan:
    """``resolve_phases`` inside an existing process group (collective), as
    ``resolve_run_group``: rank 0 resolves, every rank receives its plan and checks its own
    task (``check_phase_tasks``); a refusal on any rank is raised on every rank; then rank 0
    says the phases' headings and tables (``say``). The run trains in this group: it needs
    ``trainer.run_dir`` (refused alike on every rank before any collective)."""
    if cfg.trainer.run_dir is None:
        raise ValueError("the run has no run directory: set trainer.run_dir=PATH (usp-train "
                         "takes Hydra's output folder when it is not set)")
    return decide_in_group(lambda world, said: resolve_phases(cfg, world, device_type, env,
                                                              say=said),
                           check_phase_tasks, say)
