"""What a run decides before training: degrees (``auto`` via the planner), data, checks.

Degrees are decided once per run and written into ``cfg.parallel`` as integers, so no rank
runs topology detection on its own. Local spawn: ``decide_degrees`` and ``preflight`` run
in the launching process, before anything is spawned. torchrun/Slurm: ``preflight_group``
runs both once the process group exists, with rank 0 deciding for everyone.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import DataConfig, MemmapData, ModelConfig, RecallData
from ..data.packing import Batch
from ..masks import check_masks
from ..validate import (check_degrees, check_heads, check_kernel, check_placement,
                        check_ranks_per_node, check_seq_len)


def _degree(value, name: str):
    if value is None or value == "auto":
        return None
    try:
        v = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"parallel.{name} must be an integer or 'auto', got {value!r}") from None
    if v < 1:
        raise ValueError(f"parallel.{name} must be >= 1, got {v}")
    return v


def plan_run(cfg, spec, world: int):
    """The planner's ranking (``usp.planner.Plan``) of the layouts of ``world`` ranks on
    ``spec`` for this run: its model, sequence, balance, placement, fixed degrees,
    ``trainer.dtype``, checkpoint policy and kernel. Every dp the planner considers runs
    ``batch_per_dp_rank`` sequences per dp rank, as the trainer does."""
    from ..planner import CheckpointPolicy, plan

    pc = cfg.parallel
    return plan(cfg.model, spec, cfg.data.seq_len, world=world, balance=pc.balance,
                ulysses=_degree(pc.ulysses_degree, "ulysses_degree"),
                ring=_degree(pc.ring_degree, "ring_degree"), dp=_degree(pc.dp_degree, "dp_degree"),
                batch_per_dp_rank=cfg.data.batch_per_dp_rank, placement=pc.placement,
                dtype_bytes=cfg.trainer.compute_dtype.itemsize, a2a_chunks=pc.a2a_chunks,
                checkpoint=CheckpointPolicy.from_trainer(cfg.trainer), kernel=pc.kernel,
                device="cpu" if cfg.trainer.device == "cpu" else "cuda")


def resolve_degrees(cfg, world: int, env=None) -> tuple[int, int, str]:
    """(ulysses, ring, plan table or ""): fixed degrees pass through; ``auto`` asks the planner."""
    pc = cfg.parallel
    u, r = _degree(pc.ulysses_degree, "ulysses_degree"), _degree(pc.ring_degree, "ring_degree")
    if u is not None and r is not None:
        return u, r, ""
    from ..planner import detect_topology

    spec, report = detect_topology(os.environ if env is None else env, spec=cfg.cluster)
    if pc.ranks_per_node:
        spec = spec.replace(ranks_per_node=pc.ranks_per_node,
                            nodes=world // pc.ranks_per_node)
    elif spec.world != world:
        spec = spec.replace(nodes=max(1, world // spec.ranks_per_node))
    p = plan_run(cfg, spec, world)
    best = p.best
    table = f"{report.line()}\n{p.format_table(show_dropped=False)}"
    return best.ulysses, best.ring, table


class TrainingData:
    """A dataset as the training loop uses it: this rank's batches, the answer accuracy on
    them, and how many held-out batches to score at the end (``eval_batches``).

    ``packed``: batches carry document ids (``data.packing=documents``); ``rope``: the
    model's ``rope``, ``per_document`` adds the positions inside each document."""

    def __init__(self, source, answers_per_sequence: int = 0, eval_batches: int = 0,
                 packed: bool = False, rope: str = "global"):
        self.source = source
        self.answers_per_sequence = answers_per_sequence  # 0: plain text, nothing to score
        self.eval_batches = eval_batches if answers_per_sequence else 0
        self.packed, self.rope = packed, rope

    @property
    def has_answers(self) -> bool:
        return self.answers_per_sequence > 0

    def batch(self, step, batch_per_dp_rank, dp_rank, dp_size, positions):
        """This rank's (tokens, labels), each [B, L/P]; labels shifted on the global sequence."""
        return self.source.batch(step, batch_per_dp_rank, dp_rank, dp_size, positions=positions)

    def model_batch(self, step, batch_per_dp_rank, dp_rank, dp_size, positions) -> Batch:
        """This rank's ``Batch`` [B, L/P] as the model takes it: ``segment_ids`` when packed,
        ``doc_positions`` (the RoPE positions) when ``rope=per_document``, else None."""
        if not self.packed:
            return Batch(*self.batch(step, batch_per_dp_rank, dp_rank, dp_size, positions))
        b = self.source.packed_batch(step, batch_per_dp_rank, dp_rank, dp_size,
                                     positions=positions)
        return b if self.rope == "per_document" else replace(b, doc_positions=None)

    def answer_accuracy(self, predictions, labels) -> tuple[int, int]:
        """(correct answers, answers) on this rank's shard; (0, 0) for plain text.

        ``predictions``: each token's argmax [B, n] long (what the model's loss path
        returns), or logits [B, n, V]."""
        if not self.has_answers:
            return 0, 0
        from ..data.synthetic import answer_accuracy

        correct, answers = answer_accuracy(predictions, labels)
        return int(correct), int(answers)


