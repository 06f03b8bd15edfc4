"""One ``usp.train.trainer.Trainer`` driven alone, without a runner of phases, on 2 gloo ranks:
built from one config and one layout, told where to start (a ``Position``, a checkpoint) and
when to stop (``Leg.end`` and a ``Stop`` of the test's own, a predicate on the validation's
scores). It stops where the predicate holds, labels and records what the stop asks, and a
trainer started from that checkpoint continues the uninterrupted run's losses bit for bit.

The validator is a stand-in that scores ``{"score": step}`` at every even step (the decision
to stop is the trainer's loop's). All runs share one spawn; the tests read what it wrote."""

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from usp.config import LoggingConfig, ModelConfig, OptimConfig, ParallelConfig, RecallData
from usp.config import RunConfig, TrainerConfig
from usp.launch import spawn_local
from usp.run import resolve_run
from usp.train.build import lr_lambda
from usp.train.checkpointer import Position, newest
from usp.train.fingerprint import run_fingerprint
from usp.train.trainer import Leg, Stop, Trainer

QUIET = LoggingConfig(wandb="disabled", jsonl=False, plot=False, progress=False)
STEPS = 6


def _cfg(run_dir) -> RunConfig:
    return RunConfig(
        model=ModelConfig(vocab_size=320, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                          ffn_dim=128),
        parallel=ParallelConfig(ulysses_degree=1, ring_degree=2, ranks_per_node=2),
        data=RecallData(seq_len=64, batch_per_dp_rank=2, n_pairs=4, n_queries=4),
        optim=OptimConfig(lr=3e-3, warmup_steps=2),
        trainer=TrainerConfig(steps=STEPS, run_dir=str(run_dir), nprocs=2, ckpt_every=0),
        logging=QUIET)


class AtScore(Stop):
    """Ends the loop at the first validation scoring at least ``score``; says so in the last
    record and records the step it saw in each checkpoint."""

    def __init__(self, score: int):
        self.score = score

    def holds(self, step, summary):
        return summary["score"] >= self.score

    def labels(self, summary, early):
        return {"ended_by": "score" if early else "end"}

    def record(self, summary, at, ends):
        return {"seen": at.step, "ends": ends}


def _trainer(cfg: RunConfig, records: list, from_checkpoint: bool = False) -> Trainer:
    leg = Leg(end=STEPS, lr=cfg.optim.lr, schedule=lr_lambda(cfg.optim, STEPS),
              fingerprint=run_fingerprint(cfg), tags={"part": "one"})
    return Trainer(cfg, resolve_run(cfg, 2, "cpu"), leg, records.append,
                   from_checkpoint=from_checkpoint)


def _run(cfg: RunConfig, at: Position, stop: Stop, ckpt=None) -> dict:
    records: list = []
    trainer = _trainer(cfg, records, from_checkpoint=ckpt is not None)
    with trainer.running():
        trainer.resume(ckpt, report=False)
        summary, end, written, ended = trainer.loop(at, stop)
    return {"records": records, "end": [end.step, end.consumed, end.skipped],
            "ckpt": None if written is None else Path(written).name, "ended": ended,
            "last": summary["step"]}


def _runs(root: str) -> None:
    import usp.train.trainer as trainer_module

    real = trainer_module.Validator

    class Scored(real):
        def should_validate(self, step):
            return step > 0 and step % 2 == 0

        def validate(self, model, step=None):
            return {"score": step}

    trainer_module.Validator = Scored
    try:
        out = {"straight": _run(_cfg(Path(root, "straight")), Position(), Stop())}
        stopped = _cfg(Path(root, "stopped"))
        out["stopped"] = _run(stopped, Position(), AtScore(4))
        ckpt, extra = newest(stopped.trainer, stopped.trainer.run_dir, run_fingerprint(stopped))
        out["extra"] = {k: v for k, v in extra.items() if k in
                        ("step", "consumed", "skipped_steps", "global_batch", "seen", "ends")}
        out["resumed"] = _run(stopped, Position.of(extra, 2), Stop(), ckpt)
    finally:
        trainer_module.Validator = real
    if dist.get_rank() == 0:
        Path(root, "out.json").write_text(json.dumps(out))
    dist.barrier()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("trainer_stop")
    spawn_local(_runs, 2, str(root))
    return json.loads((root / "out.json").read_text())


def _losses(run: dict) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in run["records"] if "loss" in r}


def test_a_trainer_without_a_stop_runs_to_its_last_step(runs):
    straight = runs["straight"]
    assert sorted(_losses(straight)) == list(range(1, STEPS + 1))
    assert (straight["last"], straight["ended"], straight["ckpt"]) == (STEPS, True, "step_000006")
    assert straight["end"] == [STEPS, STEPS * 2, 0]  # 2 samples a step: dp 1 x 2 rows
    first = straight["records"][0]
    # the runner's tags lead the layout's keys; a plain Stop adds no label
    keys = list(first)
    assert keys[keys.index("part"):][:5] == ["part", "seq_len", "dp", "ring", "ulysses"]
    assert "ended_by" not in straight["records"][-1]


def test_the_stop_ends_the_loop_where_it_holds_and_records_what_it_asks(runs):
    stopped, straight = runs["stopped"], _losses(runs["straight"])
    assert (stopped["last"], stopped["ended"], stopped["ckpt"]) == (4, True, "step_000004")
    assert _losses(stopped) == {s: straight[s] for s in range(1, 5)}
    assert [r.get("ended_by") for r in stopped["records"]] == [None, None, None, "score"]
    assert runs["extra"] == {"step": 4, "consumed": 8, "skipped_steps": 0, "global_batch": 2,
                             "seen": 4, "ends": True}


def test_a_trainer_started_from_that_checkpoint_continues_bit_for_bit(runs):
    resumed, straight = runs["resumed"], _losses(runs["straight"])
    assert _losses(resumed) == {s: straight[s] for s in (5, 6)}
    assert resumed["end"] == [STEPS, STEPS * 2, 0] and resumed["ckpt"] == "step_000006"
