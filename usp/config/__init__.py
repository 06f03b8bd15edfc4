"""The typed configuration: one dataclass per group of ``configs/``, used by the library, the
planner and the CLI (only the CLI touches Hydra/OmegaConf; it turns YAML into these).

| ``configs/``     | dataclass                                   | module                  |
|------------------|---------------------------------------------|-------------------------|
| ``model/``       | ``ModelConfig``                             | ``usp.config.model``    |
| ``parallel/``    | ``ParallelConfig``                          | ``usp.config.parallel`` |
| ``cluster/``     | ``ClusterSpec``                             | ``usp.config.cluster``  |
| ``data/``        | ``RecallData`` / ``MemmapData`` (by kind)   | ``usp.config.data``     |
| ``optim/``       | ``OptimConfig``                             | ``usp.config.optim``    |
| ``trainer/``     | ``TrainerConfig`` (``phases``: ``PhaseConfig``) | ``usp.config.trainer``  |
| ``logging/``     | ``LoggingConfig``                           | ``usp.config.logging``  |
| ``eval/``        | ``EvalConfig``                              | ``usp.config.eval``     |
| ``train.yaml``   | ``RunConfig``; ``plan.yaml``: ``PlanConfig`` | ``usp.config.run``      |

Each default value is written once, in the dataclass. The group option ``train.yaml``
picks by default holds no values (the dataclass defaults are that option); the other
options hold only what differs from the defaults, except the ``model`` and ``cluster``
options, which state a whole model shape or machine. ``tests/unit/test_cli.py`` checks this
for every file. Pure value rules live in each ``__post_init__``, so a bad value is refused
where the config is built (the CLI: before anything is launched); rules that need the
world size, the device or the file system are in ``usp.run.resolve_run``.
"""

from .cluster import ClusterSpec, load_cluster
from .data import DATA_KINDS, BlendSource, DataConfig, MemmapData, RecallData
from .eval import EvalConfig
from .logging import LoggingConfig
from .model import ModelConfig
from .optim import OptimConfig
from .parallel import ParallelConfig
from .phases import PhaseConfig, PhaseGateConfig, phase_config
from .trainer import DTYPES, TrainerConfig, parse_signals, torch_dtype
from .run import PlanConfig, RunConfig

__all__ = [
    "DATA_KINDS",
    "DTYPES",
    "BlendSource",
    "ClusterSpec",
    "DataConfig",
    "EvalConfig",
    "LoggingConfig",
    "MemmapData",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "PhaseConfig",
    "PhaseGateConfig",
    "PlanConfig",
    "RecallData",
    "RunConfig",
    "TrainerConfig",
    "load_cluster",
    "parse_signals",
    "phase_config",
    "torch_dtype",
]
