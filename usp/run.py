"""The run's layout, resolved once: ``RunLayout``.

Before any process group exists, ``resolve_run`` turns the config and the launcher's world
into one frozen ``RunLayout``: dp x ring x ulysses, placement, ranks per node, the
all-to-all pipeline stages, device, dtype and per-rank batch. It runs every rule that needs
the world size, the device or the file system (the config dataclasses check plain values
themselves), one message per rule, and raises ``ValueError`` before anything starts.

- Local spawn: the launching process resolves once and hands the layout to every rank.
- torchrun / Slurm (``usp-train``): before any process group rank 0 resolves for the
  launch's world and every other task checks its own config against that layout
  (``check_task``), the verdicts exchanged in the rendezvous store
  (``usp.launch.decide_together``): a layout that cannot fit is refused in a second.
- A library caller inside an existing group: ``resolve_run_group`` lets rank 0 resolve
  (only it runs topology detection for ``auto`` degrees), broadcasts the layout, and every
  task checks what is its own (data files, run directory, kernel on its device).

The mesh, the model and the trainer take the layout; nothing downstream reads the degree,
placement or chunk fields of ``cfg.parallel`` again (``tests/unit/test_run_layout.py``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from functools import cache, partial
from pathlib import Path

import torch
import torch.distributed as dist

from .config import ModelConfig, PlanConfig, RunConfig
from .data.dataset import build_dataset, build_validation
from .masks import check_masks
from .mesh import SPMesh
from .models.export import check_pretrained
from .planner import CheckpointPolicy, Plan, detect_topology, draw_mesh, plan
from .planner.cost import choose_a2a_chunks
from .planner.memory import size
from .validate import check_degrees, check_kernel, check_placement, check_ranks_per_node, check_seq_len
from .dims.heads import check_heads


@dataclass(frozen=True)
class RunLayout:
    """How one run is laid out on its ranks; the same object on every rank.

    ``world`` = ``dp * ring * ulysses`` ranks; ``a2a_chunks``: pipeline stages of the
    ulysses all-to-alls; ``device``: "cpu" or "cuda"; ``dtype``: ``trainer.dtype``;
    ``plan_table``: the planner's ranking when a degree was ``auto`` (else "").
    """

    world: int
    dp: int
    ring: int
    ulysses: int
    placement: str
    ranks_per_node: int | None
    balance: str
    kernel: str
    ring_impl: str
    a2a_chunks: int
    device: str
    dtype: str
    seq_len: int
    batch_per_dp_rank: int
    plan_table: str = ""
    grad_accum: int = 1  # micro-batches per optimizer step


    def __post_init__(self) -> None:
        if check_degrees(self.world, self.ulysses, self.ring, self.dp) != self.dp:
            raise ValueError(f"dp {self.dp} x ring {self.ring} x ulysses {self.ulysses} != "
                             f"world {self.world}")
        check_placement(self.placement)
        check_ranks_per_node(self.world, self.ranks_per_node, "parallel.ranks_per_node")

    @property
    def sp(self) -> int:
        """Ranks that share one sequence: ring x ulysses."""
        return self.ring * self.ulysses

    @property
    def micro_batch(self) -> int:
        """Sequences per micro-batch over all dp ranks."""
        return self.batch_per_dp_rank * self.dp

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step: every micro-batch of every dp rank."""
        return self.micro_batch * self.grad_accum

    def samples(self, consumed: int, micro: int, dp_rank: int) -> range:
        """Global sample ids of ``dp_rank``'s micro-batch ``micro`` of the optimizer step
        that starts after ``consumed`` samples: micro-batch k of the step takes its samples
        ``[k * micro_batch, (k + 1) * micro_batch)`` and each dp rank its own
        ``batch_per_dp_rank`` of them. With one micro-batch this is ``sample_indices``."""
        first = consumed + micro * self.micro_batch + dp_rank * self.batch_per_dp_rank
        return range(first, first + self.batch_per_dp_rank)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def build_mesh(self) -> SPMesh:
        """This layout's ``SPMesh`` (collective: every rank of the default group calls it)."""
        return SPMesh.build(ulysses=self.ulysses, ring=self.ring, dp=self.dp,
                            placement=self.placement, ranks_per_node=self.ranks_per_node,
                            a2a_chunks=self.a2a_chunks)

    def attention_options(self) -> dict:
        """``usp_attention``'s keywords that the run decides (mesh and layout aside; the
        a2a stages travel in the mesh, ``build_mesh``)."""
        return dict(kernel=self.kernel, ring_impl=self.ring_impl)


# ---- degrees and stages ------------------------------------------------------------------


