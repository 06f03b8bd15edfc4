"""Argument helpers the benchmark scripts in ``tools/`` share: the timing flags and the
``--quick`` / full size presets."""

from __future__ import annotations

import argparse


def add_timing_args(p: argparse.ArgumentParser, full: dict, quick: dict) -> None:
    """``--warmup``, ``--rounds``, ``--threads`` and ``--quick`` (presets ``quick``/``full``)."""
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=None, help=f"default {full['rounds']}")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads per process")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke-test size {quick} (explicit flags still win)")


def parse_sized(p: argparse.ArgumentParser, argv, full: dict, quick: dict) -> argparse.Namespace:
    """Parse ``argv``; every preset key left unset takes the ``--quick`` or full value."""
    args = p.parse_args(argv)
    for key, val in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, val)
    return args
