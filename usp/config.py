"""Typed configuration shared by the library, the planner and the CLI.

Only the CLI touches Hydra/OmegaConf; it turns YAML into these dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


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
    simulate_ranks_per_node: Optional[int] = None  # CPU runs: pretend nodes of N ranks


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


@dataclass
class OptimConfig:
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup_steps: int = 30
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0


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


@dataclass
class LoggingConfig:
    wandb: str = "offline"  # offline | online | disabled
    project: str = "usp"
    jsonl: bool = True
    plot: bool = True
    progress: bool = True
