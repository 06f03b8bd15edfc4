"""The training loop, top to bottom. Runs on every rank of an initialised process group.

``train`` finds where the run stands (``newest``), then for each length phase from there
builds it (``Trainer``), resumes it, loops over its steps and closes it, once, however the
phase ends; a phase boundary is a checkpoint the next phase resumes from, in the same
processes. A run without phases is one phase. ``Trainer.train_step`` is one optimizer step: the
micro-batches' forward and backward (``forward_backward``), then the optimizer. Around a
step, one component per concern, each with one verb: ``Validator`` (``should_validate`` /
``validate``), ``MetricsLogger`` (``log``: every step to JSONL and wandb), ``Console``
(``should_log`` / ``log``), ``Preemption`` (``agree``), ``Checkpointer`` (``should_save`` /
``save``; ``load`` to resume).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from ..comm import naming_collectives
from ..config import RunConfig
from ..data.batches import RowLayouts, Rows
from ..data.dataset import build_dataset, build_validation
from ..data.packing import IGNORE_INDEX
from ..layout import SequenceLayout
from ..models.decoder import flops_per_token
from ..models.forward import loss_and_predictions
from ..models.tiling import loss_share
from ..eval.grid import training_cases
from ..eval.sharded import PasskeyScore
from ..eval.val_loss import LengthLoss, held_out_accuracy
from ..run import PhasePlan, RunLayout
from .build import (checkpoint_records, continue_schedule, optimizer, phase_schedule,
                    record_for_export, sharded_model)
from .checkpointer import Checkpointer, Position
from .faults import NonFiniteGuard, Preempted, Preemption
from .fingerprint import run_fingerprint
from .metrics import PeakMemory
from .validator import Validator, missing_splits

FaultHook = Callable[[int, torch.Tensor], torch.Tensor]


def _device(run: RunLayout) -> torch.device:
    """This rank's device, as the layout says: its current CUDA device, or the CPU."""
    if run.device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Trainer:
    """One phase of a run on this rank (a run without phases: the whole run). ``__init__``
    (collective) builds it from its ``Phase``: the mesh and sequence layout, the sharded
    model (``from_checkpoint``: its weights come from the checkpoint ``resume`` loads, not
    from ``model.pretrained``), optimizer and schedule, the data and the components around
    a step; ``running``
    closes the model, optimizer and mesh once. The run's metrics and console (``records``)
    outlive it."""

    def __init__(self, base: RunConfig, plan: PhasePlan, at: Position, records: tuple,
                 fault_hook: FaultHook | None,
                 memory_probe: Callable[[torch.device], PeakMemory],
                 from_checkpoint: bool = False):
        self.phase = phase = plan[at.phase]
        cfg, run, tc = phase.cfg, phase.run, base.trainer  # the loop's settings: the base's
        self.cfg, self.run, self.tc, self.plan = cfg, run, tc, plan
        self.logger, self.console = records
        self.fault_hook = fault_hook
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = _device(run)
        self.end = plan.end(phase.index, at.starts)  # its last step, unless its gate ends it
        self.mesh = run.build_mesh()
        # who holds which tokens: the run's one layout, or under per_document each batch's own
        self.layouts = RowLayouts(self.mesh, run.seq_len, run.balance, self.device)
        layout = self.layouts.sequence
        if self.rank == 0:
            if len(plan) > 1:
                print(plan.describe(phase.index, at.starts), flush=True)  # its steps as run
            print(f"{self.mesh.describe()}\nbalance={run.balance}", flush=True)
            record_for_export(cfg, run.run_dir)  # the latest phase's model and length
        # resuming (a later phase, a restart): the weights come from the checkpoint alone
        self.model, use = sharded_model(cfg, run, self.mesh, layout, self.device,
                                        from_checkpoint)
        self.layouts.use = use
        self.opt, self.sched = optimizer(base.optim, self.model,
                                         phase_schedule(base.optim, plan, at.starts))
        self.data = build_dataset(cfg.data, cfg.model, phase.index)  # the phase's own passes
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
                                   self._short_loss(plan, use, layout, splits))
        self.guard = NonFiniteGuard(tc.on_nonfinite)
        self.checkpointer = Checkpointer(tc, run, run_fingerprint(base, plan), self.rank,
                                         self.end, checkpoint_records(cfg))
        self.dp_sp = self.mesh.group("loss")  # the loss's token count, the metrics (dp_sp)
        self.n_shard = self.mesh.submesh("fsdp").size()
        self.flops = flops_per_token(cfg.model, run.seq_len)
        self.peak_mem = memory_probe(self.device)
        # in every record: which phase and layout made it
        self.where = {"phase": phase.index + 1, "seq_len": run.seq_len, "dp": run.dp,
                      "ring": run.ring, "ulysses": run.ulysses}

    def _short_loss(self, plan: PhasePlan, use, layout: SequenceLayout,
                    splits: list) -> LengthLoss | None:
        """A later phase's validation at the first phase's length (``short_val_loss``),
        when the data has validation splits; None in the first phase or without them."""
        first = plan[0].cfg
        if self.phase.index == 0 or not splits:
            return None
        short = build_validation(first.data, first.model, self.tc.eval_windows)
        layouts = RowLayouts(self.mesh, first.data.seq_len, self.run.balance, self.device, use)
        return LengthLoss(short, layouts, use, layout, self.run.batch_per_dp_rank, self.mesh)

    def resume(self, ckpt: Path | None, report: bool) -> None:
        """Collective: checkpoint ``ckpt`` (the newest at the start of a run, the boundary's
        in a later phase; None: a fresh start) loaded into the phase's model, optimizer and
        schedule, resharded to its layout; the phase's schedule then sets the lr.
        ``report``: rank 0 says where the run resumed."""
        if ckpt is not None:
            self.checkpointer.load(ckpt, self.model, self.opt, self.sched, report)
            continue_schedule(self.opt, self.sched)  # a new phase may start a new warmup

    @contextmanager
    def running(self) -> Iterator[None]:
        """Closes the phase's model, optimizer and mesh (``close``) however the block ends."""
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
        ``SPMesh.close``): the next phase builds its own."""
        self.model = self.opt = self.sched = self.validator = self.dp_sp = None
        self.mesh.close(barrier=barrier)

    def loop(self, at: Position) -> tuple[dict, tuple[Path, Position] | None]:
        """Optimizer steps ``at.step + 1`` .. the phase's last (1-based; its gate or
        ``trainer.stop_after`` ends it earlier) from ``at``: (the last step's summary, {}
        when no step is left; the boundary, (its checkpoint, the next phase's position), or
        None when the run ends in this phase)."""
        tc, phase, last_phase = self.tc, self.phase, self.phase.index == len(self.plan) - 1
        summary: dict = {}
        self.guard.skipped = at.skipped
        # The handlers only set a flag; the previous ones are back however the loop ends.
        with Preemption(tc.preempt_signals) as preemption:
            if at.step == 0 and self.validator.should_validate(0):  # where the model starts
                record = {"step": 0, **self.validator.validate(self.model, 0), **self.where}
                self.logger.log(record)
                self.console.log(record)
            for step in range(at.step + 1, self.end + 1):
                summary = self.train_step(step, at)
                at = replace(at, step=step, consumed=summary["samples"],
                             skipped=summary["skipped_steps"])
                validated = self.validator.should_validate(step)
                if validated:
                    summary.update(self.validator.validate(self.model, step))
                # the phase ends here: its gate holds at this validation, or its last step
                gated = validated and self.gate_holds(summary, at)
                ends = gated or step == self.end
                if ends and phase.index == 0:  # the first phase's final validation loss
                    at = replace(at, reference=summary.get("val_loss"))
                if ends and (len(self.plan) > 1 or phase.until is not None):
                    summary["phase_end"] = "gate" if gated else "steps"
                self.logger.log(summary)
                self.console.log(summary)
                self.console.phase_end(summary, phase.until)
                # Sync: every rank learns whether any rank got a preemption signal (none is
                # needed after the last step: the run is complete and exits normally).
                done = ends and last_phase
                sig = None if done else preemption.agree(self.device)
                after = at if done or not ends else at.next_phase(self.run.seq_len)
                if self.checkpointer.should_save(step, preempted=sig is not None,
                                                 ends_phase=ends):
                    ckpt = self.checkpointer.save(step, self.model, self.opt, self.sched, after)
                if sig is not None:
                    err = Preempted(step, sig.name, str(ckpt))
                    if self.rank == 0:
                        print(f"usp: {err}", flush=True)
                    raise err
                if step == tc.stop_after or done:
                    break
                if ends:
                    return summary, (ckpt, after)
        return summary, None

    def gate_holds(self, scores: dict, at: Position) -> bool:
        """Whether the phase's gate (``until``) holds on a validation's ``scores``: they are
        all-reduced (the passkey's broadcast), so every rank decides alike."""
        gate = self.phase.until
        return gate is not None and gate.holds(scores.get(f"passkey_acc/{self.run.seq_len}"),
                                               scores.get("short_val_loss"), at.reference)

    def train_step(self, step: int, at: Position) -> dict:
        """Optimizer step ``step`` (1-based) on the global batch after the phase's
        ``at.consumed`` samples: forward and backward of its micro-batches, then the optimizer
        and schedule (not for a skipped non-finite step); the step's summary (``samples``:
        the phase's position after it)."""
        run, data, consumed = self.run, self.data, at.consumed
        t0, comm0 = time.perf_counter(), self.mesh.comm.total_seconds()
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
        comm = self.mesh.comm.total_seconds() - comm0
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
            "samples": consumed,  # the data position: the phase's samples consumed
            "tokens_seen": replace(at, consumed=consumed).tokens_seen(run.seq_len),
            **self.where,  # which phase and layout made it, last on the console line
        }
        summary.update(data.epochs(consumed))
        if data.has_answers:
            summary["acc"] = stats[1].item() / max(1.0, stats[2].item())
        return summary

    def forward_backward(self, step: int, micro: list[Rows]) -> tuple[torch.Tensor, float, float]:
        """Forward and backward of optimizer step ``step``'s micro-batches (each [B, L/P]),
        their gradients added up and clipped to ``optim.grad_clip``: (stats [loss sum,
        correct answers, answers] fp64 over dp x sp, labelled tokens over dp x sp, the
        global grad norm before clipping)."""
        accum, device, dp_sp = len(micro), self.device, self.dp_sp
        # Sync: the target tokens of all micro-batches over dp x sp normalise the loss.
        counts = torch.tensor([float(sum((m.batch.labels != IGNORE_INDEX).sum().item()
                                         for m in micro))],
                              dtype=torch.float64, device=device)
        loss_total = torch.zeros((), dtype=torch.float64, device=device)
        correct = answers = 0
        # a peer that never answers an FSDP or loss collective is named as a dp_sp timeout
        # (usp's all-to-all and ring name their own axis inside)
        with naming_collectives("dp_sp", dp_sp):
            dist.all_reduce(counts, group=dp_sp)
            for k, m in enumerate(micro):
                if accum > 1:  # FSDP reduce-scatters the gradients once, after the last
                    self.model.set_requires_gradient_sync(k == accum - 1)
                self.layouts.enter(m)  # per_document: attention on this batch's layout
                b = m.batch
                # fp32 sum over this rank's labelled tokens; predictions [B, L/P]
                loss_sum, predictions = loss_and_predictions(self.model, b, m.positions)
                if self.fault_hook is not None and k == 0:
                    loss_sum = self.fault_hook(step, loss_sum)
                # the micro-batches' gradients add up to the step's
                loss_share(loss_sum, counts[0], self.n_shard).backward()
                loss_total += loss_sum.detach().double()
                with torch.no_grad():
                    c, a = self.data.answer_accuracy(predictions, b.labels)
                correct, answers = correct + c, answers + a
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                       self.cfg.optim.grad_clip)
        gn = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        gn = float(gn)  # global over dp x sp (FSDP): the same on every rank
        # Sync: global loss and answer accuracy (one all-reduce), read before the optimizer
        # steps so that a non-finite step never changes the weights.
        stats = torch.tensor([loss_total.item(), correct, answers], dtype=torch.float64,
                             device=device)
        dist.all_reduce(stats, group=dp_sp)
        return stats, counts[0].item(), gn

    def finish(self, summary: dict) -> Path | None:
        """After the last step: the bar ends, the held-out answer accuracy joins ``summary``
        (``data.eval_batches``), the metrics get their final summary; the plot (or None)."""
        self.console.close()
        if self.data.eval_batches > 0:
            summary["eval_acc"] = held_out_accuracy(self.model, self.data,
                                                    self.run.batch_per_dp_rank, self.mesh,
                                                    self.layouts)
        self.logger.finish(summary)
        return self.logger.plot()

    def report(self, summary: dict, at: Position, plot: Path | None) -> None:
        """Rank 0's last line: the run's final figures and where it wrote them (``at``:
        where it started)."""
        if self.rank != 0:
            return
        tail = f", train accuracy {summary['acc']:.3f}" if "acc" in summary else ""
        if "eval_acc" in summary:
            n = self.data.eval_batches * self.run.micro_batch * self.data.answers_per_sequence
            tail += f", held-out answer accuracy {summary['eval_acc']:.3f} ({n} answers)"
        if "val_loss" in summary:
            tail += f", val loss {summary['val_loss']:.4f} (ppl {summary['val_ppl']:.2f})"
        run_dir = Path(self.run.run_dir).resolve()
        print(f"done: step {summary.get('step', at.step)}, loss "
              f"{summary.get('loss', float('nan')):.4f}{tail}; run directory {run_dir}"
              + (f" (plot {plot.name})" if plot else ""), flush=True)