def build_dataset(dc: DataConfig, mc: ModelConfig) -> TrainingData:
    """The dataset ``dc`` describes, for a model of ``mc``'s vocabulary and RoPE."""
    if mc.rope == "per_document" and not dc.packed:
        raise ValueError(f"model.rope=per_document restarts positions at each document, but "
                         f"data.packing={dc.packing} gives the model no documents; set "
                         f"data.packing=documents or model.rope=global")
    packing = {"packed": dc.packed, "rope": mc.rope}
    if isinstance(dc, RecallData):
        from ..data.synthetic import RecallTask

        task = RecallTask(vocab_size=mc.vocab_size, seq_len=dc.seq_len, n_pairs=dc.n_pairs,
                          n_queries=dc.n_queries, seed=dc.seed,
                          documents_per_row=dc.documents_per_row)
        return TrainingData(task, answers_per_sequence=dc.n_queries * dc.documents_per_row,
                            eval_batches=dc.eval_batches, **packing)
    if isinstance(dc, MemmapData):
        from ..data.memmap import MemmapTokens

        ds = MemmapTokens(dc.path, dc.seq_len, seed=dc.seed, documents=dc.packed)
        if ds.vocab_size > mc.vocab_size:
            raise ValueError(
                f"dataset {dc.path} has vocab_size {ds.vocab_size} > model.vocab_size "
                f"{mc.vocab_size}; set model.vocab_size={ds.vocab_size}"
            )
        return TrainingData(ds, **packing)
    raise ValueError(f"data config {dc!r} is none of RecallData, MemmapData; build it with "
                     f"one of them")


def decide_degrees(cfg, world: int, env=None) -> str:
    """Resolve the degrees once and write them into ``cfg.parallel`` as integers (ulysses,
    ring, dp); returns the plan table ("" when no degree was ``auto``).

    Afterwards ``resolve_degrees`` (so ``train``) passes them through without detection.
    """
    u, r, table = resolve_degrees(cfg, world, env)
    pc = cfg.parallel
    dp = check_degrees(world, u, r, _degree(pc.dp_degree, "dp_degree"))
    pc.ulysses_degree, pc.ring_degree, pc.dp_degree = u, r, dp
    return table


def check_run_dir(path: str | None) -> None:
    """Refuse a run directory this process could not create or write (checkpoints, metrics),
    before any rank starts. None: the CLI fills it in later (Hydra's run directory)."""
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


def check_run_masks(cfg) -> None:
    """Refuse document ids (``data.packing=documents``) or a sliding window the attention
    kernel and ring engine cannot apply (the rule is ``usp.masks.check_masks``'s)."""
    mc, pc = cfg.model, cfg.parallel
    window = next((w for w in map(mc.layer_window, range(mc.n_layers)) if w), None)
    ids = torch.zeros(1, 1, dtype=torch.long) if cfg.data.packed else None  # a stand-in
    try:
        check_masks(ids, window, batch=1, seq_len=1, device="cpu", kernel=pc.kernel,
                    ring_impl=pc.ring_impl)
    except ValueError as e:
        raise ValueError(f"data.packing={cfg.data.packing} model.sliding_window="
                         f"{mc.sliding_window} with parallel.kernel={pc.kernel} "
                         f"parallel.ring_impl={pc.ring_impl}: {e}") from None


def check_hf_model(mc: ModelConfig) -> None:
    """Refuse ``model.hf`` when transformers is missing, the built-in model's memory tiling
    (``loss_chunk``, ``mlp_tiles``), and a ``model.pretrained`` directory that is not a
    local model of ``mc``'s architecture and shape."""
    if mc.hf is None:
        return
    if mc.loss_chunk or mc.mlp_tiles != 1:
        raise ValueError(f"model.hf={mc.hf} computes its own LM head and MLP; model.loss_chunk="
                         f"{mc.loss_chunk} and model.mlp_tiles={mc.mlp_tiles} apply to the "
                         "built-in model only: set model.loss_chunk=0 model.mlp_tiles=1, or "
                         "unset model.hf")
    if not _installed("transformers"):
        raise ValueError(f"model.hf={mc.hf} needs the transformers package, which this Python "
                         "cannot import; pip install 'usp[hf]', or unset model.hf")
    if mc.pretrained is not None:
        from ..models.export import check_pretrained

        check_pretrained(mc)


def check_recompute(cfg, device_type: str) -> None:
    """Refuse activation offload off CUDA, and selective checkpoints or offload for a
    transformers model (it checkpoints every layer whole, with its own switch)."""
    tc = cfg.trainer
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


