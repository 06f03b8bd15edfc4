"""Typed configuration shared by the library, the planner and the CLI.

Only the CLI touches Hydra/OmegaConf; it turns YAML into these dataclasses.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Any, Optional

# Pure value rules live in each dataclass's __post_init__, so a bad value is refused where
# the config is built (the CLI: before anything is launched). Rules that need the world
# size, the device or the file system are in ``usp.train.setup.preflight``.


def _at_least(section: str, lo: float, **values: Any) -> None:
    """Refuse any ``section.name`` below ``lo`` (NaN included), naming the value and a fix."""
    for name, v in values.items():
        if not v >= lo:
            raise ValueError(f"{section}.{name}={v} must be >= {lo}; set {section}.{name} to "
                             f"{lo} or more")


def _above(section: str, lo: float, **values: Any) -> None:
    """Refuse any ``section.name`` not strictly above ``lo`` (NaN included)."""
    for name, v in values.items():
        if not v > lo:
            raise ValueError(f"{section}.{name}={v} must be > {lo}; set a positive "
                             f"{section}.{name}")


def _one_of(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{key}={value!r} is not one of {', '.join(map(str, choices))}; "
                         f"use {key}={choices[0]}")


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
class ModelConfig:
    """Shape of a Llama-style GQA decoder."""

    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 8
    n_kv_heads: int = 2
    ffn_dim: int = 384
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        _at_least("model", 1, vocab_size=self.vocab_size, dim=self.dim, n_layers=self.n_layers,
                  n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, ffn_dim=self.ffn_dim)
        _above("model", 0, rope_theta=self.rope_theta, norm_eps=self.norm_eps)
        if self.dim % self.n_heads != 0:
            raise ValueError(
                f"model dim ({self.dim}) must be divisible by n_heads ({self.n_heads})"
            )
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        d, f, hd = self.dim, self.ffn_dim, self.head_dim
        attn = d * self.n_heads * hd + 2 * d * self.n_kv_heads * hd + self.n_heads * hd * d
        mlp = 3 * d * f
        per_layer = attn + mlp + 2 * d
        emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.n_layers * per_layer + emb + d


@dataclass
class ParallelConfig:
    """The sequence-parallel layout. Degrees are ints or ``"auto"`` (chosen by the planner)."""

    ulysses_degree: Any = 2
    ring_degree: Any = 2
    dp_degree: Any = None  # None: world / (ulysses * ring)
    placement: str = "ulysses_inner"
    balance: str = "zigzag"
    kernel: str = "torch"
    ring_impl: str = "usp"
    ranks_per_node: Optional[int] = None  # CPU runs: pretend nodes of N ranks

    def __post_init__(self) -> None:
        from .validate import BALANCES, PLACEMENTS, RING_IMPLS

        _one_of("parallel.placement", self.placement, PLACEMENTS)
        _one_of("parallel.balance", self.balance, BALANCES)
        _one_of("parallel.ring_impl", self.ring_impl, RING_IMPLS)
        if self.ranks_per_node is not None:
            _at_least("parallel", 1, ranks_per_node=self.ranks_per_node)


@dataclass
class DataConfig:
    kind: str = "recall"  # recall (synthetic long-range task) | memmap
    seq_len: int = 512
    batch_size: int = 8  # sequences per dp rank per step
    path: Optional[str] = None  # memmap: prefix of {path}.bin / {path}.json
    n_pairs: int = 8  # recall: distinct key->value pairs per sequence
    n_queries: int = 8  # recall: questions at the end of each sequence
    seed: int = 1234
    eval_batches: int = 4  # held-out batches scored at the end of a run (recall)

    def __post_init__(self) -> None:
        _one_of("data.kind", self.kind, ("recall", "memmap"))
        _at_least("data", 1, seq_len=self.seq_len, batch_size=self.batch_size)
        _at_least("data", 0, eval_batches=self.eval_batches)
        if self.kind == "recall":
            _at_least("data", 1, n_pairs=self.n_pairs, n_queries=self.n_queries)
            if self.n_queries > self.n_pairs:
                raise ValueError(f"data.n_queries={self.n_queries} > data.n_pairs={self.n_pairs}: "
                                 f"each query asks a distinct pair; set data.n_queries<="
                                 f"{self.n_pairs} or raise data.n_pairs")


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
        _above("optim", 0, lr=self.lr, grad_clip=self.grad_clip)
        _at_least("optim", 0, min_lr=self.min_lr, warmup_steps=self.warmup_steps,
                  weight_decay=self.weight_decay, beta1=self.beta1, beta2=self.beta2)
        if self.min_lr > self.lr:
            raise ValueError(f"optim.min_lr={self.min_lr} > optim.lr={self.lr}: the schedule "
                             f"decays from lr to min_lr; set optim.min_lr<={self.lr}")
        for name, beta in (("beta1", self.beta1), ("beta2", self.beta2)):
            if beta >= 1:
                raise ValueError(f"optim.{name}={beta} must be < 1 (AdamW averages with it); "
                                 f"use e.g. optim.beta1=0.9 optim.beta2=0.95")


@dataclass
class TrainerConfig:
    steps: int = 600
    seed: int = 0
    dtype: str = "fp32"  # fp32 | bf16 (FSDP2 mixed precision: bf16 compute, fp32 master weights)
    activation_checkpointing: bool = False
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
    preempt_signals: str = "SIGTERM,SIGUSR1"  # checkpoint at the next step, then exit ("" = off)
    on_nonfinite: str = "stop"  # non-finite loss/grad norm: stop (keep the last good ckpt) | skip

    def __post_init__(self) -> None:
        _at_least("trainer", 1, steps=self.steps, keep_checkpoints=self.keep_checkpoints,
                  nprocs=self.nprocs)
        _at_least("trainer", 0, log_every=self.log_every, ckpt_every=self.ckpt_every,
                  max_restarts=self.max_restarts)
        _above("trainer", 0, timeout_s=self.timeout_s)
        _one_of("trainer.dtype", self.dtype, ("fp32", "bf16"))
        _one_of("trainer.on_nonfinite", self.on_nonfinite, ("stop", "skip"))
        parse_signals(self.preempt_signals)
        if self.stop_after is not None and not 1 <= self.stop_after <= self.steps:
            raise ValueError(f"trainer.stop_after={self.stop_after} is outside 1..trainer.steps="
                             f"{self.steps}; set it in that range or to null")


@dataclass
class LoggingConfig:
    wandb: str = "offline"  # offline | online | disabled
    project: str = "usp"
    jsonl: bool = True
    plot: bool = True
    progress: bool = True

    def __post_init__(self) -> None:
        _one_of("logging.wandb", self.wandb, ("offline", "online", "disabled"))
