"""One trainer, top to bottom: ``Trainer`` trains a model from a position to a stop on
every rank of an initialised process group, from one config and one layout.

``Trainer.loop`` runs its optimizer steps from where it starts (``Position``) to its last
step (``Leg.end``), unless its ``Stop`` holds at a validation or ``trainer.stop_after``
comes first. ``train_step`` is one optimizer step: the micro-batches' forward and backward
(``forward_backward``), then the optimizer. Around a step, one component per concern, each
with one verb: ``Validator`` (``should_validate`` / ``validate``), the records (``log``:
every step to the run's metrics and console), ``Preemption`` (``agree``), ``Checkpointer``
(``should_save`` / ``save``; ``load`` to resume). The trainer knows no length phases:
``usp.train.phase_runner.train`` runs one trainer per phase and tells each, by its ``Leg``
and its ``Stop``, where it ends, what its records carry and what its checkpoints record
for the run.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist

from ..comm import naming_collectives
from ..config import DataConfig, RunConfig
from ..data.batches import RowLayouts, Rows
from ..data.dataset import build_dataset, build_validation
from ..layout import SequenceLayout
from ..models.decoder import flops_per_token
from ..models.forward import loss_and_predictions
from ..models.tiling import loss_share
from ..eval.grid import training_cases
from ..eval.sharded import PasskeyScore
from ..eval.val_loss import LengthLoss, held_out_accuracy
from ..run import RunLayout
from .build import (checkpoint_records, continue_schedule, optimizer, record_for_export,
                    sharded_model)
from .checkpointer import Checkpointer, Position
from .faults import NonFiniteGuard, Preempted, Preemption
from .grads import clip_grad_norm
from .router_balance import EXPERT_AXES, RouterBalance
from .metrics import PeakMemory
from .validator import Validator, missing_splits

FaultHook = Callable[[int, torch.Tensor], torch.Tensor]


def _device(run: RunLayout) -> torch.device:
    """This rank's device, as the layout says: its current CUDA device, or the CPU."""
    if run.device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass(frozen=True)
class Leg:
    """What a runner tells one ``Trainer`` beside its config and layout: the steps it may
    train and what its records and checkpoints carry for the run around it.

    ``end``: its last optimizer step (1-based, the run's count; its ``Stop`` may end it
    earlier). ``schedule(count)``: the lr factor, of the peak ``lr``, after ``count``
    optimizer steps (``usp.train.build.phase_schedule``). ``fingerprint``: the run's, in each
    checkpoint (``usp.train.fingerprint``). ``tags``: the keys every record starts its
    layout keys with (e.g. ``{"phase": 2}``). ``tokens_before``: the tokens the run saw
    before this trainer's data began (each record's ``tokens_seen`` counts on from them).
    ``passes``: which passes of the data it reads (``build_dataset``'s; 0: a run's first).
    ``short``: data at another length whose validation windows it also scores, on its own
    layout, as ``short_val_loss``; None: none."""

    end: int
    lr: float
    schedule: Callable[[int], float]
    fingerprint: dict
    tags: dict = field(default_factory=dict)
    tokens_before: int = 0
    passes: int = 0
    short: DataConfig | None = None


class Stop:
    """When a ``Trainer``'s loop ends before its last step, and what its end and its
    checkpoints record for whoever runs it. This one: nothing (the loop ends at its last step
    or ``trainer.stop_after``); a runner of several trainers gives its own
    (``usp.train.phase_runner``). ``final``: no trainer follows this one, so after its last
    step the run is complete (no preemption agreement is needed there)."""

    final = True

    def holds(self, step: int, summary: dict) -> bool:
        """At a validation after optimizer step ``step``: whether the loop ends there
        (``summary``: the step's, with the validation's scores; all-reduced, so every rank
        decides alike)."""
        return False

    def labels(self, summary: dict, early: bool) -> dict:
        """The keys the loop's last step's ``summary`` gets before it is logged (``early``:
        ``holds`` ended it, not the last step)."""
        return {}

    def record(self, summary: dict, at: Position, ends: bool) -> dict:
        """What a checkpoint after ``at.step`` records beside the trainer's position
        (``Checkpointer.save``'s ``extra``); ``ends``: the loop's last step."""
        return {}


