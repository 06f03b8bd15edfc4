"""What a run trains, built on every rank alike: the model (built-in or transformers),
its FSDP2 sharding over dp x sp, the optimizer and learning-rate schedule; and the records
``usp-export`` needs from the run directory."""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy,
                                    fully_shard)

from ..config import MemmapData, OptimConfig, RunConfig, torch_dtype
from ..data.files import tokenizer_dir
from ..layout import SequenceLayout
from ..mesh import SPMesh
from ..data.dataset import data_eos_id
from ..models.run_records import (DATA_RECORD, MODEL_CONFIG, data_record_text, model_config_text,
                                  save_config, save_record, save_tokenizer,
                                  save_tokenizer_files)
from ..models.expert_placement import place_experts
from ..models.shard_load import load_shards
from ..models.offload import ActivationOffload, StreamCopier
from ..models.routed import routed_model
from ..run import RunLayout
from ..run.phases import PhasePlan


def lr_lambda(cfg: OptimConfig, steps: int):
    """Linear warmup to ``lr``, then cosine down to ``min_lr`` at the last step."""

    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        t = (step - cfg.warmup_steps) / max(1, steps - cfg.warmup_steps)
        floor = cfg.min_lr / cfg.lr
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    return f


def phase_schedule(oc: OptimConfig, plan: PhasePlan, starts):
    """The lr factor (of the base ``optim.lr``) after ``count`` schedule steps, for a run of
    ``plan``'s phases started at the recorded ``starts`` (the later ones as planned): in a
    phase without ``lr``, the run's schedule (``lr_lambda`` over ``plan.total_steps``,
    ``trainer.steps``) at that count; in a phase with ``lr``, a new peak with its own
    warmup (``optim.warmup_steps``) decaying to ``optim.min_lr`` over its planned steps from
    its start. ``count`` steps done: the next step is ``count + 1``. A run without phases
    gets exactly ``lr_lambda(oc, trainer.steps)``."""
    run_f, starts = lr_lambda(oc, plan.total_steps), plan.starts_of(starts)
    own = {p.index: lr_lambda(replace(p.cfg.optim, lr=p.lr), p.steps)
           for p in plan.phases if p.lr is not None}

    def f(count: int) -> float:
        k = plan.phase_at(count + 1, starts)
        if k not in own:
            return run_f(count)
        return plan[k].lr * own[k](count - starts[k]) / oc.lr

    return f


def offload_policy(state_offload: bool, device_type: str) -> OffloadPolicy:
    """FSDP2's offload policy for ``trainer.state_offload``: ``CPUOffloadPolicy`` (sharded
    params, their grads and so the optimizer state in host memory, pinned on CUDA so the
    copies run asynchronously on FSDP's streams) or the default, no offload."""
    if not state_offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device_type == "cuda")


def shard_model(model, mesh: DeviceMesh, dtype: str, blocks=None, experts=None,
                state_offload: bool = False) -> None:
    """FSDP2-shard ``model`` in place over ``mesh``: every block (default ``model.layers``;
    a transformers model's are ``model.model.layers``), then the root (embedding, final
    norm, output). ``experts``: None, or (``SPMesh``, N) to spread the experts of a mixture
    of experts over groups of N ranks first (``usp.models.expert_placement.place_experts``).

    ``dtype="bf16"``: parameters are all-gathered in bf16 and forward and backward compute
    in bf16; the sharded parameters, their gradients (reduce-scattered in fp32) and so the
    optimizer state stay fp32. ``dtype="fp32"``: no casts at all.

    ``state_offload`` (``trainer.state_offload``): every ``fully_shard`` call gets FSDP2's
    ``CPUOffloadPolicy`` (``offload_policy``), so the sharded params and grads and the
    optimizer state built on them live in host memory; the device holds what FSDP
    gathers and the unsharded grads before their reduce-scatter.
    """
    compute = torch_dtype(dtype)  # ValueError for a name trainer.dtype does not take
    mp = MixedPrecisionPolicy()
    if compute != torch.float32:
        # cast_forward_inputs=False: a block's float inputs are h, already bf16 (it starts at
        # the bf16 embedding), and the RoPE tables cos/sin, which stay fp32 for apply_rope.
        mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32,
                                  cast_forward_inputs=False)
    policy = offload_policy(state_offload, mesh.device_type)
    if experts is not None and experts[1] > 1:
        place_experts(model, experts[0], experts[1], mp, policy)
    for block in model.layers if blocks is None else blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=policy)


