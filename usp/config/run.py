"""``configs/train.yaml`` and ``configs/plan.yaml``: a run is one option of every group."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .cluster import ClusterSpec
from .data import DataConfig, RecallData
from .eval import EvalConfig
from .logging import LoggingConfig
from .model import ModelConfig
from .optim import OptimConfig
from .parallel import ParallelConfig
from .trainer import TrainerConfig


@dataclass
class RunConfig:
    """Everything a training run needs; the CLI builds it from the Hydra config."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    data: DataConfig = field(default_factory=RecallData)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)  # usp-eval; passkey during training


@dataclass
class PlanConfig(RunConfig):
    """``usp-plan``: the same groups as training, plus the cluster size and outputs."""

    nodes: Optional[int] = None  # overrides cluster.nodes
    png: Optional[str] = None  # also draw the mesh to this PNG
    # price usp-eval's forward pass: no gradients, no optimizer state, the model whole on
    # every rank (memory only; the time column stays a training step's)
    forward_only: bool = False
    # the longest sequence the cluster trains over every layout (usp.planner.longest), not
    # the plan of data.seq_len
    longest: bool = False

    def __post_init__(self) -> None:
        if self.nodes is not None and not (isinstance(self.nodes, int) and self.nodes >= 1):
            raise ValueError(f"nodes={self.nodes!r} must be a whole number >= 1; pass nodes=1 "
                             f"or more")