def _degree(value, name: str) -> int | None:
    """An int degree, or None for ``auto`` / unset."""
    if value is None or value == "auto":
        return None
    try:
        v = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"parallel.{name} must be an integer or 'auto', got {value!r}") from None
    if v < 1:
        raise ValueError(f"parallel.{name} must be >= 1, got {v}")
    return v


def plan_run(cfg: RunConfig | PlanConfig, spec, world: int) -> Plan:
    """The planner's ranking (``usp.planner.Plan``) of the layouts of ``world`` ranks on
    ``spec`` for this run: its model, sequence, balance, placement, fixed degrees,
    ``trainer.dtype``, checkpoint policy and kernel. Every dp the planner considers runs
    ``batch_per_dp_rank`` sequences per dp rank, as the trainer does."""
    pc = cfg.parallel
    return plan(cfg.model, spec, cfg.data.seq_len, world=world, balance=pc.balance,
                ulysses=_degree(pc.ulysses_degree, "ulysses_degree"),
                ring=_degree(pc.ring_degree, "ring_degree"), dp=_degree(pc.dp_degree, "dp_degree"),
                batch_per_dp_rank=cfg.data.batch_per_dp_rank, placement=pc.placement,
                dtype_bytes=cfg.trainer.compute_dtype.itemsize, a2a_chunks=pc.a2a_chunks,
                checkpoint=CheckpointPolicy.from_trainer(cfg.trainer), kernel=pc.kernel,
                device="cpu" if cfg.trainer.device == "cpu" else "cuda")


def plan_report(cfg: PlanConfig) -> tuple[str, str]:
    """usp-plan's answer: (the ranking, the memory split and the chosen mesh as text, the
    mesh drawing's object for an optional PNG)."""
    spec = cfg.cluster if cfg.nodes is None else cfg.cluster.replace(nodes=cfg.nodes)
    p = plan_run(cfg, spec, spec.world)
    best = p.best
    drawing = draw_mesh(best.dp, best.ring, best.ulysses, spec.ranks_per_node,
                        cfg.parallel.placement)
    text = "\n".join([p.format_table(),
                      f"choice: dp {best.dp} x ring {best.ring} x ulysses {best.ulysses}",
                      global_batch_text(cfg, p), p.memory_text(), str(drawing)])
    return text, drawing


def global_batch_text(cfg: RunConfig, p: Plan) -> str:
    """The optimizer step's batch on the plan's choice, in sequences and tokens; given
    ``trainer.global_batch_tokens``, also the per-rank batch and accumulation that fit
    memory (``Plan.batch_for_tokens``)."""
    best, L, b = p.best, cfg.data.seq_len, cfg.data.batch_per_dp_rank
    tc = cfg.trainer
    try:
        k = grad_accum_steps(tc, L, b, best.dp)
        line = (f"global batch: {b * best.dp * k} sequences = {b * best.dp * k * L} tokens per "
                f"optimizer step (batch_per_dp_rank {b} x dp {best.dp} x grad_accum_steps {k})")
    except ValueError as e:
        line = f"global batch: {e}"
    if tc.global_batch_tokens is None:
        return line
    try:
        fit_b, fit_k, peak = p.batch_for_tokens(tc.global_batch_tokens)
        line += (f"\nfor trainer.global_batch_tokens={tc.global_batch_tokens}: the largest "
                 f"per-rank batch that fits is data.batch_per_dp_rank={fit_b} with "
                 f"trainer.grad_accum_steps={fit_k} (peak {size(peak)} per rank)")
    except ValueError as e:
        line += f"\nfor trainer.global_batch_tokens={tc.global_batch_tokens}: {e}"
    return line


