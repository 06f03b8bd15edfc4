"""What a run decides before training: degrees (``auto`` via the planner), data, checks.

``preflight`` runs in the launching process, before any process group exists, so a bad
layout or a missing data file is refused with a clear message and nothing is spawned.
"""

from __future__ import annotations

import os

import torch

from ..config import DataConfig, ModelConfig
from ..validate import check_degrees, check_heads, check_placement, check_seq_len


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


def resolve_degrees(cfg, world: int, env=None) -> tuple[int, int, str]:
    """(ulysses, ring, plan table or ""): fixed degrees pass through; ``auto`` asks the planner."""
    pc = cfg.parallel
    u, r = _degree(pc.ulysses_degree, "ulysses_degree"), _degree(pc.ring_degree, "ring_degree")
    dp = _degree(pc.dp_degree, "dp_degree")
    if u is not None and r is not None:
        return u, r, ""
    from ..planner import detect_topology, plan

    spec, report = detect_topology(os.environ if env is None else env, spec=cfg.cluster)
    if pc.simulate_ranks_per_node:
        spec = spec.replace(gpus_per_node=pc.simulate_ranks_per_node,
                            nodes=world // pc.simulate_ranks_per_node)
    elif spec.world != world:
        spec = spec.replace(nodes=max(1, world // spec.gpus_per_node))
    p = plan(cfg.model, spec, cfg.data.seq_len, world=world, balance=pc.balance,
             ulysses=u, ring=r, dp=dp, global_batch=cfg.data.batch_size * (dp or 1),
             placement=pc.placement, dtype_bytes=2 if cfg.trainer.dtype == "bf16" else 4)
    best = p.best
    table = f"{report.line()}\n{p.format_table(show_dropped=False)}"
    return best.ulysses, best.ring, table


class _Sharded:
    """Gives every dataset the trainer's interface: this rank's columns, answer accuracy."""

    def __init__(self, source, has_answers: bool):
        self.source, self.has_answers = source, has_answers

    def batch(self, step, batch_size, dp_rank, dp_size, positions):
        """This rank's (tokens, labels), each [B, L/P]; labels shifted on the global sequence."""
        return self.source.batch(step, batch_size, dp_rank, dp_size, positions=positions)

    def answer_accuracy(self, logits, labels) -> tuple[int, int]:
        """(correct answers, answers) on this rank's shard; (0, 0) for plain text."""
        if not self.has_answers:
            return 0, 0
        from ..data.synthetic import answer_accuracy

        correct, answers = answer_accuracy(logits, labels)
        return int(correct), int(answers)


def build_dataset(dc: DataConfig, mc: ModelConfig) -> _Sharded:
    if dc.kind == "recall":
        from ..data.synthetic import RecallTask

        task = RecallTask(vocab_size=mc.vocab_size, seq_len=dc.seq_len, n_pairs=dc.n_pairs,
                          n_queries=dc.n_queries, seed=dc.seed)
        return _Sharded(task, has_answers=True)
    if dc.kind == "memmap":
        from ..data.memmap import MemmapTokens

        if not dc.path:
            raise ValueError("data.kind=memmap needs data.path (prefix of the .bin/.json files)")
        ds = MemmapTokens(dc.path, dc.seq_len, seed=dc.seed)
        if ds.vocab_size > mc.vocab_size:
            raise ValueError(
                f"dataset {dc.path} has vocab_size {ds.vocab_size} > model.vocab_size "
                f"{mc.vocab_size}; set model.vocab_size={ds.vocab_size}"
            )
        return _Sharded(ds, has_answers=False)
    raise ValueError(f"data.kind must be recall or memmap, got {dc.kind!r}")


def preflight(cfg, world: int) -> tuple[int, int]:
    """All checks that need no process group; raises ValueError. Returns (ulysses, ring)."""
    u, r, _ = resolve_degrees(cfg, world)
    pc = cfg.parallel
    check_degrees(world, u, r, _degree(pc.dp_degree, "dp_degree"))
    check_placement(pc.placement)
    check_heads(cfg.model.n_heads, cfg.model.n_kv_heads, u)
    check_seq_len(cfg.data.seq_len, u, r, pc.balance)
    if cfg.trainer.dtype not in ("fp32", "bf16"):
        raise ValueError(f"trainer.dtype must be fp32 or bf16, got {cfg.trainer.dtype!r}")
    build_dataset(cfg.data, cfg.model)  # missing / corrupt data fails here
    if cfg.parallel.kernel == "flash_attn" and not torch.cuda.is_available():
        raise ValueError("parallel.kernel=flash_attn needs CUDA; use parallel.kernel=torch")
    return u, r