def resolve_a2a_chunks(cfg, world: int, ulysses: int, ring: int) -> int:
    """``parallel.a2a_chunks`` as an int: checked against the heads, or for ``auto`` the
    planner's choice (``best_a2a_chunks``) on the cluster spec; the same on every rank."""
    pc, m = cfg.parallel, cfg.model
    from ..ulysses import check_a2a_chunks

    if pc.a2a_chunks != "auto":
        check_a2a_chunks(pc.a2a_chunks, m.n_heads, m.n_kv_heads, ulysses)
        if pc.a2a_chunks > 1 and pc.ring_impl != "usp":
            raise ValueError(f"parallel.a2a_chunks={pc.a2a_chunks} pipelines usp's own ring; "
                             f"use parallel.ring_impl=usp or parallel.a2a_chunks=1")
        return pc.a2a_chunks
    if pc.ring_impl != "usp":
        return 1
    from ..planner.cost import best_a2a_chunks

    spec = cfg.cluster
    if pc.ranks_per_node:
        spec = spec.replace(ranks_per_node=pc.ranks_per_node, nodes=world // pc.ranks_per_node)
    dp = world // (ulysses * ring)
    return best_a2a_chunks(spec, cfg.data.seq_len, m.n_heads, m.n_kv_heads, m.head_dim,
                           ulysses, ring, dp=dp, dtype_bytes=cfg.trainer.compute_dtype.itemsize,
                           balance=pc.balance, placement=pc.placement,
                           n_fwd=2 if cfg.trainer.activation_checkpointing else 1)


def preflight(cfg, world: int, device_type: str | None = None) -> tuple[int, int]:
    """All checks that need no process group; raises ValueError. Returns (ulysses, ring).

    ``device_type`` is where the ranks will compute ("cpu" or "cuda", from
    ``usp.launch.choose_device``); None: cuda when this process sees a GPU.
    """
    u, r, _ = resolve_degrees(cfg, world)
    pc = cfg.parallel
    check_degrees(world, u, r, _degree(pc.dp_degree, "dp_degree"))
    check_ranks_per_node(world, pc.ranks_per_node, "parallel.ranks_per_node")
    check_placement(pc.placement)
    check_heads(cfg.model.n_heads, cfg.model.n_kv_heads, u)
    resolve_a2a_chunks(cfg, world, u, r)
    check_seq_len(cfg.data.seq_len, u, r, pc.balance)
    try:
        build_dataset(cfg.data, cfg.model)  # missing / corrupt data fails here
    except ValueError as e:
        raise ValueError(f"data.kind={cfg.data.kind}: {e}") from None
    check_run_dir(cfg.trainer.run_dir)
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    # the kernel and ring engine on this device, dtype and head dim (attention is causal)
    try:
        check_kernel(pc.kernel, device_type, cfg.trainer.compute_dtype, cfg.model.head_dim,
                     pc.ring_impl,
                     causal=True, balance=pc.balance)
    except ValueError as e:
        raise ValueError(f"parallel.kernel={pc.kernel} parallel.ring_impl={pc.ring_impl} "
                         f"trainer.dtype={cfg.trainer.dtype} on {device_type}: {e}") from None
    check_run_masks(cfg)
    check_hf_model(cfg.model)
    check_recompute(cfg, device_type)
    if pc.ring_impl == "ring_flash_attn" and not _installed("ring_flash_attn"):
        raise ValueError("parallel.ring_impl=ring_flash_attn needs the ring-flash-attn package, "
                         "which this Python cannot import; pip install ring-flash-attn==0.1.8 "
                         "flash-attn, or use parallel.ring_impl=usp")
    return u, r


def preflight_group(cfg, device_type: str, env=None) -> str:
    """``decide_degrees`` + ``preflight`` for ranks started by torchrun/Slurm (collective).

    Every process composed its own config and reads its own launcher variables and
    hardware, so only rank 0 resolves ``auto``; every rank writes rank 0's integers into
    ``cfg.parallel`` and runs ``preflight`` on them. A refusal on any rank is raised on
    every rank (none is left waiting in a collective). Returns rank 0's plan table.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    table, error = "", None
    if rank == 0:
        try:
            table = decide_degrees(cfg, world, env)
        except (ValueError, FileNotFoundError) as e:
            error = str(e)
    pc = cfg.parallel
    decided = [(pc.ulysses_degree, pc.ring_degree, pc.dp_degree, table, error)]
    dist.broadcast_object_list(decided, src=0)  # every rank now holds rank 0's decision
    u, r, dp, table, error = decided[0]
    if error is None:
        pc.ulysses_degree, pc.ring_degree, pc.dp_degree = u, r, dp
        try:
            preflight(cfg, world, device_type)
        except (ValueError, FileNotFoundError) as e:
            error = f"rank {rank}: {e}"
    errors = [None] * world
    dist.all_gather_object(errors, error)
    refused = [e for e in errors if e is not None]
    if refused:
        raise ValueError(refused[0])
    return table
