"""The GPU check's shapes per section: the real check and the CPU dry run differ only here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Sizes:
    """Shapes per section: the real check and the CPU dry run differ only here."""

    kernel_lens: tuple = (33, 100, 256)
    head_dims: tuple = (64, 128)
    ring_len: int = 512
    usp_len: int = 256
    train_steps: int = 80
    train_seq_len: int = 512
    bench_len: int = 8192
    bench_iters: int = 20
    mfu_len: int = 8192

    @classmethod
    def dry(cls) -> Sizes:
        return cls(kernel_lens=(33, 20), head_dims=(16,), ring_len=64, usp_len=64,
                   train_steps=20, train_seq_len=128, bench_len=256, bench_iters=2, mfu_len=256)
