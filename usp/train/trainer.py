"""The training loop, top to bottom. Runs on every rank of an initialised process group."""

from __future__ import annotations

import contextlib
import math
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from ..attention import usp_attention
from ..comm import naming_collectives
from ..config import MemmapData, OptimConfig, RunConfig, torch_dtype
from ..data.files import tokenizer_dir
from ..data.packing import Batch
from ..layout import SequenceLayout
from ..mesh import SPMesh
from ..models.llama import Transformer, flops_per_token
from ..models.offload import ActivationOffload, StreamCopier
from ..models.shard_load import load_shards
from ..models.tiling import lm_loss
from ..models.checkpoint import choose_checkpoint, load_checkpoint, run_fingerprint, save_checkpoint
from ..models.export import save_export_facts, save_model_config, save_tokenizer, save_tokenizer_files
from .faults import NonFiniteGuard, Preempted, Preemption
from .metrics import MetricsLogger, PeakMemory
from ..data.dataset import TrainingData, build_dataset, build_validation, data_eos_id, source_names
from ..run import RunLayout, resolve_run_group


def lr_lambda(cfg: OptimConfig, steps: int):
    """Linear warmup to ``lr``, then cosine down to ``min_lr`` at the last step."""

    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        t = (step - cfg.warmup_steps) / max(1, steps - cfg.warmup_steps)
        floor = cfg.min_lr / cfg.lr
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    return f


def shard_model(model, mesh: DeviceMesh, dtype: str, blocks=None) -> None:
    """FSDP2-shard ``model`` in place over ``mesh``: every block (default ``model.layers``;
    a transformers model's are ``model.model.layers``), then the root (embedding, final
    norm, output).

    ``dtype="bf16"``: parameters are all-gathered in bf16 and forward and backward compute
    in bf16; the sharded parameters, their gradients (reduce-scattered in fp32) and so the
    optimizer state stay fp32. ``dtype="fp32"``: no casts at all.
    """
    compute = torch_dtype(dtype)  # ValueError for a name trainer.dtype does not take
    mp = MixedPrecisionPolicy()
    if compute != torch.float32:
        # cast_forward_inputs=False: a block's float inputs are h, already bf16 (it starts at
        # the bf16 embedding), and the RoPE tables cos/sin, which stay fp32 for apply_rope.
        mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32,
                                  cast_forward_inputs=False)
    for block in model.layers if blocks is None else blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


def _is_hf(model) -> bool:
    """A transformers model (FSDP keeps the class as a base); transformers is imported
    only when one was built."""
    hf = sys.modules.get("transformers")
    return hf is not None and isinstance(model, hf.PreTrainedModel)


def _rope(batch: Batch, positions: torch.Tensor) -> torch.Tensor:
    """The RoPE positions: the row's global ``positions`` [L/P], or each token's place in
    its document when the batch carries ``doc_positions`` [B, L/P]."""
    return positions if batch.doc_positions is None else batch.doc_positions


def forward(model, batch: Batch, positions: torch.Tensor) -> torch.Tensor:
    """logits [B, L/P, V] of this rank's ``batch`` (on the model's device), at the RoPE
    positions of ``_rope``; ``segment_ids`` only when documents are packed. A transformers
    model (``model.hf``) takes them as ``position_ids`` [B, L/P]."""
    rope = _rope(batch, positions)
    if _is_hf(model):
        ids = {} if batch.segment_ids is None else {"segment_ids": batch.segment_ids}
        return model(input_ids=batch.tokens, position_ids=rope.expand(batch.tokens.shape),
                     use_cache=False, **ids).logits
    if batch.segment_ids is None:
        return model(batch.tokens, rope)
    return model(batch.tokens, rope, batch.segment_ids)


def step_loss(loss_sum: torch.Tensor, n_shard: int, count: torch.Tensor | float) -> torch.Tensor:
    """What a rank back-propagates for ``loss_sum``, its summed loss over its labelled
    tokens: ``loss_sum * n_shard / count`` with ``count`` the labelled tokens of the whole
    step over dp x sp. FSDP averages gradients over the ``n_shard`` ranks, which undoes
    the scale, so the step's gradient is that of sum over ranks of loss_sum / count."""
    return loss_sum * (n_shard / count)


def loss_and_predictions(model, batch: Batch, positions: torch.Tensor):
    """(loss_sum, predictions) of this rank's ``batch``: the summed cross-entropy of its
    labelled tokens (0-dim fp32) and each token's argmax [B, L/P] long. The built-in
    ``Transformer`` computes both itself (so ``model.loss_chunk`` can keep whole logits from
    existing); any other model's logits (``forward``) go through the same loss
    (``usp.models.tiling.lm_loss``)."""
    if not isinstance(model, Transformer):
        return lm_loss(forward(model, batch, positions), batch.labels)
    return model(batch.tokens, _rope(batch, positions), batch.segment_ids, labels=batch.labels)


@torch.no_grad()
def evaluate(model, data: TrainingData, batch_per_dp_rank: int, mesh: SPMesh, positions,
             device) -> float:
    """Answer accuracy on ``data.eval_batches`` batches no training step has drawn (held out)."""
    model.eval()
    hits = torch.zeros(2, dtype=torch.float64, device=device)
    for i in range(data.eval_batches):
        b = data.model_batch(10**6 + i, batch_per_dp_rank, mesh.dp_rank, mesh.dp,
                             positions=positions).to(device)
        _, predictions = loss_and_predictions(model, b, positions)
        correct, answers = data.answer_accuracy(predictions, b.labels)
        hits += torch.tensor([correct, answers], dtype=torch.float64, device=device)
    dist.all_reduce(hits, group=mesh.group("dp_sp"))
    model.train()
    return (hits[0] / hits[1].clamp(min=1)).item()


