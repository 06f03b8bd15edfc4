"""Command-line entry points: ``usp-train`` and ``usp-plan`` (Hydra).

The only module that touches Hydra/OmegaConf: it composes ``configs/`` (+ ``recipes/``),
validates against the structured schemas below, and hands typed dataclasses to the library.
"""

from __future__ import annotations

import dataclasses
import difflib
import gc
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from .config import DATA_KINDS, ModelConfig, PlanConfig, RunConfig
from .data.dataset import AUTO, build_validation, check_vocab, data_vocab

CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "configs")


@dataclass
class _ModelSchema(ModelConfig):
    """``model`` as Hydra holds it: ``vocab_size`` may also be ``auto`` (the data's
    vocabulary, resolved by ``to_config`` into the ``ModelConfig`` the library gets)."""

    vocab_size: Any = ModelConfig.vocab_size

    def __post_init__(self) -> None:
        if isinstance(self.vocab_size, str) and self.vocab_size != AUTO:
            raise ValueError(f"model.vocab_size={self.vocab_size!r} is neither a whole number "
                             f"nor {AUTO} (the data's vocabulary)")
        if self.vocab_size != AUTO:
            super().__post_init__()


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


def _check_config_dir() -> None:
    if not Path(CONFIG_DIR, "train.yaml").exists():
        raise SystemExit(
            f"usp: config directory {CONFIG_DIR} not found; install usp from its source "
            f"checkout with `pip install -e .`"
        )


def unknown_keys(node: DictConfig, prefix: str = "") -> list[str]:
    """Dotted keys of ``node`` that its dataclass schema lacks.

    Hydra's struct mode refuses ``trainer.foo=1``, but ``+trainer.foo=1`` opens the node to
    add the key and ``OmegaConf.to_object`` then sets it as a stray attribute nobody reads.
    """
    schema = OmegaConf.get_type(node)
    known = ({f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema)
             else None)
    found = []
    for key in node.keys():
        name = f"{prefix}{key}"
        if known is not None and key not in known:
            near = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f"did you mean {prefix}{near[0]}?" if near else f"known: {', '.join(sorted(known))}"
            found.append(f"{name} ({hint})")
        elif OmegaConf.is_dict(node._get_node(key)):
            found += unknown_keys(node[key], f"{name}.")
    return found


def to_config(dcfg: DictConfig) -> RunConfig:
    """Hydra's composed config -> a ``RunConfig`` (``PlanConfig`` for usp-plan); refuses keys
    the schema lacks and the values the dataclasses refuse (their ``__post_init__``), as
    ``ValueError``."""
    stray = unknown_keys(dcfg)
    if stray:
        raise ValueError(f"unknown config key {'; '.join(stray)}: the schema has no such field; "
                         f"drop the override or fix its name")
    composed = OmegaConf.to_object(dcfg)
    cls = _LIBRARY_TYPE[type(composed)]
    fields = {f.name: getattr(composed, f.name) for f in dataclasses.fields(cls)}
    model = dataclasses.asdict(composed.model)
    if model["vocab_size"] == AUTO:  # the data's metadata, read by every task before any group
        model["vocab_size"] = data_vocab(composed.data)
    fields["model"] = ModelConfig(**model)
    return cls(**fields)


def _refuse(prog: str, e: Exception, status: int = 2) -> None:
    """Print one line ``prog: error: ...`` (no traceback) and exit with ``status``. In a
    torchrun/Slurm launch every task refuses alike; only the first task prints."""
    text = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
    if _task_rank() == 0:
        print(f"{prog}: error: {text}", file=sys.stderr, flush=True)
    raise SystemExit(status)


def _task_rank() -> int:
    """This task's rank in a torchrun/Slurm launch (0 outside one)."""
    from .launch import launcher_env

    info = launcher_env()
    return 0 if info is None else info["rank"]


