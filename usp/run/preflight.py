"""The rules each task checks on its own config, machine and files before any rank starts."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch

from ..config import ModelConfig, RunConfig
from ..data.dataset import build_dataset, build_validation
from ..dims.balance import choose_balance, sequence_balance
from ..attention import check_sinks
from ..masks import check_masks
from ..models.families import check_model
from ..models.hf_model import check_pretrained
from ..dims.heads import check_heads
from ..models.pretrained import check_checkpoint
from ..planner.fit import max_seq_len
from ..planner.memory import size
from ..planner.options import StepPolicy
from ..eval.grid import passkey_lengths, training_cases
from ..rules import check_kernel, check_seq_len
from .run_layout import RunLayout


def check_inputs(cfg: RunConfig, device: str, run_dir: str | None) -> None:
    """The rules on a task's config, files and packages that no degree changes: its data
    files, its run directory, the kernel and ring engine on ``device`` ("cpu" or "cuda"),
    its masks, its transformers model, its recomputation settings."""
    check_model(cfg.model)  # model.hf / model.arch: a family, and a shape it holds
    pc = cfg.parallel
    try:
        # missing / corrupt data fails here
        build_dataset(cfg.data, cfg.model, loss_norm=cfg.trainer.loss_norm)
        build_validation(cfg.data, cfg.model, cfg.trainer.eval_windows)
    except ValueError as e:
        raise ValueError(f"data.kind={cfg.data.kind}: {e}") from None
    check_run_dir(run_dir)
    # the kernel and ring engine on this device, dtype and head dim (attention is causal)
    try:
        check_kernel(pc.kernel, device, cfg.trainer.compute_dtype, cfg.model.head_dim,
                     pc.ring_impl, causal=True, balance=pc.balance)
    except ValueError as e:
        raise ValueError(f"parallel.kernel={pc.kernel} parallel.ring_impl={pc.ring_impl} "
                         f"trainer.dtype={cfg.trainer.dtype} on {device}: {e}") from None
    check_run_masks(cfg)
    check_training_passkey(cfg)
    check_hf_model(cfg.model)
    check_recompute(cfg, device)
    if pc.ring_impl == "ring_flash_attn" and not _installed("ring_flash_attn"):
        raise ValueError("parallel.ring_impl=ring_flash_attn needs the ring-flash-attn package, "
                         "which this Python cannot import; pip install ring-flash-attn==0.1.8 "
                         "flash-attn, or use parallel.ring_impl=usp")


def _balance(cfg: RunConfig, balance: str | None) -> str:
    """The run's balance: ``balance`` (decided), or for None the config's (``auto`` resolved)."""
    if balance is not None:
        return balance
    return choose_balance(cfg.parallel.balance, cfg.data.packed, cfg.parallel.ring_impl)[0]


def check_degrees_fit(cfg: RunConfig, ulysses: int, ring: int, balance: str | None = None) -> None:
    """The config's heads over ``ulysses`` ranks and its sequence over ``ring x ulysses``
    (by the run's ``balance``; None: ``parallel.balance``, ``auto`` resolved), each refused
    with its own message."""
    balance = _balance(cfg, balance)
    check_heads(cfg.model.n_heads, cfg.model.n_kv_heads, ulysses)
    check_seq_len(cfg.data.seq_len, ulysses, ring, balance)
    if cfg.eval.during_training:  # each passkey length runs on the training layout
        lengths = passkey_lengths(cfg, cfg.data.seq_len)
        for length in lengths:
            try:
                check_seq_len(length, ulysses, ring, sequence_balance(balance))
            except ValueError as e:
                raise ValueError(f"eval.during_training=true scores eval.lengths={lengths} on "
                                 f"the training layout: {e}") from None


def check_passkey_memory(cfg: RunConfig, dp: int, ring: int, ulysses: int, device: str,
                         balance: str | None = None) -> None:
    """``eval.during_training``: each passkey length's forward pass (``eval.per_cell`` rows, on
    the training layout) fits the device beside the state training keeps, by the planner's
    forward-only memory (``forward_only=True``, FSDP shards) plus AdamW's m and v
    (``8 N / W``); else refused with the longest length that fits. ``balance``: the run's
    (None: ``parallel.balance``, ``auto`` resolved); passkey rows are one sequence each
    (``sequence_balance``)."""
    if not cfg.eval.during_training:
        return
    mc, pc, world = cfg.model, cfg.parallel, dp * ring * ulysses
    step = StepPolicy(dtype_bytes=cfg.trainer.compute_dtype.itemsize, kernel=pc.kernel,
                      device=device, forward_only=True, fsdp=True)
    optimizer = 8 * mc.num_params() / world  # AdamW m and v, fp32, sharded
    budget, rows = step.budget(cfg.cluster) - optimizer, cfg.eval.per_cell
    for length in passkey_lengths(cfg, cfg.data.seq_len):
        peak = step.memory(mc, length, dp, ring, ulysses, rows).total
        if peak > budget:
            most = max_seq_len(mc, budget, dp, ring, ulysses,
                               balance=sequence_balance(_balance(cfg, balance)), batch=rows,
                               **step.memory_kw())
            raise ValueError(
                f"eval.during_training=true scores eval.lengths on the training layout (dp "
                f"{dp}, ring {ring}, ulysses {ulysses}): a passkey forward of {rows} rows at "
                f"{length} tokens needs {size(peak + optimizer)} per rank with the optimizer "
                f"state training keeps (planner, forward only) > {size(budget + optimizer)} "
                f"({step.mem_fraction:.0%} of cluster.mem_bytes={size(cfg.cluster.mem_bytes)})"
                f"; the longest that fits is {most}; use eval.lengths up to {most}, fewer "
                f"eval.per_cell, or score the length with usp-eval")


def check_task(cfg: RunConfig, layout: RunLayout) -> None:
    """What a task other than the resolving one checks of its own config and machine
    against the resolved ``layout``: it sees a GPU when the run computes on one, its
    inputs (``check_inputs``) and its heads and sequence on these degrees."""
    if layout.device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"the run computes on cuda (trainer.device={cfg.trainer.device}) but "
                         "this task sees 0 CUDA GPUs; run every task where a GPU is visible, "
                         "or use trainer.device=cpu")
    check_inputs(cfg, layout.device, layout.run_dir)  # every rank writes its checkpoint shard
    check_degrees_fit(cfg, layout.ulysses, layout.ring, layout.balance)
    check_passkey_memory(cfg, layout.dp, layout.ring, layout.ulysses, layout.device,
                         layout.balance)


def check_run_dir(path: str | None) -> None:
    """Refuse a run directory this process could not create or write (checkpoints, metrics),
    before any rank starts. None: nothing to check here."""
    if path is None:
        return
    p = Path(path).expanduser().absolute()
    existing = p
    while not existing.exists():  # the nearest ancestor that exists decides
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"trainer.run_dir={path} cannot be a directory: {existing} is a file; "
                         f"choose another trainer.run_dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"trainer.run_dir={path} is not writable: this user cannot write "
                         f"{existing}; choose a writable trainer.run_dir")


def _installed(module: str) -> bool:
    return module in sys.modules or importlib.util.find_spec(module) is not None


def check_run_masks(cfg: RunConfig) -> None:
    """Refuse document ids (``data.packing=documents``) or a sliding window the attention
    kernel and ring engine cannot apply (the rule is ``usp.masks.check_masks``'s), and
    attention sinks (``model.attention_sinks``, gpt-oss's) a ring engine cannot fold in
    (``usp.attention.check_sinks``'s)."""
    mc, pc = cfg.model, cfg.parallel
    if mc.attention_sinks:  # stand-ins of the shapes the model passes: q [1, 1, Hq, 1], [Hq]
        try:
            check_sinks(torch.zeros(mc.n_heads), torch.zeros(1, 1, mc.n_heads, 1), pc.ring_impl)
        except ValueError as e:
            raise ValueError(f"model.attention_sinks=true with parallel.ring_impl="
                             f"{pc.ring_impl}: {e}") from None
    window = next((w for w in map(mc.layer_window, range(mc.n_layers)) if w), None)
    ids = torch.zeros(1, 1, dtype=torch.long) if cfg.data.packed else None  # a stand-in
    try:
        check_masks(ids, window, batch=1, seq_len=1, device="cpu", kernel=pc.kernel,
                    ring_impl=pc.ring_impl)
    except ValueError as e:
        raise ValueError(f"data.packing={cfg.data.packing} model.sliding_window="
                         f"{mc.sliding_window} with parallel.kernel={pc.kernel} "
                         f"parallel.ring_impl={pc.ring_impl}: {e}") from None


def check_training_passkey(cfg: RunConfig) -> None:
    """``eval.during_training``: refuse a run with no text to write passkey cases in (the
    synthetic recall task) and every bad input of the grid (``usp.eval.grid``: no
    tokenizer, a key it cannot encode, a length the validation text cannot hold)."""
    if not cfg.eval.during_training:
        return
    if cfg.data.kind == "recall":
        raise ValueError("eval.during_training=true scores passkey cases written in text, but "
                         "data.kind=recall (the synthetic recall task) has no text and no "
                         "tokenizer; train on token files (data=memmap data.path=PREFIX) or "
                         "set eval.during_training=false")
    try:
        training_cases(cfg, cfg.data.seq_len)
    except ValueError as e:
        raise ValueError(f"eval.during_training=true: {e}") from None


def check_hf_model(mc: ModelConfig) -> None:
    """Refuse ``model.hf`` when transformers is missing, the built-in model's memory tiling
    (``loss_chunk``, ``mlp_tiles``, ``norm_tiles``), and a ``model.pretrained`` directory that is not a
    local model of ``mc``'s architecture and shape."""
    if mc.hf is None:
        check_checkpoint(mc)  # model.pretrained: files, shape, tensors (headers only)
        return
    if mc.loss_chunk or mc.mlp_tiles != 1 or mc.norm_tiles != 1:
        raise ValueError(f"model.hf={mc.hf} computes its own LM head, MLP and norms; "
                         f"model.loss_chunk={mc.loss_chunk}, model.mlp_tiles={mc.mlp_tiles} and "
                         f"model.norm_tiles={mc.norm_tiles} apply to the built-in model only: "
                         "set model.loss_chunk=0 model.mlp_tiles=1 model.norm_tiles=1, or "
                         "unset model.hf")
    if not _installed("transformers"):
        raise ValueError(f"model.hf={mc.hf} needs the transformers package, which this Python "
                         "cannot import; pip install 'usp[hf]', or unset model.hf")
    if mc.pretrained is not None:
        check_pretrained(mc)


def check_recompute(cfg: RunConfig, device_type: str) -> None:
    """Refuse activation offload and state offload off CUDA, state offload with a pretrained
    built-in model, and selective checkpoints or activation offload for a transformers model
    (it checkpoints every layer whole, with its own switch)."""
    tc = cfg.trainer
    if tc.state_offload and device_type != "cuda":
        raise ValueError(f"trainer.state_offload=true keeps params, grads and optimizer state "
                         f"in pinned host memory and copies them to the GPU (FSDP2 "
                         f"CPUOffloadPolicy), but the ranks compute on {device_type}; set "
                         f"trainer.state_offload=false")
    if tc.state_offload and cfg.model.hf is None and cfg.model.pretrained is not None:
        raise ValueError(f"trainer.state_offload=true with model.pretrained="
                         f"{cfg.model.pretrained}: the built-in model's shard-by-shard load "
                         f"gives its parameters storage on the GPU, not host memory; set "
                         f"trainer.state_offload=false or unset model.pretrained")
    if tc.activation_offload and device_type != "cuda":
        raise ValueError(f"trainer.activation_offload=true copies activations to pinned host "
                         f"memory on a CUDA side stream, but the ranks compute on "
                         f"{device_type}; set trainer.activation_offload=false")
    selective = tc.checkpoint_every != 1 or tc.checkpoint_part != "block"
    if cfg.model.hf is not None and (selective or tc.activation_offload):
        raise ValueError(f"model.hf={cfg.model.hf} checkpoints every whole layer; "
                         f"trainer.checkpoint_every={tc.checkpoint_every} checkpoint_part="
                         f"{tc.checkpoint_part} activation_offload={tc.activation_offload} "
                         "apply to the built-in model only: set checkpoint_every=1 "
                         "checkpoint_part=block activation_offload=false, or unset model.hf")