@torch.no_grad()
def validation_loss(model, val: TrainingData, windows: int, batch_per_dp_rank: int,
                    mesh: SPMesh, positions, device) -> float:
    """Mean cross-entropy per target token on the first ``windows`` windows of the
    validation split, whatever the dp split: dp rank r scores windows ``first + r*b ...``
    of each round; a rank short of windows in the last round scores a window with every
    label ignored (it must still join every collective of the forward)."""
    model.eval()
    b, dp = batch_per_dp_rank, mesh.dp
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for first in range(0, windows, b * dp):
        ids = torch.arange(first + mesh.dp_rank * b, first + (mesh.dp_rank + 1) * b)
        real = ids < windows
        batch = val.model_windows(torch.where(real, ids, 0).numpy(), positions)
        batch.labels[~real] = -100  # [B, L/P]: rows past the last window count for nothing
        batch = batch.to(device)
        loss_sum, _ = loss_and_predictions(model, batch, positions)
        sums += torch.stack([loss_sum.double(),
                             (batch.labels != -100).sum().to(torch.float64)])
    dist.all_reduce(sums, group=mesh.group("dp_sp"))
    model.train()
    return (sums[0] / sums[1].clamp(min=1)).item()


def _validate(model, val, run: RunLayout, mesh: SPMesh, positions, device) -> dict:
    """``val_loss`` and ``val_ppl`` of the validation splits ``val`` [(name, weight, split)];
    for a blend also each source's (``val_loss/<name>``), and ``val_loss`` is their mean by
    the blend's weights."""
    out, total, weights = {}, 0.0, 0.0
    for name, weight, split in val:
        loss = validation_loss(model, split, split.eval_windows, run.batch_per_dp_rank, mesh,
                               positions, device)
        if len(val) > 1:
            out[f"val_loss/{name}"] = loss
        total, weights = total + weight * loss, weights + weight
    out["val_loss"] = total / weights
    out["val_ppl"] = math.exp(min(out["val_loss"], 700.0))
    return out


def validate_at_start(model, val, run: RunLayout, mesh: SPMesh, positions, device,
                      logger: MetricsLogger) -> None:
    """Score the validation splits before the first step (``trainer.eval_every`` set): the
    ``step: 0`` record of metrics.jsonl and wandb, and its console line (rank 0), so a run
    shows where its model starts (a pretrained one: the checkpoint's own loss)."""
    record = {"step": 0, **_validate(model, val, run, mesh, positions, device)}
    logger.log(record)
    if dist.get_rank() == 0:
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in record.items()), flush=True)


def _hf_model(cfg: RunConfig, run: RunLayout, mesh: SPMesh, layout: SequenceLayout):
    """(transformers model, its decoder layers): built on every rank alike, its attention
    routed through usp as ``run`` says; rank 0 writes its config to ``run_dir/hf_config``
    for export."""
    from ..models import hf
    from ..models.export import build_model, save_config

    model = build_model(cfg.model, cfg.trainer.seed)
    if cfg.trainer.activation_checkpointing:  # the same non-reentrant torch checkpoint
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf.patch(model, mesh, layout, **run.attention_options())
    if dist.get_rank() == 0:
        save_config(model.config, cfg.trainer.run_dir)
    return model, model.model.layers


def record_for_export(cfg: RunConfig) -> None:
    """Rank 0, at the start of a run: what ``usp-export`` needs besides the checkpoints, in
    the run directory: the model group (``model_config.json``), for token files with a
    tokenizer (``data.path`` + ``.tokenizer``) a copy of it (``tokenizer/``; else a
    pretrained checkpoint's tokenizer files), the trained length and the data's EOS id
    (``export.json``)."""
    save_model_config(cfg.model, cfg.trainer.run_dir)
    tokenizer = False
    if isinstance(cfg.data, MemmapData):
        first = cfg.data.sources()[0][0]  # a blend's sources share one tokenizer
        if tokenizer_dir(first).is_dir():
            save_tokenizer(tokenizer_dir(first), cfg.trainer.run_dir)
            tokenizer = True
    # export: the pretrained directory's tokenizer, the trained length, the data's EOS id
    if not tokenizer and cfg.model.pretrained is not None:
        save_tokenizer_files(cfg.model.pretrained, cfg.trainer.run_dir)
    save_export_facts(cfg.trainer.run_dir, cfg.data.seq_len, data_eos_id(cfg.data))


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
        run = resolve_run_group(cfg, device.type)  # rank 0 prints the planner's table
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
        # model.pretrained: built without weights, each rank reads its shard after sharding
        with torch.device("meta") if cfg.model.pretrained else contextlib.nullcontext():
            model = Transformer(cfg.model, attn, checkpoint_activations=tc.activation_checkpointing,
                                checkpoint_every=tc.checkpoint_every,
                                checkpoint_part=tc.checkpoint_part, offload=offload)
        if cfg.model.pretrained is None:
            model.init_weights(tc.seed)
        blocks = model.layers
    else:
        model, blocks = _hf_model(cfg, run, mesh, layout)
    if cfg.model.hf is not None or cfg.model.pretrained is None:
        model.to(device)
    shard_model(model, mesh.submesh("dp_sp"), run.dtype, blocks)
    if cfg.model.hf is None and cfg.model.pretrained is not None:
        load_shards(model, cfg.model, device)  # usp.models.shard_load: this rank's rows only
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
    if val and tc.eval_every and start == 0:
        validate_at_start(model, val, run, mesh, positions, device, logger)
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
        counts = torch.tensor([float(sum((b.labels != -100).sum().item() for b in micro))],
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
                step_loss(loss_sum, n_shard, counts[0]).backward()
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
