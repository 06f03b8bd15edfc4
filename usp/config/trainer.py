"""``configs/trainer``: the run itself. The defaults are the ``default`` option."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import List, Optional

import torch

from .checks import above, at_least, one_of
from .phases import PhaseConfig, check_phases

# trainer.dtype -> the dtype forward and backward compute in; master weights, gradients and
# optimizer state stay fp32 (FSDP2 mixed precision)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LOSS_NORMS = ("token", "document")


def torch_dtype(name: str) -> torch.dtype:
    """``trainer.dtype`` -> its torch dtype; ValueError for a name not in ``DTYPES``."""
    one_of("trainer.dtype", name, tuple(DTYPES))
    return DTYPES[name]


def parse_signals(names: str) -> list[signal.Signals]:
    """``"SIGTERM,SIGUSR1"`` -> the signals (``""``: none); ValueError on a name this
    platform lacks or a signal no process can catch (SIGKILL, SIGSTOP)."""
    out = []
    for name in (n.strip() for n in names.split(",") if n.strip()):
        sig = getattr(signal.Signals, name.upper(), None)
        if sig is None or sig in (signal.SIGKILL, signal.SIGSTOP):
            why = "cannot be caught" if sig is not None else "is not a signal name here"
            raise ValueError(f"trainer.preempt_signals={names!r}: {name} {why}; use a comma "
                             f"list such as SIGTERM,SIGUSR1 (or '' for none)")
        out.append(sig)
    return out


@dataclass
class TrainerConfig:
    steps: int = 600
    seed: int = 0
    dtype: str = "fp32"  # a key of DTYPES
    activation_checkpointing: bool = False
    checkpoint_every: int = 1  # with checkpointing: blocks 0, k, 2k, ... are checkpointed
    checkpoint_part: str = "block"  # what a checkpointed block recomputes: block | attention | mlp
    activation_offload: bool = False  # CUDA: checkpointed inputs go to pinned host memory
    # CUDA: sharded fp32 params, grads and AdamW state in pinned host memory (FSDP2's
    # CPUOffloadPolicy); the optimizer step runs on the host
    state_offload: bool = False
    log_every: int = 10
    ckpt_every: int = 100  # steps between checkpoints (0: only at the end and on preemption)
    keep_checkpoints: int = 2  # complete checkpoints kept (the newest ones)
    run_dir: Optional[str] = None  # None: the CLI uses the Hydra run directory
    resume: bool = True  # continue from run_dir's latest checkpoint when there is one
    nprocs: int = 4  # ranks to spawn when launched without torchrun/Slurm
    device: str = "auto"  # auto | cpu | cuda
    stop_after: Optional[int] = None  # stop early at this step (tests: simulate a crash)
    timeout_s: float = 600.0  # collective timeout: a stuck peer becomes an error after this
    max_restarts: int = 0  # local launch: relaunch all ranks from the last checkpoint this often
    # checkpoint at the next step, then exit 75 ("" = off); SIGUSR2 is submitit's warning
    preempt_signals: str = "SIGTERM,SIGUSR1,SIGUSR2"
    requeue: bool = True  # a preempted Slurm batch job requeues itself after its checkpoint
    on_nonfinite: str = "stop"  # non-finite loss/grad norm: stop (keep the last good ckpt) | skip
    grad_accum_steps: Optional[int] = None  # micro-batches per optimizer step (None: 1, or T's)
    global_batch_tokens: Optional[int] = None  # T: tokens per optimizer step; sets grad_accum_steps
    eval_every: int = 0  # steps between validation-loss evaluations (0: only after the last)
    eval_windows: Optional[int] = None  # validation windows scored; None: up to 16 if a split exists
    # token: every labelled token of a step weighs the same; document: every document
    # (conversation) with a labelled token does, its tokens averaged inside it
    loss_norm: str = "token"
    # length phases (usp/config/phases.py): [{seq_len, steps | tokens, ...}, ...]; None or
    # empty: one phase of the keys above. With phases, steps is derived as the phases' total
    # (usp.run.resolve_phases), and stop_after is checked against that total there
    phases: Optional[List[PhaseConfig]] = None

    def __post_init__(self) -> None:
        at_least("trainer", 1, steps=self.steps, keep_checkpoints=self.keep_checkpoints,
                 nprocs=self.nprocs)
        at_least("trainer", 0, log_every=self.log_every, ckpt_every=self.ckpt_every,
                 max_restarts=self.max_restarts)
        above("trainer", 0, timeout_s=self.timeout_s)
        torch_dtype(self.dtype)
        one_of("trainer.on_nonfinite", self.on_nonfinite, ("stop", "skip"))
        one_of("trainer.loss_norm", self.loss_norm, LOSS_NORMS)
        one_of("trainer.checkpoint_part", self.checkpoint_part, ("block", "attention", "mlp"))
        at_least("trainer", 1, checkpoint_every=self.checkpoint_every)
        if self.activation_offload and not self.activation_checkpointing:
            raise ValueError("trainer.activation_offload=true offloads the inputs that activation "
                             "checkpoints keep, but trainer.activation_checkpointing=false; set "
                             "trainer.activation_checkpointing=true or activation_offload=false")
        parse_signals(self.preempt_signals)
        at_least("trainer", 0, eval_every=self.eval_every)
        for key in ("grad_accum_steps", "global_batch_tokens", "eval_windows"):
            if getattr(self, key) is not None:
                at_least("trainer", 1, **{key: getattr(self, key)})
        self.phases = list(self.phases) if self.phases else None
        if self.phases:
            check_phases(self.phases)
            if self.stop_after is not None:  # its upper bound, the total: resolve_phases
                at_least("trainer", 1, stop_after=self.stop_after)
        elif self.stop_after is not None and not 1 <= self.stop_after <= self.steps:
            raise ValueError(f"trainer.stop_after={self.stop_after} is outside 1..trainer.steps="
                             f"{self.steps}; set it in that range or to null")

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)