def sharded_model(cfg: RunConfig, run: RunLayout, mesh: SPMesh, layout: SequenceLayout,
                  device: torch.device, from_checkpoint: bool = False):
    """(the run's model, ``use(layout)``): the model (``cfg.model``: the built-in
    model of its family, ``usp.models.families``, or a transformers model for ``model.hf``) on ``device``, initialised
    alike on every rank (``trainer.seed``), attention through usp on ``layout`` as ``run``
    says, then FSDP2-sharded over dp x sp (collective); ``use`` routes its attention through
    another layout (the passkey lengths; ``usp.eval.sharded``).

    ``from_checkpoint``: a checkpoint is loaded into it next (a resume, a later length
    phase), so the built-in model of ``model.pretrained`` gets empty storage on ``device``
    instead of the checkpoint's safetensors: they are read once, by a fresh run's first
    phase."""
    # FSDP averages gradients over the dp x sp ranks; the loss is normalised by the global
    # token count and scaled by the rank count (models.tiling.loss_share), so the average
    # is the exact sum. bf16 is FSDP's mixed precision (bf16 compute, fp32 master weights),
    # not autocast: the ops that need fp32 upcast themselves (RMSNorm, RoPE, attention LSE
    # and merge, loss).
    tc = cfg.trainer
    offload = ActivationOffload(StreamCopier(device)) if tc.activation_offload else None
    model, blocks, use = routed_model(cfg.model, mesh, run.attention_options(), tc.seed, layout,
                                      checkpoint_activations=tc.activation_checkpointing,
                                      checkpoint_every=tc.checkpoint_every,
                                      checkpoint_part=tc.checkpoint_part, offload=offload)
    if cfg.model.hf is not None and dist.get_rank() == 0:
        save_config(model.config, run.run_dir)  # the transformers config, for export
    if cfg.model.hf is not None or cfg.model.pretrained is None:
        model.to(device)
    shard_model(model, mesh.submesh("fsdp"), run.dtype, blocks, (mesh, run.expert_degree),
                tc.state_offload)
    if cfg.model.hf is None and cfg.model.pretrained is not None:
        if from_checkpoint:  # every parameter comes from the checkpoint (DCP)
            model.to_empty(device=device)
        else:
            load_shards(model, cfg.model, device)  # usp.models.shard_load: this rank's rows
    return model, use


def optimizer(oc: OptimConfig, model, schedule, lr: float | None = None):
    """(AdamW over ``model``'s parameters at peak ``lr`` (default ``optim.lr``; a run of
    phases: the base config's, which ``phase_schedule``'s factors are of), its ``LambdaLR``
    by ``schedule(count)``, the factor of that peak: ``phase_schedule``)."""
    opt = torch.optim.AdamW(model.parameters(), lr=oc.lr if lr is None else lr,
                            betas=(oc.beta1, oc.beta2), weight_decay=oc.weight_decay)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule)


def continue_schedule(opt, sched) -> None:
    """After a checkpoint is loaded into ``opt`` and ``sched``: each param group's lr from
    this phase's schedule at the loaded count, not the lr the checkpoint's optimizer state
    holds (a phase boundary may start a new warmup). ``LambdaLR``'s own formula, so a run
    without phases gets the very lr the checkpoint holds."""
    for group, base, factor in zip(opt.param_groups, sched.base_lrs, sched.lr_lambdas):
        group["lr"] = base * factor(sched.last_epoch)


def checkpoint_records(cfg: RunConfig) -> dict[str, str]:
    """What each checkpoint keeps of the config that trained it (``save_checkpoint``'s
    ``records``): its model group and data record, as ``record_for_export`` writes them for
    the run, so that a checkpoint of an earlier length phase is exported and scored with its
    own RoPE and length."""
    return {MODEL_CONFIG: model_config_text(cfg.model),
            DATA_RECORD: data_record_text(cfg.data, data_eos_id(cfg.data))}


def record_for_export(cfg: RunConfig, run_dir: str) -> None:
    """Rank 0, at the start of a run: what ``usp-export`` needs besides the checkpoints, in
    the run directory: the model group (``model_config.json``), for token files with a
    tokenizer (``data.path`` + ``.tokenizer``) a copy of it (``tokenizer/``; else a
    pretrained checkpoint's tokenizer files), and what data it reads (``data_record.json``:
    its kind, the trained length, the data's EOS id, the token files, for the export and
    ``usp-eval``)."""
    for name, text in checkpoint_records(cfg).items():  # what each checkpoint keeps too
        save_record(run_dir, name, text)
    tokenizer = False
    if isinstance(cfg.data, MemmapData):
        first = cfg.data.sources()[0][0]  # a blend's sources share one tokenizer
        if tokenizer_dir(first).is_dir():
            save_tokenizer(tokenizer_dir(first), run_dir)
            tokenizer = True
    if not tokenizer and cfg.model.pretrained is not None:  # export: the checkpoint's own
        save_tokenizer_files(cfg.model.pretrained, run_dir)