def _simulated_nodes(spec, ranks_per_node: int | None, world: int):
    """``spec`` as nodes of ``parallel.ranks_per_node`` ranks (simulated on one machine),
    or unchanged when that is unset."""
    if not ranks_per_node:
        return spec
    return spec.replace(ranks_per_node=ranks_per_node, nodes=world // ranks_per_node)


def _cluster(cfg: RunConfig, world: int, env=None):
    """The cluster spec the planner sees: the config's, sized to ``world``, with the
    topology the launcher and this machine report (``detect_topology``)."""
    pc = cfg.parallel
    spec, report = detect_topology(os.environ if env is None else env, spec=cfg.cluster)
    if pc.ranks_per_node:
        spec = _simulated_nodes(spec, pc.ranks_per_node, world)
    elif spec.world != world:
        spec = spec.replace(nodes=max(1, world // spec.ranks_per_node))
    return spec, report


def decide_degrees(cfg: RunConfig, world: int, env=None,
                   topology=None) -> tuple[int, int, int, str]:
    """(ulysses, ring, dp, plan table or ""): fixed degrees pass through; ``auto`` asks the
    planner on the detected cluster (``topology()``: ``_cluster``'s answer, default
    detected here from ``env``)."""
    pc = cfg.parallel
    u, r = _degree(pc.ulysses_degree, "ulysses_degree"), _degree(pc.ring_degree, "ring_degree")
    table = ""
    if u is None or r is None:
        spec, report = topology() if topology else _cluster(cfg, world, env)
        p = plan_run(cfg, spec, world)
        u, r = p.best.ulysses, p.best.ring
        table = f"{report.line()}\n{p.format_table(show_dropped=False)}"
    dp = check_degrees(world, u, r, _degree(pc.dp_degree, "dp_degree"))
    return u, r, dp, table


def _a2a_chunks(cfg: RunConfig, world: int, ulysses: int, ring: int, dp: int,
                topology) -> int:
    """``parallel.a2a_chunks`` as an int, by the planner's rule (``choose_a2a_chunks``: an
    int checked against the heads; ``auto``: 1 when the ulysses group stays inside a node,
    else priced on the spec). The nodes: ``parallel.ranks_per_node`` (simulated), else what
    the launcher or the hardware reports; when nothing reports nodes, the ranks are this
    launch's processes on one host, as ``SPMesh`` will find them. usp's own ring only.
    ``topology()``: ``_cluster``'s answer, asked only when ``auto`` needs it."""
    pc, m = cfg.parallel, cfg.model
    if pc.ring_impl != "usp":
        if pc.a2a_chunks == "auto":
            return 1
        if pc.a2a_chunks > 1:
            raise ValueError(f"parallel.a2a_chunks={pc.a2a_chunks} pipelines usp's own ring; "
                             f"use parallel.ring_impl=usp or parallel.a2a_chunks=1")
    if pc.a2a_chunks == "auto" and ulysses == 1:
        return 1  # no all-to-all to pipeline: nothing to detect
    spec = cfg.cluster
    if pc.a2a_chunks == "auto":
        spec, report = topology()
        if not pc.ranks_per_node and "ranks_per_node" not in report.detected:
            spec = spec.replace(ranks_per_node=world, nodes=1)  # local processes, one host
    return choose_a2a_chunks(pc.a2a_chunks, spec, cfg.data.seq_len, m.n_heads, m.n_kv_heads,
                             m.head_dim, ulysses, ring, dp=dp,
                             dtype_bytes=cfg.trainer.compute_dtype.itemsize,
                             balance=pc.balance, placement=pc.placement,
                             n_fwd=2 if cfg.trainer.activation_checkpointing else 1)


def grad_accum_steps(tc, seq_len: int, batch_per_dp_rank: int, dp: int) -> int:
    """Micro-batches per optimizer step: ``trainer.global_batch_tokens`` T / (seq_len x
    batch_per_dp_rank x dp) when T is set (refused unless whole, with the nearest valid T,
    and refused beside a different ``trainer.grad_accum_steps``), else
    ``trainer.grad_accum_steps`` (default 1)."""
    if tc.global_batch_tokens is None:
        return tc.grad_accum_steps or 1
    micro = seq_len * batch_per_dp_rank * dp  # tokens of one micro-batch over all dp ranks
    k, rest = divmod(tc.global_batch_tokens, micro)
    if rest or not k:
        lo, hi = max(1, k) * micro, (k + 1) * micro
        near = f"{lo} (grad_accum_steps {max(1, k)})" + (
            f" or {hi} (grad_accum_steps {k + 1})" if k else "")
        raise ValueError(
            f"trainer.global_batch_tokens={tc.global_batch_tokens} is not a whole number of "
            f"micro-batches of data.seq_len {seq_len} x data.batch_per_dp_rank "
            f"{batch_per_dp_rank} x dp {dp} = {micro} tokens; the nearest valid values: {near}")
    if tc.grad_accum_steps is not None and tc.grad_accum_steps != k:
        raise ValueError(
            f"trainer.global_batch_tokens={tc.global_batch_tokens} means grad_accum_steps {k} "
            f"at data.seq_len {seq_len} x data.batch_per_dp_rank {batch_per_dp_rank} x dp {dp}, "
            f"but trainer.grad_accum_steps={tc.grad_accum_steps}; set one of the two")
    return k


# ---- the resolver ------------------------------------------------------------------------


def resolve_run(cfg: RunConfig, world: int, device_type: str | None = None,
                env=None) -> RunLayout:
    """The run's layout for ``world`` ranks computing on ``device_type`` ("cpu" or "cuda";
    None: cuda when this process sees a GPU), after every rule; raises ``ValueError``.

    ``env``: the launcher's variables for topology detection (default ``os.environ``),
    read when a degree or ``parallel.a2a_chunks`` is ``auto`` (the latter by default)."""
    pc = cfg.parallel
    topology = cache(partial(_cluster, cfg, world, env))  # detected at most once, if asked
    u, r, dp, table = decide_degrees(cfg, world, env, topology)
    check_ranks_per_node(world, pc.ranks_per_node, "parallel.ranks_per_node")
    check_placement(pc.placement)
    check_heads(cfg.model.n_heads, cfg.model.n_kv_heads, u)
    chunks = _a2a_chunks(cfg, world, u, r, dp, topology)  # check_task checks the sequence
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    accum = grad_accum_steps(cfg.trainer, cfg.data.seq_len, cfg.data.batch_per_dp_rank, dp)
    layout = RunLayout(world=world, dp=dp, ring=r, ulysses=u, placement=pc.placement,
                       ranks_per_node=pc.ranks_per_node, balance=pc.balance, kernel=pc.kernel,
                       ring_impl=pc.ring_impl, a2a_chunks=chunks, device=device_type,
                       dtype=cfg.trainer.dtype, seq_len=cfg.data.seq_len,
                       batch_per_dp_rank=cfg.data.batch_per_dp_rank, plan_table=table,
                       grad_accum=accum)
    check_task(cfg, layout)
    return layout


def check_task(cfg: RunConfig, layout: RunLayout) -> None:
    """The rules each task checks on its own config against the layout: its heads and
    sequence on these degrees, its data files, its run directory, the kernel on its
    device, its installed packages."""
    check_heads(cfg.model.n_heads, cfg.model.n_kv_heads, layout.ulysses)
    check_seq_len(cfg.data.seq_len, layout.ulysses, layout.ring, layout.balance)
    try:
        build_dataset(cfg.data, cfg.model)  # missing / corrupt data fails here
        build_validation(cfg.data, cfg.model, cfg.trainer.eval_windows)
    except ValueError as e:
        raise ValueError(f"data.kind={cfg.data.kind}: {e}") from None
    check_run_dir(cfg.trainer.run_dir)
    # the kernel and ring engine on this device, dtype and head dim (attention is causal)
    try:
        check_kernel(layout.kernel, layout.device, cfg.trainer.compute_dtype,
                     cfg.model.head_dim, layout.ring_impl, causal=True, balance=layout.balance)
    except ValueError as e:
        raise ValueError(f"parallel.kernel={layout.kernel} parallel.ring_impl="
                         f"{layout.ring_impl} trainer.dtype={cfg.trainer.dtype} on "
                         f"{layout.device}: {e}") from None
    check_run_masks(cfg)
    check_hf_model(cfg.model)
    check_recompute(cfg, layout.device)
    if layout.ring_impl == "ring_flash_attn" and not _installed("ring_flash_attn"):
        raise ValueError("parallel.ring_impl=ring_flash_attn needs the ring-flash-attn package, "
                         "which this Python cannot import; pip install ring-flash-attn==0.1.8 "
                         "flash-attn, or use parallel.ring_impl=usp")


def resolve_run_group(cfg: RunConfig, device_type: str, env=None) -> RunLayout:
    """``resolve_run`` for ranks started by torchrun/Slurm (collective).

    Rank 0 resolves (and alone reads its launcher variables and hardware for ``auto``);
    every rank receives rank 0's layout and checks its own task (``check_task``). A refusal
    on any rank is raised on every rank (none is left waiting in a collective)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    layout, error = None, None
    if rank == 0:
        try:
            layout = resolve_run(cfg, world, device_type, env)
        except (ValueError, FileNotFoundError) as e:
            error = str(e)
    decided = [(layout, error)]
    dist.broadcast_object_list(decided, src=0)  # every rank now holds rank 0's decision
    layout, error = decided[0]
    if error is None and rank != 0:
        try:
            check_task(cfg, layout)
        except (ValueError, FileNotFoundError) as e:
            error = f"rank {rank}: {e}"
    errors = [None] * world
    dist.all_gather_object(errors, error)
    refused = [e for e in errors if e is not None]
    if refused:
        raise ValueError(refused[0])
    return layout


def use_scheduler_hosts(cfg: RunConfig, placement: str) -> str | None:
    """Under a scheduler (Slurm) the job's real hosts place the ranks: a configured
    ``parallel.ranks_per_node`` (a recipe's simulated nodes, e.g. ``tiny_cpu``) is dropped.
    Returns the line that says so, or None when none was set."""
    if not cfg.parallel.ranks_per_node:
        return None
    dropped, cfg.parallel.ranks_per_node = cfg.parallel.ranks_per_node, None
    return (f"parallel.ranks_per_node={dropped} ignored under Slurm: the mesh uses the job's "
            f"hosts ({placement})")


# ---- task rules --------------------------------------------------------------------------


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


def check_run_masks(cfg: RunConfig) -> None:
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
        check_pretrained(mc)


def check_recompute(cfg: RunConfig, device_type: str) -> None:
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
