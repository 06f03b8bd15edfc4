"""Faults in the training loop (usp.train.faults), 2-rank gloo runs of a tiny model: a
SIGUSR1 sent to one rank only stops both at the same step with a checkpoint, and the
resumed run ends where an uninterrupted one does; an inf loss stops the run before the
optimizer step and before that step's checkpoint (on_nonfinite=stop) or is skipped
(on_nonfinite=skip)."""

import json
import math
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch.distributed as dist

from usp.config import (
    RecallData,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainerConfig,
)
from usp.launch import spawn_local
from usp.train.faults import PREEMPTED_EXIT_CODE, NonFiniteError, Preempted
from usp.train.phase_runner import RunConfig, train

QUIET = LoggingConfig(wandb="disabled", jsonl=True, plot=False, progress=False)


def tiny_cfg(run_dir, steps=6, **trainer_kw) -> RunConfig:
    """2 ranks (ulysses 1 x ring 2), seq_len 64: a few seconds per run on CPU."""
    return RunConfig(
        model=ModelConfig(vocab_size=320, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64),
        parallel=ParallelConfig(ulysses_degree=1, ring_degree=2, ranks_per_node=1),
        data=RecallData(seq_len=64, batch_per_dp_rank=2, n_pairs=4, n_queries=4, eval_batches=0),
        optim=OptimConfig(lr=3e-3, warmup_steps=2),
        trainer=TrainerConfig(steps=steps, run_dir=str(run_dir), nprocs=2, log_every=0,
                              **trainer_kw),
        logging=QUIET,
    )


# ---- fault hooks: picklable, called on every rank as hook(step, loss_sum) -> loss_sum ----------

@dataclass
class SignalAt:
    """Send ``SIGUSR1`` to this process on ``rank`` only, during ``step``."""

    step: int
    rank: int

    def __call__(self, step, loss_sum):
        if step == self.step and dist.get_rank() == self.rank:
            os.kill(os.getpid(), signal.SIGUSR1)
        return loss_sum


@dataclass
class InfAt:
    """Make ``rank``'s loss (hence the global loss and the grads) inf at ``step``."""

    step: int
    rank: int

    def __call__(self, step, loss_sum):
        if step == self.step and dist.get_rank() == self.rank:
            return loss_sum * math.inf
        return loss_sum


def _end_of(cfg: RunConfig, hook) -> dict:
    """train() on this rank; how it ended."""
    before = signal.getsignal(signal.SIGUSR1)
    try:
        summary = train(cfg, fault_hook=hook)
        rec = {"end": "done", "step": summary["step"], "loss": summary["loss"]}
    except Preempted as e:
        rec = {"end": "preempted", "step": e.step, "signal": e.signal_name, "code": e.exit_code,
               "msg": str(e)}
    except NonFiniteError as e:
        rec = {"end": "nonfinite", "step": e.step, "what": e.what, "msg": str(e)}
    rec["handler_restored"] = signal.getsignal(signal.SIGUSR1) == before
    return rec


def _worker(phases: list, out_dir: str) -> None:
    """Run each (cfg, hook) in turn in this process group (one spawn: the CPU is shared);
    writes the list of how each ended to ``out_dir/rank{r}.json``."""
    ends = [_end_of(cfg, hook) for cfg, hook in phases]
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(ends))


def _run(out: Path, *phases) -> list[tuple[list[dict], dict]]:
    """For each (cfg, hook) phase: (each rank's end record, rank 0's metrics by step)."""
    out.mkdir(parents=True, exist_ok=True)
    # a short collective timeout: ranks that disagree on stopping fail fast instead of hanging
    spawn_local(_worker, phases[0][0].trainer.nprocs, list(phases), str(out), timeout_s=60)
    per_rank = [json.loads((out / f"rank{r}.json").read_text())
                for r in range(phases[0][0].trainer.nprocs)]
    results = []
    for i, (cfg, _) in enumerate(phases):
        lines = Path(cfg.trainer.run_dir, "metrics.jsonl").read_text().splitlines()
        results.append(([ends[i] for ends in per_rank],
                         {rec["step"]: rec for rec in map(json.loads, lines)}))
    return results


