"""Command-line entry points: ``usp-train``, ``usp-plan`` and ``usp-eval`` (Hydra).

The only modules that touch Hydra/OmegaConf, with ``usp.hydra_app`` (how the app runs and
how Hydra's refusals read): it composes ``configs/`` (+ ``recipes/``), validates against the
structured schemas below, and hands typed dataclasses to the library.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from .config import DATA_KINDS, ModelConfig, PlanConfig, RunConfig
from .config import files as config_files
from .config.model import CHECKPOINT_FIELDS
from .data.dataset import AUTO, data_vocab
from .hydra_app import REFUSED, keep_run_dir, run_app, stray_key, unknown_key_error
from .models.families import check_model
from .models.pretrained import fill_model

# hydra-core 1.4 warns about version_base="1.3" at every start (three lines on every task of
# a job); 1.3 semantics are what the configs are written for
warnings.filterwarnings("ignore", message="The version_base parameter is deprecated")

CONFIG_DIR = str(config_files.CONFIG_DIR)  # configs/ as the package ships it


def _check_vocab(self) -> None:
    if isinstance(self.vocab_size, str) and self.vocab_size != AUTO:
        raise ValueError(f"model.vocab_size={self.vocab_size!r} is neither a whole number "
                         f"nor {AUTO} (the data's vocabulary)")
    # the values are checked as a ModelConfig once to_config has filled the autos


# ``model`` as Hydra holds it: ``ModelConfig`` with each key a checkpoint may fill
# (``CHECKPOINT_FIELDS``: ``model.pretrained``, ``usp.models.pretrained``) typed Any, so that
# it may be ``auto``, ``vocab_size`` too (the data's vocabulary); ``to_config`` resolves them
# into the ``ModelConfig`` the library gets
_ModelSchema = dataclasses.make_dataclass(
    "_ModelSchema", [(f.name, Any, field(default=f.default))
                     for f in dataclasses.fields(ModelConfig) if f.name in CHECKPOINT_FIELDS],
    bases=(ModelConfig,), namespace={"__post_init__": _check_vocab, "__module__": __name__})


# OmegaConf cannot type a union of dataclasses, so in the schemas Hydra holds ``data`` is
# open: each configs/data/<kind>.yaml extends /schema/data/<kind>, the dataclass of its kind.
@dataclass
class _TrainSchema(RunConfig):
    model: _ModelSchema = field(default_factory=_ModelSchema)
    data: Any = MISSING


@dataclass
class _PlanSchema(PlanConfig):
    model: _ModelSchema = field(default_factory=_ModelSchema)
    data: Any = MISSING


_LIBRARY_TYPE = {_TrainSchema: RunConfig, _PlanSchema: PlanConfig}


def register_schemas() -> None:
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=_TrainSchema)
    cs.store(name="plan_schema", node=_PlanSchema)
    for kind, cls in DATA_KINDS.items():
        cs.store(group="schema/data", name=kind, node=cls)


register_schemas()


def unknown_keys(node, prefix: str = "") -> list[str]:
    """Dotted keys of ``node`` (a DictConfig) that its dataclass schema lacks, also inside
    dicts and lists of dicts (``data.blend[0].foo``).

    Hydra refuses ``trainer.foo=1`` itself (``usp.hydra_app.config_error`` words it), but
    ``+trainer.foo=1`` opens the node to add the key and ``OmegaConf.to_object`` then sets it
    as a stray attribute nobody reads.
    """
    schema = OmegaConf.get_type(node)
    known = ({f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema)
             else None)
    found = []
    for key in node.keys():
        name, child = f"{prefix}{key}", node._get_node(key)
        if known is not None and key not in known:
            found.append(stray_key(name, key, known, prefix))
        elif OmegaConf.is_dict(child) and not child._is_none():  # None: an unset dataclass
            found += unknown_keys(node[key], f"{name}.")
        elif OmegaConf.is_list(child) and not child._is_none():
            for i in range(len(child)):
                if OmegaConf.is_dict(child._get_node(i)):
                    found += unknown_keys(child[i], f"{name}[{i}].")
    return found


def to_config(dcfg: DictConfig) -> RunConfig:
    """Hydra's composed config -> a ``RunConfig`` (``PlanConfig`` for usp-plan); refuses keys
    the schema lacks, the values the dataclasses refuse (their ``__post_init__``) and a model
    its family cannot hold (``usp.models.families.check_model``), as ``ValueError``."""
    stray = unknown_keys(dcfg)
    if stray:
        raise unknown_key_error(stray)
    composed = OmegaConf.to_object(dcfg)
    cls = _LIBRARY_TYPE[type(composed)]
    fields = {f.name: getattr(composed, f.name) for f in dataclasses.fields(cls)}
    model = dataclasses.asdict(composed.model)
    # the data's metadata and a checkpoint's config.json, read by every task before any group
    vocab = data_vocab(composed.data) if _reads_vocab(model, composed.data) else None
    model = fill_model(model, vocab)
    # typed as the library's ModelConfig (the schema's auto keys are untyped)
    fields["model"] = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig),
                                                          model))
    check_model(fields["model"])  # model.hf / model.arch: a family, and a shape it holds
    return cls(**fields)


def _reads_vocab(model: dict, data) -> bool:
    """The data's vocabulary is needed: ``vocab_size=auto``, or token files with a checkpoint
    read for ``auto`` keys (its embedding must cover them)."""
    from .config import MemmapData

    if model["pretrained"] is not None:  # read with the checkpoint (a stated shape: neither)
        return isinstance(data, MemmapData) and AUTO in model.values()
    return model["vocab_size"] == AUTO


class JobError(RuntimeError):
    """Under submitit: what usp-train would print and exit with, as an exception, so that
    submitit writes it as the job's result and the submitter reports it (a ``SystemExit``
    would leave no result and the submitter polling)."""


def _refuse(prog: str, e: Exception, status: int = REFUSED) -> None:
    """Print ``prog: error: ...`` (no traceback) and exit with ``status``.

    In a torchrun/Slurm launch a refusal decided together before the process group
    (``usp.launch.SharedRefusal``) is the same on every task: rank 0 prints it once, with
    the task count, and the others exit quietly with the same code. Anything else is the
    rank's own (a fault, a lost peer, a rendezvous that is not its job's): that rank prints
    it, named. Under submitit the line is raised as ``JobError`` instead."""
    from .launch import SharedRefusal, launcher_env

    text = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
    info = launcher_env()
    shared = isinstance(e, SharedRefusal)
    if info is not None and shared:
        text += f" (all {info['world']} tasks stop with this error)"
    elif info is not None and not text.startswith("rank "):
        text = f"rank {info['rank']}: {text}"
    if info is None or not shared or info["rank"] == 0:
        print(f"{prog}: error: {text}", file=sys.stderr, flush=True)
    if _under_submitit():
        raise JobError(f"{prog}: error: {text}") from None
    raise SystemExit(status)


def _under_submitit() -> bool:
    import os

    from .slurm import under_submitit

    return under_submitit(os.environ)


def run_training(cfg: RunConfig, run_dir: str | None = None) -> None:
    """Launch: torchrun/Slurm environment if present, else spawn ``trainer.nprocs`` local ranks.
    ``run_dir``: where the run writes when ``trainer.run_dir`` is not set (Hydra's folder).

    The run's plan (``usp.run.PhasePlan``: a ``RunLayout`` per length phase, one without
    ``trainer.phases``) is resolved once, before any process starts training: here, in the
    parent of the spawned ranks; under torchrun/Slurm by rank 0 before any process group,
    checked by every other task on its own config and machine, the verdicts exchanged in the
    rendezvous store (``usp.launch.decide_together``: a layout that cannot fit the
    allocation is refused at once, alike on every task). Every rank builds its mesh, model
    and trainer from that one object: ``train(plan.cfg, plan)``.
    """
    from functools import partial

    import torch

    from .launch import choose_device, launcher_env, run_local
    from .run import resolve_phases, scheduler_hosts_notice

    info = launcher_env()
    say = partial(print, flush=True)
    if info is None:
        nprocs = cfg.trainer.nprocs
        _, device = choose_device(cfg.trainer.device, nprocs, torch.cuda.is_available(),
                                  torch.cuda.device_count())  # the run's device, decided once
        # refuse bad layouts/data before spawning
        plan = resolve_phases(cfg, nprocs, device, run_dir=run_dir, say=say)
        keep_run_dir()  # accepted: from here a failure is the run's, its directory stays
        code = run_local(_local_worker, nprocs, plan.cfg, plan, device_type=plan[0].run.device,
                         max_restarts=cfg.trainer.max_restarts, timeout_s=cfg.trainer.timeout_s)
        if code:  # the ranks' own exit code, e.g. preempted after a forwarded SIGTERM
            _local_exit(cfg, code)
        return
    slurm = info["kind"] == "slurm"  # the scheduler's hosts are the topology, not a recipe's
    notice = scheduler_hosts_notice(cfg, info["placement"] or "from Slurm") if slurm else None
    if notice and info["rank"] == 0:
        print(f"usp: {notice}", flush=True)
    # before any process group: rank 0 resolves the layout for this allocation (degrees,
    # heads, sequence, data, kernel) and every other task checks its own config, data and
    # device against it; the verdicts meet in the rendezvous store, so one refusal is
    # raised on every task within a second of start-up
    from .launch import decide_together, rendezvous_store
    from .run import check_phase_tasks

    # (resolve_run and check_task include the data checks: vocabulary, validation split)
    said = []  # rank 0's planner table, said once every task agreed

    def decide():
        _, device = choose_device(cfg.trainer.device, 1, torch.cuda.is_available(),
                                  torch.cuda.device_count())  # the run's device, decided once
        # every rank composed its own config; rank 0's run directory is the run's
        return resolve_phases(cfg, info["world"], device, scheduler_hosts=slurm,
                              run_dir=run_dir, say=said.append)

    def check(decided):
        check_phase_tasks(decided)  # this task on rank 0's layouts, its device included

    store = rendezvous_store(info, cfg.trainer.timeout_s)
    plan = decide_together(store, info, decide, check, cfg.trainer.timeout_s)
    for text in said:
        say(text)
    keep_run_dir()  # accepted by every task: from here a failure is the run's
    _train_launched(cfg, info, plan, store)


def _train_launched(cfg: RunConfig, info: dict, plan, store) -> None:
    """Join the launch's process group and train ``plan`` (``usp.run.PhasePlan``); a
    preempted Slurm job is requeued by rank 0 after its checkpoint (``usp.slurm.requeue``)."""
    import torch.distributed as dist

    from .launch import init_from_env
    from .train.faults import Preempted
    from .train.trainer import train

    # refuses a missing GPU before joining; trainer.timeout_s bounds every collective
    init_from_env(info, plan[0].run.device, timeout_s=cfg.trainer.timeout_s, store=store)
    preempted, requeued = None, False
    try:
        train(plan.cfg, plan)
    except Preempted as e:  # every rank checkpointed at e.step
        preempted = e
        requeued, line = _requeue(cfg, info)
    finally:
        gc.collect()  # train() closed its mesh; free what is left before the world goes
        dist.destroy_process_group()
    if preempted is None:
        return
    if _under_submitit() and not requeued:  # the submitter learns it from the result
        raise JobError(f"usp-train: {preempted}; {line}")
    raise SystemExit(preempted.exit_code)


def _requeue(cfg: RunConfig, info: dict) -> tuple[bool, str]:
    """After the preemption checkpoint (collective): rank 0 requeues the Slurm batch job
    (``trainer.requeue``) and every rank learns whether it did."""
    import os
    import signal

    import torch.distributed as dist

    from .slurm import requeue

    # requeueing ends this job step with SIGTERM: the ranks finish exiting first, with 75
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if info["kind"] != "slurm":
        return False, "not a Slurm job: not requeued; run it again to resume"
    if not cfg.trainer.requeue:
        return False, "trainer.requeue=false: not requeued; submit it again to resume"
    dist.barrier()  # every rank ignores SIGTERM before rank 0 asks Slurm to end the step
    outcome = [requeue(os.environ) if info["rank"] == 0 else None]
    if info["rank"] == 0:
        print(f"usp: {outcome[0][1]}", flush=True)
    dist.broadcast_object_list(outcome, src=0)
    return outcome[0]


def _local_exit(cfg: RunConfig, code: int) -> None:
    """The local launcher's ranks exited with ``code``. Inside a one-task Slurm job (the
    launcher spawns the ranks) a preemption requeues the job as a multi-task one does;
    under submitit the outcome is raised as ``JobError`` unless the job was requeued."""
    import os
    import signal

    from . import slurm
    from .train.faults import PREEMPTED_EXIT_CODE

    line = f"the ranks exited with {code}"
    requeued = False
    if code == PREEMPTED_EXIT_CODE and os.environ.get("SLURM_JOB_ID"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the requeue ends this step
        if cfg.trainer.requeue:
            requeued, line = slurm.requeue(os.environ)
        else:
            line = "trainer.requeue=false: not requeued; submit it again to resume"
        print(f"usp: {line}", flush=True)
    if _under_submitit() and not requeued:
        raise JobError(f"usp-train: {line}")
    raise SystemExit(code)


def _local_worker(cfg: RunConfig, plan) -> None:
    from .train.trainer import train

    train(cfg, plan)  # plan.cfg: the base config, trainer.steps the phases' total


@hydra.main(config_path=CONFIG_DIR, config_name="train", version_base="1.3")
def _train_main(dcfg) -> None:
    from hydra.core.hydra_config import HydraConfig

    try:
        cfg: RunConfig = to_config(dcfg)
        run_training(cfg, run_dir=HydraConfig.get().runtime.output_dir)
    except JobError:  # under submitit: already said, the result carries it
        raise
    except (ValueError, FileNotFoundError) as e:  # refused before launch: no traceback
        _refuse("usp-train", e)
    except RuntimeError as e:  # the ranks failed (their tracebacks are above): one last line
        _refuse("usp-train", e, status=1)


def train_main() -> None:
    run_app(_train_main, lambda e: _refuse("usp-train", e), sys.argv)


@hydra.main(config_path=CONFIG_DIR, config_name="plan", version_base="1.3")
def _plan_main(dcfg) -> None:
    try:
        _plan(to_config(dcfg))
    except (ValueError, FileNotFoundError) as e:
        _refuse("usp-plan", e)


def _plan(cfg: PlanConfig) -> None:
    from .planner.phase_report import phases_report
    from .planner.report import plan_report

    text, drawing = phases_report(cfg) if cfg.trainer.phases else plan_report(cfg)
    print(text)
    if cfg.png:
        drawing.save_png(cfg.png)
        print(f"mesh picture: {Path(cfg.png).resolve()}")


def plan_main() -> None:
    run_app(_plan_main, lambda e: _refuse("usp-plan", e), sys.argv)


@hydra.main(config_path=CONFIG_DIR, config_name="eval", version_base="1.3")
def _eval_main(dcfg) -> None:
    from hydra.core.hydra_config import HydraConfig

    from .eval.command import evaluate

    try:
        code = evaluate(to_config(dcfg), HydraConfig.get().runtime.output_dir)
    except (ValueError, FileNotFoundError) as e:  # refused before launch: no traceback
        _refuse("usp-eval", e)
    except RuntimeError as e:  # the ranks failed (their tracebacks are above)
        _refuse("usp-eval", e, status=1)
    if code:
        raise SystemExit(code)


def eval_main() -> None:
    run_app(_eval_main, lambda e: _refuse("usp-eval", e), sys.argv)


if __name__ == "__main__":  # torchrun -m usp.cli ...
    train_main()
