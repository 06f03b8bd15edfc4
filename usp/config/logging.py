"""``configs/logging``: where metrics go. The defaults are the ``offline`` option."""

from __future__ import annotations

from dataclasses import dataclass

from .checks import one_of


@dataclass
class LoggingConfig:
    wandb: str = "offline"  # offline | online | disabled
    project: str = "usp"
    jsonl: bool = True
    plot: bool = True
    progress: bool = True  # a tqdm bar on rank 0 when stderr is a terminal

    def __post_init__(self) -> None:
        one_of("logging.wandb", self.wandb, ("offline", "online", "disabled"))