class Trainer:
    """One trainer of a run on this rank. ``__init__`` (collective) builds it from its
    config ``cfg`` and layout ``run``: the mesh and sequence layout, the sharded model
    (``from_checkpoint``: its weights come from the checkpoint ``resume`` loads, not from
    ``model.pretrained``), optimizer and schedule, the data and the components around a
    step; ``running`` closes the model, optimizer and mesh once. ``log(record)``: the run's
    metrics and console, which outlive it."""

    def __init__(self, cfg: RunConfig, run: RunLayout, leg: Leg, log: Callable[[dict], None],
                 fault_hook: FaultHook | None = None,
                 memory_probe: Callable[[torch.device], PeakMemory] = PeakMemory,
                 from_checkpoint: bool = False):
        tc = cfg.trainer
        self.cfg, self.run, self.tc, self.leg, self.end = cfg, run, tc, leg, leg.end
        self.log = log
        self.fault_hook = fault_hook
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = _device(run)
        self.mesh = run.build_mesh()
        # who holds which tokens: the run's one layout, or under per_document each batch's own
        self.layouts = RowLayouts(self.mesh, run.seq_len, run.balance, self.device)
        layout = self.layouts.sequence
        if self.rank == 0:
            print(f"{self.mesh.describe()}\nbalance={run.balance}", flush=True)
            record_for_export(cfg, run.run_dir)  # the latest trainer's model and length
        # resuming (a restart, or the checkpoint of the trainer before this one): the weights
        # come from the checkpoint alone
        self.model, use = sharded_model(cfg, run, self.mesh, layout, self.device,
                                        from_checkpoint)
        self.layouts.use = use
        self.opt, self.sched = optimizer(cfg.optim, self.model, leg.schedule, lr=leg.lr)
        self.data = build_dataset(cfg.data, cfg.model, leg.passes, tc.loss_norm)  # own passes
        if self.rank == 0:
            for line in self.data.packing_notes():  # data.packing=whole: padding, dropped
                print(line, flush=True)
        splits = build_validation(cfg.data, cfg.model, tc.eval_windows)  # [(name, weight, split)]
        note = missing_splits(cfg.data, splits)
        if self.rank == 0 and note:
            print(note, flush=True)
        passkey = None  # eval.during_training: the grid usp-eval scores, at every validation
        if cfg.eval.during_training:
            passkey = PasskeyScore(cfg, training_cases(cfg, run.seq_len), self.mesh, use,
                                   layout, run.run_dir, self.device)
        self.validator = Validator(splits, tc.eval_every, self.end, run.batch_per_dp_rank,
                                   self.mesh, self.layouts, passkey,
                                   self._short_loss(use, layout, splits))
        self.guard = NonFiniteGuard(tc.on_nonfinite)
        self.checkpointer = Checkpointer(tc, run, leg.fingerprint, self.rank, self.end,
                                         checkpoint_records(cfg))
        self.dp_sp = self.mesh.group("loss")  # the loss's token count, the metrics (dp_sp)
        self.n_shard = self.mesh.submesh("fsdp").size()
        self.router = RouterBalance(self.model, cfg.model, self.mesh)  # a mixture of experts
        self.flops = flops_per_token(cfg.model, run.seq_len)
        self.peak_mem = memory_probe(self.device)
        # in every record: which part of the run (the runner's tags) and layout made it
        self.where = {**leg.tags, "seq_len": run.seq_len, "dp": run.dp, "ring": run.ring,
                      "ulysses": run.ulysses}

    def _short_loss(self, use, layout: SequenceLayout, splits: list) -> LengthLoss | None:
        """The validation of the leg's ``short`` data at its own length on this layout
        (``short_val_loss``), when this trainer has validation splits; else None."""
        short = self.leg.short
        if short is None or not splits:
            return None
        windows = build_validation(short, self.cfg.model, self.tc.eval_windows)
        layouts = RowLayouts(self.mesh, short.seq_len, self.run.balance, self.device, use)
        return LengthLoss(windows, layouts, use, layout, self.run.batch_per_dp_rank, self.mesh)

    def resume(self, ckpt: Path | None, report: bool) -> None:
        """Collective: checkpoint ``ckpt`` (the run's newest, or the one the trainer before
        this one ended with; None: a fresh start) loaded into the model, optimizer and
        schedule, resharded to this layout; the leg's schedule then sets the lr.
        ``report``: rank 0 says where the run resumed."""
        if ckpt is not None:
            self.checkpointer.load(ckpt, self.model, self.opt, self.sched, report)
            continue_schedule(self.opt, self.sched)  # the leg may start a new warmup

    @contextmanager
    def running(self) -> Iterator[None]:
        """Closes the model, optimizer and mesh (``close``) however the block ends."""
        try:
            yield
        except BaseException as e:  # Preempted, NonFiniteError, a lost peer
            if isinstance(e, Preempted):
                # the checkpoint is written and the process is ending: a second SIGTERM (the
                # scheduler's own, a requeue ending the step) must not cut the close below
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            self.close(barrier=False)  # a peer may be stuck in a collective: no barrier
            raise
        self.close()

    def close(self, barrier: bool = True) -> None:
        """The model and optimizer (FSDP state holds the mesh's groups) and what holds the
        mesh, then the mesh's groups, freed while the interpreter is alive (see
        ``SPMesh.close``): the next trainer builds its own."""
        self.model = self.opt = self.sched = self.validator = self.dp_sp = None
        self.mesh.close(barrier=barrier)

    def loop(self, at: Position, stop: Stop = Stop()
             ) -> tuple[dict, Position, Path | None, bool]:
        """Optimizer steps ``at.step + 1`` .. ``Leg.end`` (1-based) from ``at``, unless
        ``stop`` holds at a validation or ``trainer.stop_after`` comes first: (the last step's
        summary, {} when no step is left; the position after it; the checkpoint written last,
        or None; whether the loop reached its end, by ``stop`` or its last step, rather than
        ``trainer.stop_after`` or no step at all)."""
        tc = self.tc
        summary: dict = {}
        ckpt, ended = None, False
        self.guard.skipped = at.skipped
        # The handlers only set a flag; the previous ones are back however the loop ends.
        with Preemption(tc.preempt_signals) as preemption:
            if at.step == 0 and self.validator.should_validate(0):  # where the model starts
                self.log({"step": 0, **self.validator.validate(self.model, 0), **self.where})
            for step in range(at.step + 1, self.end + 1):
                summary = self.train_step(step, at)
                at = replace(at, step=step, consumed=summary["samples"],
                             skipped=summary["skipped_steps"])
                validated = self.validator.should_validate(step)
                if validated:
                    summary.update(self.validator.validate(self.model, step))
                # the loop ends here: its stop holds at this validation, or its last step
                early = validated and stop.holds(step, summary)
                ends = early or step == self.end
                if ends:
                    summary.update(stop.labels(summary, early))
                self.log(summary)
                # Sync: every rank learns whether any rank got a preemption signal (none is
                # needed after the run's last step: it is complete and exits normally).
                done = ends and stop.final
                sig = None if done else preemption.agree(self.device)
                if self.checkpointer.should_save(step, preempted=sig is not None, ends=ends):
                    ckpt = self.checkpointer.save(step, self.model, self.opt, self.sched, at,
                                                  stop.record(summary, at, ends))
                if sig is not None:
                    err = Preempted(step, sig.name, str(ckpt))
                    if self.rank == 0:
                        print(f"usp: {err}", flush=True)
                    raise err
                if step == tc.stop_after or ends:
                    ended = ends and step != tc.stop_after
                    break
        return summary, at, ckpt, ended

    def train_step(self, step: int, at: Position) -> dict:
        """Optimizer step ``step`` (1-based) on the global batch after the data's
        ``at.consumed`` samples: forward and backward of its micro-batches, then the optimizer
        and schedule (not for a skipped non-finite step); the step's summary (``samples``:
        the data position after it)."""
        run, data, consumed = self.run, self.data, at.consumed
        t0, comm0 = time.perf_counter(), self.mesh.comm.total_seconds(skip=EXPERT_AXES)
        pairs0 = sum(self.mesh.comm.kernel_pairs.values())  # the ring's counted work so far
        self.peak_mem.start()  # the peak below is this step's, not the run's
        # Data: the step's global batch is the next global_batch samples after `consumed`;
        # micro-batch k takes [k, k+1) x micro_batch of them and this dp rank its own part.
        # Only this rank's tokens are read (per_document: each row's own, from its documents);
        # labels were shifted (and, for packed documents, cut at document boundaries) on the
        # global sequence.
        micro = [self.layouts.rows(data, run.samples(consumed, k, self.mesh.dp_rank))
                 for k in range(run.grad_accum)]  # each [B, L/P]
        stats, count, gn = self.forward_backward(step, micro)
        loss = stats[0].item() / count
        lr = self.opt.param_groups[0]["lr"]  # this step's rate: the schedule steps after it
        # on_nonfinite: stop raises here (no step, no checkpoint); skip drops the grads
        if self.guard.check(step, loss, gn):
            if self.rank == 0:
                print(f"step {step}: non-finite loss {loss} / grad norm {gn}; skipped "
                      f"(optimizer and schedule not stepped; {self.guard.skipped} skipped so "
                      f"far)", flush=True)
        else:
            self.opt.step()
            self.sched.step()
        self.opt.zero_grad(set_to_none=True)

        # Metrics: throughput; the busiest rank's memory and its attention work, this step's
        # (query, key) pairs (one MAX for both), over the mean work (the SUM)
        pairs = float(sum(self.mesh.comm.kernel_pairs.values()) - pairs0)
        busiest = torch.tensor([self.peak_mem.peak_mb(), pairs], dtype=torch.float64,
                               device=self.device)
        total = torch.tensor([pairs], dtype=torch.float64, device=self.device)
        dist.all_reduce(busiest, op=dist.ReduceOp.MAX, group=self.dp_sp)
        dist.all_reduce(total, group=self.dp_sp)
        peak, busiest = busiest[0], busiest[1]
        dt = time.perf_counter() - t0
        comm = self.mesh.comm.total_seconds(skip=EXPERT_AXES) - comm0  # attention's
        consumed += run.global_batch
        summary = {
            "step": step,
            "loss": loss,
            "lr": lr,
            "grad_norm": gn,
            "tokens_per_s": run.tokens_per_step / dt,
            "mfu": self.flops * run.tokens_per_step / dt / (self.cfg.cluster.peak_flops
                                                            * self.world),
            "peak_mem_mb": peak.item(),
            "peak_mem_kind": self.peak_mem.kind,
            "attn_comm_share": comm / dt,
            "attn_comm_clock": self.mesh.comm.clock,  # host (gloo) or cuda_events (stream)
            "attn_work_imbalance": (busiest.item() * self.n_shard / total.item()
                                    if total.item() else 1.0),
            "step_s": dt,
            "skipped_steps": self.guard.skipped,
            **self.router.metrics(self.device),  # a mixture of experts: aux_loss, expert_load
            "samples": consumed,  # the data position: this trainer's samples consumed
            "tokens_seen": self.leg.tokens_before + consumed * run.seq_len,  # the run's
            **self.where,  # which part of the run and layout made it, last on the line
        }
        summary.update(data.epochs(consumed))
        summary.update(data.padding(range(consumed - run.global_batch, consumed)))
        if data.has_answers:
            summary["acc"] = stats[1].item() / max(1.0, stats[2].item())
        return summary

    def forward_backward(self, step: int, micro: list[Rows]) -> tuple[torch.Tensor, float, float]:
        """Forward and backward of optimizer step ``step``'s micro-batches (each [B, L/P]),
        their gradients added up and clipped to ``optim.grad_clip``: (stats [loss sum,
        correct answers, answers] fp64 over dp x sp, the loss normaliser over dp x sp (labelled
        tokens, or documents under trainer.loss_norm=document: ``Batch.loss_count``), the
        global grad norm before clipping)."""
        accum, device, dp_sp = len(micro), self.device, self.dp_sp
        # Sync: the target tokens of all micro-batches over dp x sp normalise the loss; under
        # loss_norm=document the documents with a target (each one's weights sum to 1)
        counts = torch.tensor([float(sum(m.batch.loss_count() for m in micro))],
                              dtype=torch.float64, device=device)
        loss_total = torch.zeros((), dtype=torch.float64, device=device)
        correct = answers = 0
        # a peer that never answers an FSDP or loss collective is named as a dp_sp timeout
        # (usp's all-to-all and ring name their own axis inside)
        with naming_collectives("dp_sp", dp_sp):
            dist.all_reduce(counts, group=dp_sp)
            if micro[0].batch.weights is not None:  # a whole number of documents
                counts = counts.round()
            for k, m in enumerate(micro):
                if accum > 1:  # FSDP reduce-scatters the gradients once, after the last
                    self.model.set_requires_gradient_sync(k == accum - 1)
                self.layouts.enter(m)  # per_document: attention on this batch's layout
                b = m.batch
                self.router.open(k == 0)
                # fp32 sum over this rank's labelled tokens; predictions [B, L/P]
                loss_sum, predictions = loss_and_predictions(self.model, b, m.positions)
                self.router.settle(accum)  # the router loss's gradient, pooled over ranks
                if self.fault_hook is not None and k == 0:
                    loss_sum = self.fault_hook(step, loss_sum)
                # the micro-batches' gradients add up to the step's
                loss_share(loss_sum, counts[0], self.n_shard).backward()
                loss_total += loss_sum.detach().double()
                with torch.no_grad():
                    c, a = self.data.answer_accuracy(predictions, b.labels)
                correct, answers = correct + c, answers + a
            grad_norm = clip_grad_norm(self.model.parameters(), self.cfg.optim.grad_clip,
                                       host=self.cfg.trainer.state_offload)
        gn = float(grad_norm)  # global over dp x sp (FSDP): the same on every rank
        # Sync: global loss and answer accuracy (one all-reduce), read before the optimizer
        # steps so that a non-finite step never changes the weights.
        stats = torch.tensor([loss_total.item(), correct, answers], dtype=torch.float64,
                             device=device)
        dist.all_reduce(stats, group=dp_sp)
        return stats, counts[0].item(), gn

    def finish(self, summary: dict) -> None:
        """After the run's last step: the held-out answer accuracy joins ``summary``
        (``data.eval_batches``)."""
        if self.data.eval_batches > 0:
            summary["eval_acc"] = held_out_accuracy(self.model, self.data,
                                                    self.run.batch_per_dp_rank, self.mesh,
                                                    self.layouts)

    def report(self, summary: dict, start: int, plot: Path | None) -> None:
        """Rank 0's last line: the run's final figures and where it wrote them (``start``:
        the step it started from)."""
        if self.rank != 0:
            return
        tail = f", train accuracy {summary['acc']:.3f}" if "acc" in summary else ""
        if "eval_acc" in summary:
            n = self.data.eval_batches * self.run.micro_batch * self.data.answers_per_sequence
            tail += f", held-out answer accuracy {summary['eval_acc']:.3f} ({n} answers)"
        if "val_loss" in summary:
            tail += f", val loss {summary['val_loss']:.4f} (ppl {summary['val_ppl']:.2f})"
        run_dir = Path(self.run.run_dir).resolve()
        print(f"done: step {summary.get('step', start)}, loss "
              f"{summary.get('loss', float('nan')):.4f}{tail}; run directory {run_dir}"
              + (f" (plot {plot.name})" if plot else ""), flush=True)