def _checkpoints(run_dir) -> list[str]:
    return sorted(p.name for p in Path(run_dir, "checkpoints").iterdir())


# ---- the training loop (2 gloo ranks) -----------------------------------------------------------

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One spawn, every run of the tests below, in turn:

    - ``straight``: uninterrupted, 6 steps;
    - ``preempted``: SIGUSR1 to rank 1 during step 3 (ckpt_every=0), then resumed with another
      init seed (only the checkpoint can give the straight run's losses);
    - ``stop``: an inf loss at step 4 under on_nonfinite=stop (ckpt_every=2);
    - ``skip``: an inf loss at step 3 under on_nonfinite=skip.
    """
    root = tmp_path_factory.mktemp("faults")
    run = root / "preempted"
    straight, preempted, resumed, stop, skip = _run(
        root / "ends",
        (tiny_cfg(root / "straight"), None),
        (tiny_cfg(run, ckpt_every=0), SignalAt(step=3, rank=1)),
        (tiny_cfg(run, ckpt_every=0, seed=7), None),
        (tiny_cfg(root / "stop", steps=6, ckpt_every=2), InfAt(step=4, rank=1)),
        (tiny_cfg(root / "skip", steps=5, on_nonfinite="skip"), InfAt(step=3, rank=0)))
    return {"straight": straight, "preempted": (run, *preempted), "resumed": resumed,
            "stop": (root / "stop", *stop), "skip": (root / "skip", *skip)}


def test_signal_on_one_rank_checkpoints_all_and_resume_matches(runs):
    (straight_ends, straight), (run, ends, _) = runs["straight"], runs["preempted"]
    resumed_ends, resumed = runs["resumed"]
    assert [e["end"] for e in straight_ends] == ["done", "done"]
    # both ranks stop after step 3 although only rank 1 got the signal
    assert [(e["end"], e["step"], e.get("signal"), e.get("code")) for e in ends] \
        == [("preempted", 3, "SIGUSR1", PREEMPTED_EXIT_CODE)] * 2
    assert all(e["handler_restored"] for e in ends)
    # ckpt_every=0: step 3's checkpoint was written for the preemption, step 6's at the end
    assert _checkpoints(run) == ["step_000003", "step_000006"]
    assert "step_000003" in ends[0]["msg"] and "trainer.resume=true" in ends[0]["msg"]

    assert [e["end"] for e in resumed_ends] == ["done", "done"]
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    for s in (4, 5, 6):
        a, b = straight[s]["loss"], resumed[s]["loss"]
        assert abs(a - b) <= 1e-6 * abs(a), (s, a, b)


def test_inf_loss_stops_before_the_bad_steps_checkpoint(runs):
    run_dir, ends, metrics = runs["stop"]
    assert [(e["end"], e["step"], e.get("what")) for e in ends] == [("nonfinite", 4, "loss")] * 2
    assert "at step 4" in ends[0]["msg"] and "trainer.on_nonfinite=skip" in ends[0]["msg"]
    assert _checkpoints(run_dir) == ["step_000002"]  # the last good one; none at/after step 4
    assert sorted(metrics) == [1, 2, 3]
    assert all(e["handler_restored"] for e in ends)


def test_skip_mode_skips_exactly_the_bad_step(runs):
    _, ends, m = runs["skip"]
    assert [e["end"] for e in ends] == ["done", "done"]
    assert [m[s]["skipped_steps"] for s in range(1, 6)] == [0, 0, 1, 1, 1]
    assert not math.isfinite(m[3]["loss"])
    assert all(math.isfinite(m[s]["loss"]) and math.isfinite(m[s]["grad_norm"]) for s in (1, 2, 4, 5))
    # the schedule did not step on the skip: step 4 used the rate step 3 would have
    # (warmup 2 steps, then the cosine from its peak 3e-3 at schedule count 2)
    assert m[1]["lr"] == 1.5e-3 and m[3]["lr"] == m[4]["lr"] == 3e-3 > m[5]["lr"]
    assert m[5]["loss"] < m[1]["loss"]  # and training went on
