"""What the benchmark scripts in ``tools/`` share: the timing flags and the ``--quick`` /
full size presets, the config fields those flags set (``TimedBench``) and the script's
argparse -> config -> run -> printed report (``BenchScript``)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable

import torch

from usp.config import DTYPES  # the dtype names: fp32, bf16


def add_timing_args(p: argparse.ArgumentParser, full: dict, quick: dict) -> None:
    """``--warmup``, ``--rounds``, ``--threads`` and ``--quick`` (presets ``quick``/``full``)."""
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=None, help=f"default {full['rounds']}")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads per process")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke-test size {quick} (explicit flags still win)")


def add_cluster_args(p: argparse.ArgumentParser, d) -> None:
    """What a benchmark on the simulated cluster takes of its links and model, defaults from
    its config ``d`` (``out``, ``rate``, ``intra_rate``, ``queue_ms``, ``dim``, ``n_heads``,
    ``n_kv_heads``, ``n_layers``): ``--out``, ``--rate``, ``--intra-rate``, ``--queue-ms``,
    ``--dim``, ``--heads``, ``--kv-heads``, ``--layers``."""
    p.add_argument("--out", default=d.out)
    p.add_argument("--rate", default=d.rate, help="inter-node tc rate, e.g. 300mbit")
    p.add_argument("--intra-rate", default=d.intra_rate,
                   help="shaped loopback inside a node, tc rate; 'none': unshaped")
    p.add_argument("--queue-ms", type=float, default=d.queue_ms)
    p.add_argument("--dim", type=int, default=d.dim)
    p.add_argument("--heads", type=int, default=d.n_heads)
    p.add_argument("--kv-heads", type=int, default=d.n_kv_heads)
    p.add_argument("--layers", type=int, default=d.n_layers)


def parse_sized(p: argparse.ArgumentParser, argv, full: dict, quick: dict) -> argparse.Namespace:
    """Parse ``argv``; every preset key left unset takes the ``--quick`` or full value."""
    args = p.parse_args(argv)
    for key, val in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, val)
    return args


@dataclass(frozen=True, kw_only=True)
class TimedBench:
    """The fields every attention benchmark config has: the tensors' batch, head dim and
    dtype, and what the timing flags set (warmup calls, interleaved rounds, intra-op threads
    per process; None: the CPUs shared evenly)."""

    batch: int = 1
    head_dim: int = 64
    dtype: str = "fp32"
    warmup: int = 1
    rounds: int = 3
    threads: int | None = None

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class BenchScript:
    """A ``tools/bench_*.py`` script: ``parser()`` makes its own flags (the timing flags are
    added after them), ``config(args)`` turns the parsed flags (presets applied) into the
    benchmark's config, ``run(cfg)`` times it and ``report(cfg, rows)`` is the printed table."""

    parser: Callable[[], argparse.ArgumentParser]
    full: dict
    quick: dict
    config: Callable[[argparse.Namespace], Any]
    run: Callable[[Any], list]
    report: Callable[[Any, list], str]

    def parse_args(self, argv=None):
        """The config for ``argv``; a ValueError building it exits with the usage line and
        the message (status 2) before any process starts."""
        p = self.parser()
        add_timing_args(p, self.full, self.quick)
        args = parse_sized(p, argv, self.full, self.quick)
        try:
            return self.config(args)
        except ValueError as e:
            p.error(str(e))

    def main(self, argv=None) -> None:
        cfg = self.parse_args(argv)
        print(self.report(cfg, self.run(cfg)))
