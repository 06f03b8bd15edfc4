"""``configs/optim``: AdamW and its schedule. The defaults are the ``adamw`` option."""

from __future__ import annotations

from dataclasses import dataclass

from .checks import above, at_least


@dataclass
class OptimConfig:
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup_steps: int = 30
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        above("optim", 0, lr=self.lr, grad_clip=self.grad_clip)
        at_least("optim", 0, min_lr=self.min_lr, warmup_steps=self.warmup_steps,
                 weight_decay=self.weight_decay, beta1=self.beta1, beta2=self.beta2)
        if self.min_lr > self.lr:
            raise ValueError(f"optim.min_lr={self.min_lr} > optim.lr={self.lr}: the schedule "
                             f"decays from lr to min_lr; set optim.min_lr<={self.lr}")
        for name, beta in (("beta1", self.beta1), ("beta2", self.beta2)):
            if beta >= 1:
                raise ValueError(f"optim.{name}={beta} must be < 1 (AdamW averages with it); "
                                 f"use e.g. optim.beta1=0.9 optim.beta2=0.95")
