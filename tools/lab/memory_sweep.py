"""The memory benchmark's plan and report (``tools.bench_memory``): peak per rank against
L/P for each memory feature, the longest L/P under a budget (baseline against all
features), weak scaling over P, the planner's prediction for every point, and the step
time each feature costs. Points are measured by ``tools.lab.memory.measure_run``.

Feature settings (``FEATURES``): ``off`` (none), ``baseline`` (activation checkpointing
of every block: the best the trainer did before the other features), ``+loss_chunk``,
``+mlp_tiles`` (each on top of the baseline) and ``optimized`` (all of them). Activation
offload is CUDA-only and is not measured here.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial

import torch.distributed as dist

from usp.config import (LoggingConfig, ModelConfig, ParallelConfig, RecallData, RunConfig,
                      TrainerConfig)
from .memory import MIB, StepMemory, measure_run, settle_allocator


@dataclass(frozen=True)
class Features:
    """One setting of the memory features (the trainer's and the model's config fields)."""

    name: str
    checkpointing: bool = False
    loss_chunk: bool = False
    mlp_tiles: bool = False


FEATURES = {f.name: f for f in (
    Features("off"),
    Features("baseline", checkpointing=True),
    Features("+loss_chunk", checkpointing=True, loss_chunk=True),
    Features("+mlp_tiles", checkpointing=True, mlp_tiles=True),
    Features("optimized", checkpointing=True, loss_chunk=True, mlp_tiles=True),
)}


def ulysses_ring(p: int, n_heads: int) -> tuple[int, int]:
    """(ulysses, ring) of the ``p``-rank weak-scaling run: ulysses 2 (1 for one rank), the
    rest ring."""
    u = 1 if p == 1 else 2
    if p < 1 or p % u or n_heads % u:
        raise ValueError(f"{p} ranks cannot run as ulysses {u} x ring {p // u} with {n_heads} "
                         f"heads; use 1 or an even rank count")
    return u, p // u


@dataclass(frozen=True)
class MemoryBench:
    """The model, layout and lengths to measure. Lengths are tokens per rank (L/P)."""

    vocab_size: int = 32000
    dim: int = 256
    n_layers: int = 2
    n_heads: int = 8
    n_kv_heads: int = 2
    ffn_dim: int = 1024
    loss_chunk: int = 128  # model.loss_chunk with the feature on
    mlp_tiles: int = 4  # model.mlp_tiles with the feature on
    ulysses: int = 2
    ring: int = 2
    batch: int = 1
    steps: int = 2  # the last step is read: the optimizer state exists before it starts
    lengths: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096)
    budget_mib: float = 160.0
    resolution: int = 128  # bisection stops when the fitting and the failing L/P are this
    relative: float = 0.5  # close, or this fraction of the fitting L/P apart
    cap_mib: float = 640.0  # a feature's curve stops after its first point above this
    weak_ranks: tuple[int, ...] = (1, 2, 4, 8)
    weak_per_rank: int = 512
    time_per_rank: int = 512
    features: tuple[str, ...] = tuple(FEATURES)  # settings with a curve and a step time
    threads: int | None = None

    def __post_init__(self):
        if {"baseline", "optimized"} - set(self.features) or set(self.features) - set(FEATURES):
            raise ValueError(f"features {self.features} must be among {list(FEATURES)} and "
                             f"include baseline and optimized")
        if sorted(set(self.lengths)) != list(self.lengths) or self.lengths[0] < 2:
            raise ValueError(f"lengths {self.lengths} must be ascending, distinct and >= 2")
        even = (*self.lengths, self.resolution, self.weak_per_rank, self.time_per_rank)
        if any(n % 2 for n in even):
            raise ValueError(f"tokens per rank {even} must be even (zigzag needs L divisible "
                             f"by 2 x ulysses x ring); use even values")
        for p in self.weak_ranks:
            ulysses_ring(p, self.n_heads)
        self.run_config(FEATURES["optimized"], self.lengths[0], "")  # refuses a bad model

    @property
    def world(self) -> int:
        return self.ulysses * self.ring

    def run_config(self, f: Features, per_rank: int, run_dir: str, ulysses: int | None = None,
                   ring: int | None = None) -> RunConfig:
        """The training run of one point: ``per_rank`` tokens on each of ulysses x ring ranks."""
        u, r = ulysses or self.ulysses, ring or self.ring
        model = ModelConfig(vocab_size=self.vocab_size, dim=self.dim, n_layers=self.n_layers,
                            n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
                            ffn_dim=self.ffn_dim, loss_chunk=self.loss_chunk if f.loss_chunk else 0,
                            mlp_tiles=self.mlp_tiles if f.mlp_tiles else 1)
        return RunConfig(
            model=model, parallel=ParallelConfig(ulysses_degree=u, ring_degree=r, dp_degree=1),
            data=RecallData(seq_len=per_rank * u * r, batch_per_dp_rank=self.batch,
                            eval_batches=0),
            trainer=TrainerConfig(steps=self.steps, activation_checkpointing=f.checkpointing,
                                  log_every=0, ckpt_every=0, run_dir=run_dir or None,
                                  resume=False, preempt_signals=""),
            logging=LoggingConfig(wandb="disabled", jsonl=False, plot=False, progress=False))


def longest_fit(measure: Callable[[int], int], budget: float, grid: Sequence[int],
                resolution: int, relative: float = 0.0) -> tuple[int, int]:
    """(longest length that fits ``budget``, shortest measured length that does not).

    ``measure(n)`` is the peak at length n, taken to grow with n. Walks ``grid`` up to
    the first length over budget, then bisects between it and the last one that fit
    (midpoints rounded down to a multiple of ``resolution``) until they are at most
    ``resolution`` or ``relative`` x the fitting length apart, whichever is more.
    ValueError when the shortest length is already over budget or
    the longest still fits (no bracket: change the budget or the grid)."""
    fit = over = None
    for n in grid:
        if measure(n) > budget:
            over = n
            break
        fit = n
    if over is None:
        raise ValueError(f"every length of {list(grid)} fits {budget / MIB:.1f} MiB; lower the "
                         f"budget or add longer lengths")
    if fit is None:
        raise ValueError(f"the shortest length {grid[0]} already needs {measure(grid[0]) / MIB:.1f}"
                         f" MiB > {budget / MIB:.1f} MiB; raise the budget or add shorter lengths")
    while over - fit > max(resolution, relative * fit):
        mid = (fit + over) // 2 // resolution * resolution
        if mid <= fit:
            break
        if measure(mid) > budget:
            over = mid
        else:
            fit = mid
    return fit, over


@dataclass
class Point:
    """One measured step (the busiest rank's): ``features`` at ``per_rank`` tokens per rank
    on ulysses x ring ranks; bytes as in ``StepMemory``."""

    features: str
    per_rank: int
    ulysses: int
    ring: int
    memory: StepMemory
    timed: bool = False  # measured without the tracker, for its step time only


@dataclass
class Sweep:
    """Everything one benchmark run measured."""

    points: list[Point] = field(default_factory=list)
    longest: dict[str, tuple[int, int] | str] = field(default_factory=dict)  # or why not

    def find(self, features: str, per_rank: int, ranks: int, timed: bool = False) -> Point | None:
        return next((p for p in self.points if (p.features, p.per_rank, p.ulysses * p.ring,
                                                p.timed) == (features, per_rank, ranks, timed)),
                    None)


class _Runner:
    """Measures points on this process group, one run per point, each run in its own
    directory under ``root`` (deleted after)."""

    def __init__(self, bench: MemoryBench, root: str, ulysses: int, ring: int):
        self.bench, self.root, self.u, self.r = bench, root, ulysses, ring
        self.sweep = Sweep()

    def point(self, features: str, per_rank: int, timed: bool = False) -> Point:
        p = self.sweep.find(features, per_rank, self.u * self.r, timed)
        if p is None:
            run_dir = os.path.join(self.root, f"{features}_{per_rank}_{len(self.sweep.points)}")
            cfg = self.bench.run_config(FEATURES[features], per_rank, run_dir, self.u, self.r)
            memory = measure_run(cfg, track=not timed)[-1]
            dist.barrier()  # every rank has written its checkpoint files
            if dist.get_rank() == 0:
                shutil.rmtree(run_dir, ignore_errors=True)
            p = Point(features, per_rank, self.u, self.r, memory, timed)
            self.sweep.points.append(p)
            if dist.get_rank() == 0:  # progress: a full run takes minutes
                print(f"[bench_memory] {features} L/P={per_rank} on {self.u}x{self.r}: peak "
                      f"{memory.peak / MIB:.1f} MiB, step {memory.step_s:.2f} s",
                      file=sys.stderr, flush=True)
        return p

    def peak(self, features: str, per_rank: int) -> int:
        return self.point(features, per_rank).memory.peak

    def warm_up(self) -> None:
        """One short run, not recorded: imports and one-time buffers land before any
        point's idle baseline."""
        self.point("optimized", self.bench.lengths[0], timed=True)
        self.sweep.points.clear()


def _sweep_rank(bench: MemoryBench, root: str, out: str) -> None:
    """Rank body of the main run (ulysses x ring ranks): curves, longest fits, timing."""
    settle_allocator()
    run = _Runner(bench, root, bench.ulysses, bench.ring)
    run.warm_up()
    budget = bench.budget_mib * MIB
    for name in bench.features:  # the curves; each stops after its first point over the cap
        for n in bench.lengths:
            if run.peak(name, n) > bench.cap_mib * MIB:
                break
    for name in ("baseline", "optimized"):
        try:
            run.sweep.longest[name] = longest_fit(partial(run.peak, name), budget,
                                                  bench.lengths, bench.resolution, bench.relative)
        except ValueError as e:
            run.sweep.longest[name] = str(e)
    for name in bench.features:  # step time without the tracker, all at one length, back to back
        run.point(name, bench.time_per_rank, timed=True)
    _write(run.sweep, out)


def _weak_rank(bench: MemoryBench, root: str, out: str) -> None:
    """Rank body of one weak-scaling run: baseline and optimized at ``weak_per_rank``."""
    settle_allocator()
    u, r = ulysses_ring(dist.get_world_size(), bench.n_heads)
    run = _Runner(bench, root, u, r)
    run.warm_up()
    for name in ("baseline", "optimized"):
        run.point(name, bench.weak_per_rank)
    _write(run.sweep, out)


def _write(sweep: Sweep, out: str) -> None:
    if dist.get_rank() == 0:
        save(sweep, out)


def save(sweep: Sweep, path) -> None:
    """``sweep`` as JSON (``load`` reads it back)."""
    with open(path, "w") as f:
        json.dump({"points": [asdict(p) for p in sweep.points], "longest": sweep.longest}, f)


def load(path) -> Sweep:
    with open(path) as f:
        d = json.load(f)
    points = [Point(**{**p, "memory": StepMemory(**p["memory"])}) for p in d["points"]]
    longest = {k: tuple(v) if isinstance(v, list) else v for k, v in d["longest"].items()}
    return Sweep(points, longest)


def run(bench: MemoryBench, weak: bool = True, main: bool = True) -> Sweep:
    """Spawn the main run (ulysses x ring ranks; with ``main``) and, with ``weak``, one run
    per entry of ``weak_ranks``; returns all points."""
    from usp.launch import spawn_local

    total = Sweep()
    with tempfile.TemporaryDirectory(prefix="usp_bench_memory_") as root:
        out = os.path.join(root, "sweep.json")
        for fn, ranks in [(_sweep_rank, bench.world)] * main + [(_weak_rank, p) for p in
                                                                bench.weak_ranks] * weak:
            if fn is _weak_rank and _weak_points(bench, total, ranks):
                continue  # the main run measured this layout at this length already
            spawn_local(fn, ranks, bench, root, out, threads=bench.threads)
            part = load(out)
            total.points += part.points
            total.longest.update(part.longest)
    return total


def bracket(peaks: dict[int, int], budget: float) -> tuple[int, int] | str:
    """(longest measured length whose peak fits ``budget``, the next measured length,
    which does not) from measured ``{length: peak}``; or why there is no such pair."""
    lengths = sorted(peaks)
    over = next((n for n in lengths if peaks[n] > budget), None)
    if over is None or over == lengths[0]:
        return (f"no measured length is over {budget / MIB:.1f} MiB" if over is None else
                f"the shortest measured length {over} is over {budget / MIB:.1f} MiB")
    return lengths[lengths.index(over) - 1], over


def _weak_points(bench: MemoryBench, sweep: Sweep, ranks: int) -> list[Point]:
    """The weak-scaling points of ``ranks`` ranks in ``sweep`` (baseline, optimized), or []
    when it lacks one or measured them on another (ulysses, ring)."""
    u, r = ulysses_ring(ranks, bench.n_heads)
    found = [sweep.find(name, bench.weak_per_rank, ranks) for name in ("baseline", "optimized")]
    if any(p is None or (p.ulysses, p.ring) != (u, r) for p in found):
        return []
    return found


def predict(bench: MemoryBench, p: Point):
    """The planner's ``MemorySplit`` of point ``p`` (``usp.planner.memory.memory_split``
    with the run's model, layout, batch, dtype and checkpoint policy, on the CPU kernel)."""
    from usp.planner.memory import CheckpointPolicy, memory_split

    cfg = bench.run_config(FEATURES[p.features], p.per_rank, "", p.ulysses, p.ring)
    return memory_split(cfg.model, cfg.data.seq_len, 1, p.ring, p.ulysses,
                        batch=cfg.data.batch_per_dp_rank,
                        dtype_bytes=cfg.trainer.compute_dtype.itemsize,
                        policy=CheckpointPolicy.from_trainer(cfg.trainer),
                        kernel=cfg.parallel.kernel, device="cpu")
