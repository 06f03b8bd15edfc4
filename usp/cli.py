"""Command-line entry points: ``usp-train``, ``usp-plan`` and ``usp-eval`` (Hydra).

The only modules that touch Hydra/OmegaConf, with ``usp.hydra_app`` (what Hydra is given and
how its refusals read): it composes ``configs/`` (+ ``recipes/``), validates against the
structured schemas below, and hands typed dataclasses to the library.

One path, read forward: each console script runs its Hydra app (``_run_app``); the app
parses (``to_config``; the model's ``auto`` keys are the resolver's, ``usp.run.model_shape``)
and hands over: ``usp-train`` to ``usp.train.command`` (the launcher asks the resolver for the
plan, then every rank runs ``train``), ``usp-eval`` to ``usp.eval.command`` the same way,
``usp-plan`` to the planner's report. Nothing it calls calls back into this module
(``tests/unit/test_walk.py``).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .config import DATA_KINDS, ModelConfig, PlanConfig, RunConfig
from .config import files as config_files
from .config.model import CHECKPOINT_FIELDS
from .data.dataset import AUTO
from .hydra_app import (REFUSED, cluster_file_overrides, config_error, forget_run_dir, keep_run_dir,
                        stray_key, unknown_key_error)
from .launch.job import JobError
from .models.families import check_model
from .run.model_shape import resolve_model

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
# it may be ``auto``, ``vocab_size`` too (the data's vocabulary); ``to_config`` has the
# resolver fill them (``usp.run.model_shape``) and types the ``ModelConfig`` the library gets
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
    its family cannot hold (``usp.models.families.check_model``), as ``ValueError``. The
    model's ``auto`` keys are filled on the way by the resolver
    (``usp.run.model_shape.resolve_model``): the typed ``ModelConfig`` holds none."""
    stray = unknown_keys(dcfg)
    if stray:
        raise unknown_key_error(stray)
    composed = OmegaConf.to_object(dcfg)
    cls = _LIBRARY_TYPE[type(composed)]
    fields = {f.name: getattr(composed, f.name) for f in dataclasses.fields(cls)}
    # the model's auto keys, the resolver's first decision (a ModelConfig holds no auto)
    model = resolve_model(dataclasses.asdict(composed.model), composed.data)
    # typed as the library's ModelConfig (the schema's auto keys are untyped)
    fields["model"] = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig),
                                                          model))
    check_model(fields["model"])  # model.hf / model.arch: a family, and a shape it holds
    return cls(**fields)


def _refuse(prog: str, e: Exception, status: int = REFUSED) -> None:
    """Print ``prog: error: ...`` (no traceback) and exit with ``status``.

    In a torchrun/Slurm launch a refusal decided together before the process group
    (``usp.launch.SharedRefusal``) is the same on every task: rank 0 prints it once, with
    the task count, and the others exit quietly with the same code. Anything else is the
    rank's own (a fault, a lost peer, a rendezvous that is not its job's): that rank prints
    it, named. Under submitit the line is raised as ``JobError`` instead."""
    from .launch import SharedRefusal, launcher_env
    from .launch.job import under_submitit

    text = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
    info = launcher_env()
    shared = isinstance(e, SharedRefusal)
    if info is not None and shared:
        text += f" (all {info['world']} tasks stop with this error)"
    elif info is not None and not text.startswith("rank "):
        text = f"rank {info['rank']}: {text}"
    if info is None or not shared or info["rank"] == 0:
        print(f"{prog}: error: {text}", file=sys.stderr, flush=True)
    if under_submitit():
        raise JobError(f"{prog}: error: {text}") from None
    raise SystemExit(status)


def _run_app(app, prog: str) -> None:
    """Run the Hydra app ``app`` (an ``@hydra.main`` function below) on ``sys.argv``, each
    ``cluster=PATH.yaml`` made an option first (``cluster_file_overrides``). A config Hydra
    cannot compose is refused as ``prog: error: ...`` (``config_error``), and a command
    refused once it ran (exit ``REFUSED``) leaves no run directory behind
    (``forget_run_dir``).

    Hydra is asked to raise what it refuses (``HYDRA_FULL_ERROR=1`` while the app runs), so an
    error of the run itself that nothing caught ends with Python's own traceback and exit 1.
    ``HYDRA_FULL_ERROR=1`` set by the user keeps Hydra's exceptions as they are."""
    try:
        sys.argv[:] = cluster_file_overrides(sys.argv)
    except ValueError as e:  # a cluster file missing or unreadable
        _refuse(prog, e)
    user = os.environ.get("HYDRA_FULL_ERROR")
    try:
        os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises what it cannot compose, unprinted
        app()
    except SystemExit as e:
        if e.code == REFUSED:  # refused before anything ran: nothing of it stays on disk
            forget_run_dir()
        raise
    except (HydraException, OmegaConfBaseException) as e:
        if user == "1":
            raise
        _refuse(prog, config_error(e, sys.argv[1:]))
    finally:
        if user is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = user


def run_training(cfg: RunConfig, run_dir: str | None = None) -> None:
    """usp-train's launch (``usp.train.command``): the run's plan decided before any process
    group, then the ranks train it. ``run_dir``: where the run writes when
    ``trainer.run_dir`` is not set (Hydra's folder)."""
    from .train.command import run_job, training_job

    job = training_job(cfg, run_dir)  # refuses bad layouts/data before any rank starts
    keep_run_dir()  # accepted: from here a failure is the run's, its directory stays
    run_job(job, cfg)


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
    _run_app(_train_main, "usp-train")


@hydra.main(config_path=CONFIG_DIR, config_name="plan", version_base="1.3")
def _plan_main(dcfg) -> None:
    try:
        _plan(to_config(dcfg))
    except (ValueError, FileNotFoundError) as e:
        _refuse("usp-plan", e)


def _plan(cfg: PlanConfig) -> None:
    from .models.families import check_priced
    from .planner.longest import longest_report
    from .planner.phase_report import phases_report
    from .planner.report import plan_report

    check_priced(cfg.model, "usp-plan")
    if cfg.longest:
        print(longest_report(cfg))
        return
    text, drawing = phases_report(cfg) if cfg.trainer.phases else plan_report(cfg)
    print(text)
    if cfg.png:
        drawing.save_png(cfg.png)
        print(f"mesh picture: {Path(cfg.png).resolve()}")


def plan_main() -> None:
    _run_app(_plan_main, "usp-plan")


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
    _run_app(_eval_main, "usp-eval")


if __name__ == "__main__":  # torchrun -m usp.cli ...
    train_main()