def run_training(cfg: RunConfig) -> None:
    """Launch: torchrun/Slurm environment if present, else spawn ``trainer.nprocs`` local ranks.

    The run's layout (``usp.run.RunLayout``) is resolved once, before training: here, in
    the parent of the spawned ranks, or by rank 0 of a torchrun/Slurm launch for all of
    them; every rank builds its mesh, model and trainer from that one object.
    """
    import torch
    import torch.distributed as dist

    from .launch import choose_device, init_from_env, launcher_env, run_local
    from .run import resolve_run, resolve_run_group
    from .train.faults import Preempted
    from .train.trainer import train

    info = launcher_env()
    if info is None:
        nprocs = cfg.trainer.nprocs
        _, device_type = choose_device(cfg.trainer.device, nprocs, torch.cuda.is_available(),
                                       torch.cuda.device_count())
        run = resolve_run(cfg, nprocs, device_type)  # refuse bad layouts/data before spawning
        if run.plan_table:
            print(run.plan_table, flush=True)
        code = run_local(_local_worker, nprocs, cfg, run, device_type=device_type,
                         max_restarts=cfg.trainer.max_restarts, timeout_s=cfg.trainer.timeout_s)
        if code:  # the ranks' own exit code, e.g. preempted after a forwarded SIGTERM
            raise SystemExit(code)
        return
    # every task refuses, before any process group, a model too small for its data (from
    # the data's metadata) and trainer.eval_windows without a validation split; the local
    # launch checks both in resolve_run, before spawning
    check_vocab(cfg.data, cfg.model)
    build_validation(cfg.data, cfg.model, cfg.trainer.eval_windows)
    # refuses a missing GPU before joining; trainer.timeout_s bounds every collective
    device = init_from_env(info, cfg.trainer.device, timeout_s=cfg.trainer.timeout_s)
    try:
        # every rank composed its own config; rank 0's run directory is the run's
        run_dir = [cfg.trainer.run_dir]
        dist.broadcast_object_list(run_dir, src=0)
        cfg.trainer.run_dir = run_dir[0]
        run = resolve_run_group(cfg, device.type)  # rank 0's layout, checked on every rank
        if info["rank"] == 0 and run.plan_table:
            print(run.plan_table, flush=True)
        try:
            train(cfg, run)
        except Preempted as e:  # every rank checkpointed at e.step: requeue with resume
            raise SystemExit(e.exit_code) from None
    finally:
        gc.collect()  # train() closed its mesh; free what is left before the world goes
        dist.destroy_process_group()


def _local_worker(cfg: RunConfig, run) -> None:
    from .train.trainer import train

    train(cfg, run)


@hydra.main(config_path=CONFIG_DIR, config_name="train", version_base="1.3")
def _train_main(dcfg) -> None:
    from hydra.core.hydra_config import HydraConfig

    try:
        cfg: RunConfig = to_config(dcfg)
        if cfg.trainer.run_dir is None:
            cfg.trainer.run_dir = HydraConfig.get().runtime.output_dir
        run_training(cfg)
    except (ValueError, FileNotFoundError) as e:  # refused before launch: no traceback
        _refuse("usp-train", e)
    except RuntimeError as e:  # the ranks failed (their tracebacks are above): one last line
        _refuse("usp-train", e, status=1)


def train_main() -> None:
    _check_config_dir()
    _train_main()


@hydra.main(config_path=CONFIG_DIR, config_name="plan", version_base="1.3")
def _plan_main(dcfg) -> None:
    try:
        _plan(to_config(dcfg))
    except (ValueError, FileNotFoundError) as e:
        _refuse("usp-plan", e)


def _plan(cfg: PlanConfig) -> None:
    from .run import plan_report

    text, drawing = plan_report(cfg)
    print(text)
    if cfg.png:
        drawing.save_png(cfg.png)
        print(f"mesh picture: {Path(cfg.png).resolve()}")


def plan_main() -> None:
    _check_config_dir()
    _plan_main()


if __name__ == "__main__":  # torchrun -m usp.cli ...
    train_main()
