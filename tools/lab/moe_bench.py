"""A mixture of experts' training step at several expert degrees on the simulated 2-node x
2-rank cluster, beside the planner's prediction of each.

Every row is a real ``usp-train`` run (``python -m usp.cli``) of the built-in Qwen3-MoE from
scratch (``model.arch=qwen3_moe``, no checkpoint: the shape is stated by the ``model.*``
options) at (``ulysses``, ``ring``), dp 1, with ``parallel.expert_degree`` N: fwd + bwd +
router loss + clip + AdamW, FSDP2 over the 4 ranks. The runs share one ``SimCluster`` and
take turns: pass 0 runs the degrees in order, pass 1 reversed, and so on, so that a drift of
the box's load hits every degree alike. A run's figure is the median ``step_s`` of its
``metrics.jsonl`` after ``skip`` steps; a degree's, the lowest of its passes' medians; the
ratio to degree 1 is also taken pass by pass (the degree's run against degree 1's in the
same pass), median and range reported.

The prediction is ``usp.planner.cost.estimate`` with ``expert_degree=N`` on the spec of the
nominal tc rates (``tools.lab.train_table.nominal_spec``: ``cpu_local`` with the shaped
links, 2 nodes x 2 ranks sharing a veth and a loopback); the planner's own pick is
``usp.run.decide.decide_expert_degree`` (``parallel.expert_degree=auto``) on that spec.

``prepare`` (no root, no processes) checks the settings and prices the degrees; ``run``
(root) starts the cluster and the runs and writes ``OUT/results.json`` and ``OUT/table.txt``;
``summarize`` and ``report`` turn the runs' figures into the table.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

from usp.config import ModelConfig, RunConfig
from usp.config.cluster import ClusterSpec
from usp.config.data import RecallData
from usp.config.parallel import ParallelConfig
from usp.planner.cost import StepCost, estimate
from usp.rules import check_expert_degree, check_seq_len
from usp.run.decide import decide_expert_degree

from .cluster_bench import NODES, PER_NODE, WORLD
from .cluster_report import table
from .simcluster import SimCluster, rate_to_bytes_per_s, say
from .train_table import nominal_spec


@dataclass(frozen=True)
class MoeBench:
    """The benchmark's settings. Links: ``rate`` between nodes, ``intra_rate`` shaped
    loopback (None: unshaped), ``queue_ms`` per shaped link (``SimCluster``). Model: the
    built-in Qwen3-MoE (q/k norms), ``dim``, ``n_heads`` / ``n_kv_heads``, ``n_layers``, every
    layer sparse with ``n_experts`` experts of width ``expert_ffn_dim``, ``experts_per_token``
    a token, top-k probabilities renormalised; fp32, no activation checkpointing. Data: the
    synthetic recall task, ``batch`` sequences of ``seq_len``. Layout: (``ulysses``,
    ``ring``), dp 1; ``degrees`` the expert degrees timed; ``passes`` runs of ``steps`` steps
    per degree, the first ``skip`` steps of each dropped."""

    out: str = "runs/bench_moe"
    rate: str = "300mbit"
    intra_rate: str | None = "2700mbit"
    queue_ms: float = 30.0
    dim: int = 256
    n_heads: int = 8
    n_kv_heads: int = 2
    n_layers: int = 4
    n_experts: int = 8
    experts_per_token: int = 2
    expert_ffn_dim: int = 512
    vocab_size: int = 320
    seq_len: int = 4096
    batch: int = 1
    ulysses: int = 2
    ring: int = 2
    degrees: tuple = (1, 2, 4)
    steps: int = 6
    skip: int = 2
    passes: int = 3
    seed: int = 0
    timeout: float = 600.0

    def __post_init__(self):
        object.__setattr__(self, "degrees", tuple(self.degrees))
        low = {k: getattr(self, k) for k, lo in (("batch", 1), ("passes", 1), ("skip", 1),
                                                   ("seq_len", 1)) if getattr(self, k) < lo}
        if low or self.steps <= self.skip:
            raise ValueError(f"need batch, passes, skip >= 1 and steps > skip (the first skip "
                             f"steps are dropped), got {low or dict(steps=self.steps)}; e.g. "
                             f"steps 6, skip 2")
        for name in ("queue_ms", "timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if "auto" in (self.rate, self.intra_rate):
            raise ValueError("rates must be tc rates (e.g. 300mbit), not auto: the planner's "
                             "spec is made of the nominal rates")
        for r in (self.rate, self.intra_rate):
            if r is not None:
                rate_to_bytes_per_s(r)  # a bad rate raises
        if self.ulysses * self.ring != WORLD:
            raise ValueError(f"ulysses {self.ulysses} x ring {self.ring} must be the {WORLD} "
                             f"ranks of the {NODES} x {PER_NODE} cluster (dp 1); e.g. 2 x 2")
        if 1 not in self.degrees or len(set(self.degrees)) != len(self.degrees):
            raise ValueError(f"degrees {list(self.degrees)} must hold 1 (the ratios' base) and "
                             "no degree twice; e.g. 1,2,4")
        for d in self.degrees:
            check_expert_degree(d, WORLD, self.n_experts, None)
        self.model  # ModelConfig's shape rules raise here
        check_seq_len(self.seq_len, self.ulysses, self.ring, "zigzag")

    @property
    def model(self) -> ModelConfig:
        return ModelConfig(vocab_size=self.vocab_size, dim=self.dim, n_layers=self.n_layers,
                           n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, qk_norm=True,
                           arch="qwen3_moe", n_experts=self.n_experts,
                           experts_per_token=self.experts_per_token,
                           expert_ffn_dim=self.expert_ffn_dim, norm_topk_prob=True)

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq_len

    def overrides(self, degree: int, run_dir: Path) -> list[str]:
        """The ``usp-train`` command line (after ``-m usp.cli``) of the run at ``degree``."""
        m = self.model
        return ["model.arch=qwen3_moe", "model.qk_norm=true", f"model.dim={m.dim}",
                f"model.n_layers={m.n_layers}", f"model.n_heads={m.n_heads}",
                f"model.n_kv_heads={m.n_kv_heads}", f"model.vocab_size={m.vocab_size}",
                f"model.n_experts={m.n_experts}",
                f"model.experts_per_token={m.experts_per_token}",
                f"model.expert_ffn_dim={m.expert_ffn_dim}", "model.norm_topk_prob=true",
                f"parallel.ulysses_degree={self.ulysses}", f"parallel.ring_degree={self.ring}",
                "parallel.dp_degree=1", f"parallel.expert_degree={degree}",
                "parallel.ranks_per_node=null", f"data.seq_len={self.seq_len}",
                f"data.batch_per_dp_rank={self.batch}", f"trainer.steps={self.steps}",
                f"trainer.seed={self.seed}", "trainer.dtype=fp32",
                "trainer.activation_checkpointing=false", "data.eval_batches=0",
                "logging.wandb=disabled", "logging.plot=false", "logging.progress=false",
                f"trainer.run_dir={run_dir}", f"hydra.run.dir={run_dir}",
                "trainer.resume=false"]


def order(degrees, passes: int) -> list[tuple[int, int]]:
    """[(pass, degree)] in run order: the degrees forward on even passes, reversed on odd."""
    return [(p, d) for p in range(passes) for d in (degrees if p % 2 == 0 else degrees[::-1])]


def run_figures(metrics_text: str, skip: int) -> dict:
    """A run's figures from its ``metrics.jsonl``: the steps' ``step_s`` after the first
    ``skip`` and their median, with the median ``attn_comm_share``, the last ``loss``,
    ``aux_loss`` and ``expert_load``. ValueError when no step is left."""
    rows = [json.loads(x) for x in metrics_text.splitlines() if x.strip()]
    steps = [r for r in rows if "step_s" in r]
    kept = steps[skip:]
    if not kept:
        raise ValueError(f"metrics.jsonl holds {len(steps)} steps, none after the first {skip}")
    last = kept[-1]
    return dict(step_s=[r["step_s"] for r in kept],
                median_s=statistics.median(r["step_s"] for r in kept),
                attn_comm_share=statistics.median(r.get("attn_comm_share", 0.0) for r in kept),
                loss=last.get("loss"), aux_loss=last.get("aux_loss"),
                expert_load=last.get("expert_load"))


def predictions(cfg: MoeBench, spec: ClusterSpec) -> dict[int, StepCost]:
    """{degree: the planner's ``StepCost``} of one step (fp32, no recompute, zigzag)."""
    return {d: estimate(cfg.model, spec, cfg.seq_len, 1, cfg.ring, cfg.ulysses,
                        global_batch=cfg.batch, dtype_bytes=4, act_checkpoint=False,
                        balance="zigzag", placement="ulysses_inner", expert_degree=d)
            for d in cfg.degrees}


def planner_pick(cfg: MoeBench, spec: ClusterSpec) -> int:
    """The expert degree ``parallel.expert_degree=auto`` resolves to on ``spec``."""
    run_cfg = RunConfig(model=cfg.model, cluster=spec,
                        parallel=ParallelConfig(ulysses_degree=cfg.ulysses, ring_degree=cfg.ring,
                                                dp_degree=1, expert_degree="auto"),
                        data=RecallData(seq_len=cfg.seq_len, batch_per_dp_rank=cfg.batch))
    return decide_expert_degree(run_cfg, WORLD, cfg.ulysses, cfg.ring, 1,
                                topology=lambda: (spec, None), balance="zigzag")


@dataclass(frozen=True)
class Prepared:
    """What ``prepare`` decided: the spec, the predictions and the planner's pick."""

    cfg: MoeBench
    spec: ClusterSpec
    predicted: dict
    pick: int


def prepare(cfg: MoeBench) -> Prepared:
    """Every check and the planner's figures before a namespace exists (ValueError)."""
    spec = nominal_spec(cfg)  # reads cfg.rate and cfg.intra_rate
    return Prepared(cfg, spec, predictions(cfg, spec), planner_pick(cfg, spec))


def summarize(p: Prepared, runs: dict) -> dict:
    """The table's figures from ``runs`` = {degree: [``run_figures`` of each pass]}: per
    degree the lowest pass median, tokens/s, the ratio of tokens/s to degree 1's (of the
    lowest medians, and pass by pass: median, min, max), and the planner's step and ratio."""
    base = min(r["median_s"] for r in runs[1])
    base_pred = p.predicted[1].step_s
    rows = []
    for d in p.cfg.degrees:
        best = min(r["median_s"] for r in runs[d])
        paired = [b["median_s"] / r["median_s"] for r, b in zip(runs[d], runs[1])]
        pred = p.predicted[d]
        rows.append(dict(degree=d, pass_median_s=[r["median_s"] for r in runs[d]],
                         median_s=best, tokens_per_s=p.cfg.tokens_per_step / best,
                         vs_1=base / best, vs_1_paired=statistics.median(paired),
                         vs_1_paired_range=[min(paired), max(paired)],
                         attn_comm_share=statistics.median(r["attn_comm_share"]
                                                           for r in runs[d]),
                         expert_load=[r["expert_load"] for r in runs[d]],
                         loss=[r["loss"] for r in runs[d]],
                         predicted_s=pred.step_s, predicted_vs_1=base_pred / pred.step_s,
                         predicted_over_measured=pred.step_s / best,
                         predicted_expert_a2a_s=pred.expert_a2a_s, expert_link=pred.expert_link,
                         predicted_expert_a2a_bytes=pred.expert_a2a_bytes))
    return dict(rows=rows, pick=p.pick)


def report(p: Prepared, summary: dict) -> list[str]:
    """The printed table and the lines around it."""
    c, m = p.cfg, p.cfg.model
    lines = table(
        f"usp-train step (fwd+bwd+clip+AdamW, FSDP over 4 ranks), {NODES} nodes x "
        f"{PER_NODE} ranks, inter-node {c.rate}, intra-node {c.intra_rate or 'loopback'}, "
        f"queue {c.queue_ms:g} ms; Qwen3-MoE dim {m.dim} Hq {m.n_heads} Hkv {m.n_kv_heads} "
        f"layers {m.n_layers} (all sparse), {m.n_experts} experts of {m.expert_ffn_dim}, "
        f"top-{m.experts_per_token}, vocab {m.vocab_size}, fp32; L={c.seq_len} batch "
        f"{c.batch}; (u,r)=({c.ulysses},{c.ring}) dp 1; {c.passes} passes in alternating "
        f"order, {c.steps} steps a run, first {c.skip} dropped",
        ["expert degree", "expert link", "tokens/s", "step ms", "vs 1", "vs 1 paired (range)",
         "pass medians ms", "planner ms", "planner vs 1", "planner expert a2a ms",
         "planner/measured", "expert load"],
        [[r["degree"], r["expert_link"], f"{r['tokens_per_s']:.0f}",
          f"{r['median_s'] * 1e3:.0f}", f"{r['vs_1']:.2f}",
          f"{r['vs_1_paired']:.2f} ({r['vs_1_paired_range'][0]:.2f}-"
          f"{r['vs_1_paired_range'][1]:.2f})",
          "/".join(f"{x * 1e3:.0f}" for x in r["pass_median_s"]),
          f"{r['predicted_s'] * 1e3:.0f}", f"{r['predicted_vs_1']:.2f}",
          f"{r['predicted_expert_a2a_s'] * 1e3:.0f}", f"{r['predicted_over_measured']:.2f}",
          f"{max(r['expert_load']):.2f}"]
         for r in summary["rows"]])
    lines.append(f"planner: usp.planner.cost.estimate on {p.spec.name} (cpu_local's compute); "
                 f"parallel.expert_degree=auto picks {summary['pick']}")
    lines.append("expert load: the busiest expert's token assignments over the mean, the "
                 "largest over the sparse layers, at a run's last step (1: even; the planner "
                 "assumes even routing)")
    return lines


def report_saved(p: Prepared) -> tuple[dict, list[str]]:
    """``summarize`` and ``report`` again from ``OUT/results.json``'s runs."""
    saved = json.loads((Path(p.cfg.out) / "results.json").read_text())
    summary = summarize(p, {int(d): r for d, r in saved["runs"].items()})
    return summary, report(p, summary)


def plan_lines(p: Prepared) -> list[str]:
    """The planner's figures alone (no cluster): ``--plan-only``."""
    c = p.cfg
    base = p.predicted[1].step_s
    lines = table(f"planner only ({p.spec.name}), L={c.seq_len}, (u,r)=({c.ulysses},{c.ring})",
                  ["expert degree", "expert link", "step ms", "vs 1", "compute ms",
                   "weight sync ms (exposed)", "expert a2a ms", "expert a2a MiB/seq"],
                  [[d, s.expert_link, f"{s.step_s * 1e3:.0f}", f"{base / s.step_s:.2f}",
                    f"{s.compute_s * 1e3:.0f}",
                    f"{s.grad_s * 1e3:.0f} ({s.grad_exposed_s * 1e3:.0f})",
                    f"{s.expert_a2a_s * 1e3:.0f}", f"{s.expert_a2a_bytes / 2**20:.1f}"]
                   for d, s in p.predicted.items()])
    return lines + [f"parallel.expert_degree=auto picks {p.pick}"]


def run(p: Prepared, log=say) -> tuple[dict, list[str]]:
    """Start the cluster (root), run ``usp-train`` at every degree and pass, write
    ``results.json`` and ``table.txt`` into ``cfg.out``; returns (summary, table lines). A
    failed run raises ``RuntimeError`` with its output."""
    c = p.cfg
    out = Path(c.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    runs: dict = {}
    with SimCluster(NODES, PER_NODE, rate=c.rate, intra_rate=c.intra_rate,
                    queue_ms=c.queue_ms, log=log) as cluster:
        for pas, degree in order(c.degrees, c.passes):
            run_dir = out / f"expert{degree}_p{pas}"
            r = cluster.run(["-m", "usp.cli", *c.overrides(degree, run_dir)], echo=False,
                            timeout=c.timeout)
            if r.returncode:
                raise RuntimeError(f"bench_moe: usp-train at expert degree {degree} failed "
                                   f"({r.returncode}):\n{r.output[-3000:]}")
            got = run_figures((run_dir / "metrics.jsonl").read_text(), c.skip)
            got["load_avg_1m"] = os.getloadavg()[0]  # the box's load as the run ends
            log(f"bench_moe: pass {pas} expert degree {degree}: median step "
                f"{got['median_s']:.3f} s ({len(got['step_s'])} steps), expert load "
                f"{got['expert_load']}, load average {got['load_avg_1m']:.1f}")
            runs.setdefault(degree, []).append(got)
    summary = summarize(p, runs)
    lines = report(p, summary)
    (out / "results.json").write_text(json.dumps(dict(
        config=dataclasses.asdict(c), spec=dataclasses.asdict(p.spec), runs=runs,
        summary=summary), indent=2, default=str))
    (out / "table.txt").write_text("\n".join(lines) + "\n")
    return summary, lines
