"""The training loop, top to bottom. Runs on every rank of an initialised process group."""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from ..attention import usp_attention
from ..comm import naming_collectives
from ..config import MemmapData, RunConfig
from ..layout import SequenceLayout
from ..mesh import SPMesh
from ..models.llama import Transformer, flops_per_token
from ..models.offload import ActivationOffload, StreamCopier
from ..data.packing import IGNORE_INDEX
from ..models.tiling import loss_share
from ..models.checkpoint import choose_checkpoint, load_checkpoint, save_checkpoint
from .build import _hf_model, lr_lambda, record_for_export, shard_model
from .fingerprint import run_fingerprint
from .forward import loss_and_predictions
from .validator import _validate, evaluate
from .faults import NonFiniteGuard, Preempted, Preemption
from .metrics import MetricsLogger, PeakMemory
from ..data.dataset import build_dataset, build_validation, source_names
from ..run import RunLayout, resolve_run_group


FaultHook = Callable[[int, torch.Tensor], torch.Tensor]


def train(cfg: RunConfig, run: RunLayout | None = None, fault_hook: FaultHook | None = None,
          memory_probe: Callable[[torch.device], PeakMemory] = PeakMemory) -> dict:
    """Train ``cfg.trainer.steps`` steps; returns the summary of the last step (every rank).

    ``run``: the layout the launcher resolved (``usp.run.resolve_run``); None: resolved
    here, once, by rank 0 for the group (``resolve_run_group``), for a caller that made
    the process group itself. Degrees, placement, a2a chunks, dtype and per-rank batch
    come from it, not from ``cfg.parallel``.

    Faults (``usp.train.faults``): a signal in ``trainer.preempt_signals`` on any rank makes
    every rank checkpoint at the next step boundary and raise ``Preempted`` (its
    ``exit_code`` is the process's; SIGTERM is ignored from then on, as the process is
    ending); a non-finite global loss or grad norm raises
    ``NonFiniteError`` before the optimizer step (``trainer.on_nonfinite=stop``) or skips the
    step (``skip``). ``fault_hook(step, loss_sum) -> loss_sum`` (tests): called on every rank
    with the 1-based step and this rank's loss sum before backward; it may send a signal or
    return a changed loss. ``memory_probe(device)`` builds the per-step memory probe
    (``start()`` at each step start, ``peak_mb()`` after the optimizer step).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")
    tc = cfg.trainer
    if run is None:
        run = resolve_run_group(cfg, device.type)
        if rank == 0 and run.plan_table:
            print(run.plan_table, flush=True)
    if run.world != world:
        raise ValueError(f"the run was laid out for {run.world} ranks but this group has "
                         f"{world}; resolve it for this launch (usp.run.resolve_run)")
    mesh = run.build_mesh()
    layout = SequenceLayout(mesh, seq_len=run.seq_len, balance=run.balance)
    positions = layout.positions(device)  # global ids of this rank's tokens (RoPE, data)
    if rank == 0:
        print(mesh.describe(), flush=True)
        record_for_export(cfg)

    # Model: identical init on every rank, then sharded (FSDP2) over the flattened dp x sp
    # axes. FSDP averages gradients over those ranks; the loss below is normalised by the
    # global token count and scaled by the rank count, so the average is the exact sum.
    # bf16 is FSDP's mixed precision (bf16 compute, fp32 master weights), not autocast: the
    # ops that need fp32 upcast themselves (RMSNorm, RoPE, attention LSE and merge, loss).
    if cfg.model.hf is None:
        attn = partial(usp_attention, mesh=mesh, layout=layout, causal=True,
                       **run.attention_options())
        offload = ActivationOffload(StreamCopier(device)) if tc.activation_offload else None
        model = Transformer(cfg.model, attn, checkpoint_activations=tc.activation_checkpointing,
                            checkpoint_every=tc.checkpoint_every,
                            checkpoint_part=tc.checkpoint_part, offload=offload)
        model.init_weights(tc.seed)
        blocks = model.layers
    else:
        model, blocks = _hf_model(cfg, run, mesh, layout)
    model.to(device)
    shard_model(model, mesh.submesh("dp_sp"), run.dtype, blocks)
    oc = cfg.optim
    opt = torch.optim.AdamW(model.parameters(), lr=oc.lr, betas=(oc.beta1, oc.beta2),
                            weight_decay=oc.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(oc, tc.steps))
    data = build_dataset(cfg.data, cfg.model)
    val = build_validation(cfg.data, cfg.model, tc.eval_windows)  # [(name, weight, split)]
    if rank == 0 and isinstance(cfg.data, MemmapData) and \
            len(val) < len(cfg.data.sources()):
        scored = {name for name, _, _ in val}
        missing = [p for n, (p, _) in zip(source_names(cfg.data), cfg.data.sources())
                   if n not in scored]
        print(f"no validation split {', '.join(f'{p}.val.bin' for p in missing)} (or too "
              "short for one window): no val_loss there; usp-prepare writes one "
              "(--val-fraction)", flush=True)

    start, consumed = 0, 0
    guard = NonFiniteGuard(tc.on_nonfinite)
    # Sync: every rank verifies a share of the newest checkpoint's files; all take the same
    # one, and a resume with other settings (lr, seq_len, model shape...) is refused by name
    ckpt = choose_checkpoint(tc.run_dir) if tc.resume else None
    if ckpt is not None:
        extra = load_checkpoint(ckpt, model, opt, sched, fingerprint=run_fingerprint(cfg))
        start = extra["step"]
        # the data position: samples consumed (a checkpoint from before it: steps x batch)
        consumed = extra.get("consumed", start * run.global_batch)
        guard.skipped = extra.get("skipped_steps", 0)
        if not extra["rng_restored"]:
            torch.manual_seed(tc.seed + 1000 * start + rank)
        if rank == 0:
            print(f"resumed from {ckpt} at step {start} ({consumed} samples consumed); a step "
                  f"is {run.global_batch} samples: dp {run.dp} x {run.grad_accum} "
                  f"micro-batch(es) of {run.batch_per_dp_rank}", flush=True)
            before = extra.get("global_batch")
            if before is not None and before != run.global_batch:  # e.g. fewer nodes, no T
                print(f"usp: the global batch changed from {before} to {run.global_batch} "
                      f"samples per step; trainer.global_batch_tokens keeps it across layouts",
                      flush=True)
    run_dir = Path(tc.run_dir)
    logger = MetricsLogger(cfg.logging, run_dir, rank, {**asdict(cfg), "layout": asdict(run)},
                           resume_step=start)
    bar = None
    if rank == 0 and cfg.logging.progress and sys.stderr.isatty():
        # a terminal gets the bar; a job's log file (Slurm, nohup) the step lines alone
        from tqdm import tqdm

        bar = tqdm(total=tc.steps, initial=start, desc="train", dynamic_ncols=True)

    try:
        # The handlers only set a flag; the previous ones are back however the loop ends.
        with Preemption(tc.preempt_signals) as preemption:
            summary = _loop(cfg, run, (start, consumed), model, opt, sched, (data, val), mesh,
                            positions, device, logger, bar, guard, preemption, fault_hook,
                            memory_probe)
    except BaseException as e:  # Preempted, NonFiniteError, a lost peer: flush what was logged
        if isinstance(e, Preempted):
            # the checkpoint is written and the process is ending: a second SIGTERM (the
            # scheduler's own, a requeue ending the step) must not cut the close below
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if bar is not None:
            bar.close()
        logger.close()
        del model, opt, sched  # FSDP state holds the mesh's groups
        mesh.close(barrier=False)  # a peer may be stuck in a collective: no barrier
        raise
    if bar is not None:
        bar.close()
    if data.eval_batches > 0:
        summary["eval_acc"] = evaluate(model, data, run.batch_per_dp_rank, mesh, positions, device)
    logger.finish(summary)
    plot = logger.plot()
    logger.close()
    if rank == 0:
        tail = f", train accuracy {summary['acc']:.3f}" if "acc" in summary else ""
        if "eval_acc" in summary:
            n = data.eval_batches * run.micro_batch * data.answers_per_sequence
            tail += f", held-out answer accuracy {summary['eval_acc']:.3f} ({n} answers)"
        if "val_loss" in summary:
            tail += f", val loss {summary['val_loss']:.4f} (ppl {summary['val_ppl']:.2f})"
        print(f"done: step {summary.get('step', start)}, loss {summary.get('loss', float('nan')):.4f}"
              f"{tail}; run directory {run_dir.resolve()}"
              + (f" (plot {plot.name})" if plot else ""), flush=True)
    # free the mesh's groups while the interpreter is alive (see SPMesh.close); FSDP state
    # holds the dp_sp group, so the model and optimizer go first
    del model, opt, sched
    mesh.close()
    return summary


def _loop(cfg: RunConfig, run: RunLayout, position: tuple[int, int], model, opt, sched, datas,
          mesh: SPMesh, positions, device, logger: MetricsLogger, bar, guard: NonFiniteGuard,
          preemption: Preemption, fault_hook: FaultHook | None,
          memory_probe: Callable[[torch.device], PeakMemory]) -> dict:
    """Steps ``start`` .. ``trainer.steps`` - 1 from ``position`` = (start, samples consumed);
    returns the last step's summary."""
    tc, oc = cfg.trainer, cfg.optim
    (start, consumed), (data, val) = position, datas
    rank, world = dist.get_rank(), dist.get_world_size()
    run_dir = Path(tc.run_dir)
    dp_sp = mesh.group("dp_sp")
    n_shard = mesh.submesh("dp_sp").size()
    tokens_per_step = run.tokens_per_step
    flops = flops_per_token(cfg.model, run.seq_len)
    peak_mem = memory_probe(device)
    accum = run.grad_accum
    summary: dict = {}
    for step in range(start, tc.steps):
        t0 = time.perf_counter()
        comm0 = mesh.comm.total_seconds()
        peak_mem.start()  # the peak below is this step's, not the run's
        # Data: the step's global batch is the next global_batch samples after `consumed`;
        # micro-batch k takes [k, k+1) x micro_batch of them and this dp rank its own part.
        # Only this rank's tokens are read; labels were shifted (and, for packed documents,
        # cut at document boundaries) on the global sequence.
        micro = [data.model_rows(run.samples(consumed, k, mesh.dp_rank), positions).to(device)
                 for k in range(accum)]  # each [B, L/P]
        # Sync: the target tokens of all micro-batches over dp x sp normalise the loss.
        counts = torch.tensor([float(sum((b.labels != IGNORE_INDEX).sum().item() for b in micro))],
                              dtype=torch.float64, device=device)
        loss_total = torch.zeros((), dtype=torch.float64, device=device)
        correct = answers = 0
        # a peer that never answers an FSDP or loss collective is named as a dp_sp timeout
        # (usp's all-to-all and ring name their own axis inside)
        with naming_collectives("dp_sp", dp_sp):
            dist.all_reduce(counts, group=dp_sp)
            for k, b in enumerate(micro):
                if accum > 1:  # FSDP reduce-scatters the gradients once, after the last
                    model.set_requires_gradient_sync(k == accum - 1)
                # fp32 sum over this rank's labelled tokens; predictions [B, L/P]
                loss_sum, predictions = loss_and_predictions(model, b, positions)
                if fault_hook is not None and k == 0:
                    loss_sum = fault_hook(step + 1, loss_sum)
                # the micro-batches' gradients add up to the step's
                loss_share(loss_sum, counts[0], n_shard).backward()
                loss_total += loss_sum.detach().double()
                with torch.no_grad():
                    c, a = data.answer_accuracy(predictions, b.labels)
                correct, answers = correct + c, answers + a
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), oc.grad_clip)
        gn = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        gn = float(gn)  # global over dp x sp (FSDP): the same on every rank

        # Sync: global loss and answer accuracy (one all-reduce), read before the optimizer
        # steps so that a non-finite step never changes the weights.
        stats = torch.tensor([loss_total.item(), correct, answers], dtype=torch.float64,
                             device=device)
        dist.all_reduce(stats, group=dp_sp)
        loss = stats[0].item() / counts[0].item()
        # on_nonfinite: stop raises here (no step, no checkpoint); skip drops the grads
        skip = guard.check(step + 1, loss, gn)
        if skip:
            if rank == 0:
                print(f"step {step + 1}: non-finite loss {loss} / grad norm {gn}; skipped "
                      f"(optimizer and schedule not stepped; {guard.skipped} skipped so far)",
                      flush=True)
        else:
            opt.step()
            sched.step()
        opt.zero_grad(set_to_none=True)

        # Metrics: throughput, the busiest rank's memory.
        peak = torch.tensor([peak_mem.peak_mb()], dtype=torch.float64, device=device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=dp_sp)  # the busiest rank's peak
        dt = time.perf_counter() - t0
        comm = mesh.comm.total_seconds() - comm0
        consumed += run.global_batch
        summary = {
            "step": step + 1,
            "loss": loss,
            "lr": sched.get_last_lr()[0],
            "grad_norm": gn,
            "tokens_per_s": tokens_per_step / dt,
            "mfu": flops * tokens_per_step / dt / (cfg.cluster.peak_flops * world),
            "peak_mem_mb": peak.item(),
            "peak_mem_kind": peak_mem.kind,
            "attn_comm_share": comm / dt,
            "attn_comm_clock": mesh.comm.clock,  # host (gloo) or cuda_events (blocked stream time)
            "step_s": dt,
            "skipped_steps": guard.skipped,
            "samples": consumed,  # the data position: global samples consumed
            "tokens_seen": consumed * run.seq_len,
        }
        summary.update(data.epochs(consumed))
        if data.has_answers:
            summary["acc"] = stats[1].item() / max(1.0, stats[2].item())
        last = step + 1 == tc.steps
        if val and (last or (tc.eval_every and (step + 1) % tc.eval_every == 0)):
            summary.update(_validate(model, val, run, mesh, positions, device))
        logger.log(summary)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{summary['loss']:.3f}",
                            **({"acc": f"{summary['acc']:.2f}"} if "acc" in summary else {}))
        if rank == 0 and ((tc.log_every and (step + 1) % tc.log_every == 0)
                          or "val_loss" in summary):
            line = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                            for k, v in summary.items())
            bar.write(line) if bar is not None else print(line, flush=True)
        stopping = tc.stop_after is not None and step + 1 == tc.stop_after
        # Sync: every rank learns whether any rank got a preemption signal (none is needed
        # after the last step: the run is complete and exits normally).
        sig = None if last else preemption.agree(device)
        if (tc.ckpt_every and (step + 1) % tc.ckpt_every == 0) or last or stopping or sig:
            # the data position: samples consumed, so any later dp and accumulation continue it
            ckpt = save_checkpoint(run_dir, step + 1, model, opt, sched, keep=tc.keep_checkpoints,
                                   extra={"skipped_steps": guard.skipped, "consumed": consumed,
                                          "global_batch": run.global_batch},
                                   fingerprint=run_fingerprint(cfg))
        if sig is not None:
            err = Preempted(step + 1, sig.name, str(ckpt))
            if rank == 0:
                print(f"usp: {err}", flush=True)
            raise err
        if stopping:
            break
    return summary
