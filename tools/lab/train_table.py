"""Whole training steps of three layouts on the simulated 2-node x 2-rank cluster.

Rows (``rows``), all built in the same processes and timed round-robin step by step:

1. the planner's choice: ``usp.run.resolve_run`` with ``auto`` degrees and ``auto``
   all-to-all stages on ``nominal_spec`` (dp fixed at 1: every row trains one sequence
   parallel over the 4 ranks), ``usp_attention`` with the run layout's ``a2a_chunks``;
2. all-ulysses, DeepSpeed-Ulysses: u=4 across both nodes, ``DistributedAttention``
   (``tools.lab.deepspeed_ulysses``) on contiguous shards; with fewer KV heads than 4 each
   KV head is repeated before DeepSpeed's all-to-all (it refuses fewer KV heads than ranks);
3. ring-only: u=1, r=4, ``usp_attention``.

A step is what ``usp.train.trainer`` does: the model FSDP2-sharded over dp x sp
(``shard_model``), loss normalised by the global label count, backward, clip, AdamW. The
planner's prediction of each row is ``usp.planner.cost.estimate`` on ``nominal_spec``
(the DeepSpeed row as (u=4, r=1) with ``a2a_chunks=1``).

``prepare`` (no root, no processes) checks the config and decides the rows; ``run`` (root)
starts the cluster, runs ``tools.lab.train_table_worker`` on every rank and writes
``OUT/results.json`` and ``OUT/table.txt``; ``report`` turns a result into the table.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from usp.config import ModelConfig, RunConfig
from usp.config.cluster import ClusterSpec, load_cluster
from usp.config.data import RecallData
from usp.config.parallel import ParallelConfig
from usp.config.trainer import TrainerConfig
from usp.planner.cost import estimate
from usp.run import RunLayout, resolve_run
from usp.rules import check_seq_len

from .cluster_bench import NODES, PER_NODE, WORLD
from .cluster_report import table
from .simcluster import SimCluster, rate_to_bytes_per_s, say

DS_ULYSSES = WORLD  # DeepSpeed-Ulysses row: every rank in one ulysses group
PLAN_FILE, RESULT_FILE = "plan.json", "worker.json"


@dataclass(frozen=True)
class TrainTable:
    """The table's settings. Links: ``rate`` between nodes, ``intra_rate`` shaped loopback
    inside a node (None: unshaped), ``queue_ms`` of each shaped link (``SimCluster``).
    Model: the built-in Llama (``dim``, ``n_heads`` query / ``n_kv_heads`` KV heads,
    ``n_layers``, ``ffn_dim``, ``vocab_size``), fp32, no activation checkpointing; data:
    ``batch`` sequences of ``seq_len`` tokens of the synthetic recall task, the same batch
    every step. ``warmup`` untimed and ``rounds`` timed rounds after the check: the rows'
    every-token loss (one forward) and the loss of one training step must agree within
    ``loss_rtol``, that step's grad norms within ``grad_rtol``."""

    out: str = "runs/train_table"
    rate: str = "300mbit"
    intra_rate: str | None = "2700mbit"
    queue_ms: float = 30.0
    dim: int = 512
    n_heads: int = 8
    n_kv_heads: int = 2
    n_layers: int = 2
    ffn_dim: int = 512
    vocab_size: int = 320
    seq_len: int = 4096
    batch: int = 1
    warmup: int = 2
    rounds: int = 8
    seed: int = 0
    loss_rtol: float = 1e-4
    grad_rtol: float = 1e-3
    timeout: float = 1200.0

    def __post_init__(self):
        low = {k: getattr(self, k) for k, lo in (("batch", 1), ("rounds", 1), ("warmup", 0),
                                                   ("seq_len", 1)) if getattr(self, k) < lo}
        if low:
            raise ValueError(f"need batch, rounds, seq_len >= 1 and warmup >= 0, got {low}")
        for name in ("queue_ms", "loss_rtol", "grad_rtol", "timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if "auto" in (self.rate, self.intra_rate):
            raise ValueError("rates must be tc rates (e.g. 300mbit), not auto: the planner's "
                             "spec is made of the nominal rates")
        for r in (self.rate, self.intra_rate):
            if r is not None:
                rate_to_bytes_per_s(r)  # a bad rate raises
        self.model  # ModelConfig's shape rules raise here
        kv, u = self.n_kv_heads, DS_ULYSSES
        if self.n_heads % u or (kv < u and u % kv) or (kv >= u and kv % u):
            raise ValueError(
                f"the DeepSpeed-Ulysses row splits {self.n_heads} query and {kv} KV heads over "
                f"{u} ranks: it needs query heads divisible by {u} and KV heads dividing or "
                f"divisible by {u} (fewer are repeated); e.g. --heads 8 --kv-heads 2")
        for u_, r_, balance in ((DS_ULYSSES, 1, "contiguous"), (1, WORLD, "zigzag")):
            check_seq_len(self.seq_len, u_, r_, balance)

    @property
    def model(self) -> ModelConfig:
        return ModelConfig(vocab_size=self.vocab_size, dim=self.dim, n_layers=self.n_layers,
                           n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
                           ffn_dim=self.ffn_dim)

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq_len


@dataclass(frozen=True)
class Row:
    """One row: ``attention`` "usp" or "deepspeed" at (``ulysses``, ``ring``) with
    ``a2a_chunks`` all-to-all stages (passed to usp_attention and to the estimate), tokens
    laid out by ``balance``."""

    name: str
    attention: str
    ulysses: int
    ring: int
    a2a_chunks: int
    balance: str
    placement: str = "ulysses_inner"


def nominal_spec(cfg: TrainTable) -> ClusterSpec:
    """The planner's spec of the simulated cluster from its nominal tc rates: 2 nodes x 2
    ranks, one shaped veth and one (shaped) loopback per node shared by its ranks;
    compute, latency and overlap as measured on this box (``configs/cluster/cpu_local``)."""
    base = load_cluster("cpu_local")
    intra = rate_to_bytes_per_s(cfg.intra_rate) if cfg.intra_rate else base.intra_bw
    return base.replace(name=f"simcluster {cfg.rate}/{cfg.intra_rate or 'loopback'} nominal",
                        nodes=NODES, ranks_per_node=PER_NODE, intra_bw=intra,
                        inter_bw=rate_to_bytes_per_s(cfg.rate), gpus_per_nic=PER_NODE,
                        gpus_per_intra_link=PER_NODE)


def data_config(cfg: TrainTable) -> RecallData:
    """The batch every row trains on: the synthetic recall task at ``seq_len``."""
    return RecallData(seq_len=cfg.seq_len, batch_per_dp_rank=cfg.batch, seed=cfg.seed + 1234)


def run_config(cfg: TrainTable, spec: ClusterSpec) -> RunConfig:
    """The RunConfig the planner's row is resolved from: auto degrees and stages, dp 1."""
    return RunConfig(model=cfg.model, cluster=spec,
                     parallel=ParallelConfig(ulysses_degree="auto", ring_degree="auto",
                                             dp_degree=1, a2a_chunks="auto"),
                     data=data_config(cfg),
                     trainer=TrainerConfig(seed=cfg.seed, run_dir=str(Path(cfg.out).absolute()),
                                           activation_checkpointing=False, dtype="fp32"))


def rows(layout: RunLayout) -> tuple[Row, ...]:
    """The three rows: the run layout's choice, DeepSpeed-Ulysses over all ranks, ring only."""
    return (Row("planner's choice", "usp", layout.ulysses, layout.ring, layout.a2a_chunks,
                layout.balance, layout.placement),
            Row("all-ulysses, DeepSpeed", "deepspeed", DS_ULYSSES, 1, 1, "contiguous"),
            Row("ring-only", "usp", 1, WORLD, 1, layout.balance))


def predictions(cfg: TrainTable, spec: ClusterSpec, table_rows) -> dict[str, float]:
    """{row name: the planner's predicted step s} (``estimate``, fp32, no recompute)."""
    return {r.name: estimate(cfg.model, spec, cfg.seq_len, 1, r.ring, r.ulysses,
                             global_batch=cfg.batch, dtype_bytes=4, act_checkpoint=False,
                             balance=r.balance if r.ring > 1 else "zigzag",
                             placement=r.placement, a2a_chunks=r.a2a_chunks).step_s
            for r in table_rows}


@dataclass(frozen=True)
class Prepared:
    """What ``prepare`` decided: the spec, the run layout, the rows and their predictions."""

    cfg: TrainTable
    spec: ClusterSpec
    layout: RunLayout
    rows: tuple[Row, ...]
    predicted_s: dict


def check_deepspeed() -> None:
    """Refuse (``ValueError``) when this Python cannot import DeepSpeed, which the
    DeepSpeed-Ulysses row runs on."""
    if importlib.util.find_spec("deepspeed") is None:
        raise ValueError("the DeepSpeed-Ulysses row needs deepspeed, which this Python cannot "
                         "import; pip install deepspeed==0.19.8 (or -e '.[bench]')")


def prepare(cfg: TrainTable) -> Prepared:
    """Every decision and check of the settings before a namespace exists (``ValueError``
    on a refusal); ``check_deepspeed`` checks the peer."""
    spec = nominal_spec(cfg)
    layout = resolve_run(run_config(cfg, spec), WORLD, "cpu", env={})
    table_rows = rows(layout)
    for r in table_rows:
        check_seq_len(cfg.seq_len, r.ulysses, r.ring, r.balance)
    return Prepared(cfg, spec, layout, table_rows, predictions(cfg, spec, table_rows))


def plan_json(p: Prepared) -> dict:
    """What the workers read: the settings and the rows."""
    return dict(table=dataclasses.asdict(p.cfg), rows=[dataclasses.asdict(r) for r in p.rows])


def rel_diff(values) -> float:
    """Largest relative difference between any two of ``values`` (to the largest |value|)."""
    values = list(values)
    return (max(values) - min(values)) / max(abs(v) for v in values) if values else 0.0


def summarize(p: Prepared, worker: dict) -> dict:
    """The table's figures from the workers' ``worker`` result: per row the median step,
    tokens/s, spread ((max - min) / median of the timed rounds) and predicted / measured,
    the prediction being ``estimate`` on the nominal spec with the link rates the workers
    measured before timing put in (``predicted_s_nominal_links``: with the nominal ones)."""
    links, measured = worker.get("links"), {}
    if links:  # the same spec with the measured link rates
        spec = p.spec.replace(intra_bw=links["intra"], inter_bw=links["inter"])
        measured = predictions(p.cfg, spec, p.rows)
    out = []
    for r in p.rows:
        w = worker["rows"][r.name]
        med = statistics.median(w["step_s"])
        pred = measured.get(r.name, p.predicted_s[r.name])  # the measured links when known
        out.append(dict(dataclasses.asdict(r), step_s=w["step_s"], median_s=med,
                        tokens_per_s=p.cfg.tokens_per_step / med,
                        spread=(max(w["step_s"]) - min(w["step_s"])) / med,
                        predicted_s=pred, predicted_over_measured=pred / med,
                        predicted_s_nominal_links=p.predicted_s[r.name],
                        check_loss=w["check_loss"], check_grad_norm=w["check_grad_norm"],
                        every_token_loss=w["every_token_loss"], last_loss=w["last_loss"]))
    return dict(rows=out, links=links, hosts=worker.get("hosts"),
                loss_rel_diff=rel_diff(x["check_loss"] for x in out),
                every_token_rel_diff=rel_diff(x["every_token_loss"] for x in out),
                grad_norm_rel_diff=rel_diff(x["check_grad_norm"] for x in out),
                last_loss_rel_diff=rel_diff(x["last_loss"] for x in out))


def report(p: Prepared, summary: dict) -> list[str]:
    """The printed table and the lines around it."""
    c, m = p.cfg, p.cfg.model
    lines = table(
        f"training step (fwd+bwd+AdamW, FSDP over 4 ranks), {NODES} nodes x {PER_NODE} ranks, "
        f"inter-node {c.rate}, intra-node {c.intra_rate or 'loopback'}, queue {c.queue_ms:g} "
        f"ms; model dim {m.dim} Hq {m.n_heads} Hkv {m.n_kv_heads} d {m.head_dim} layers "
        f"{m.n_layers} ffn {m.ffn_dim} vocab {m.vocab_size} fp32; L={c.seq_len} batch "
        f"{c.batch}; {c.warmup} warm-up + {c.rounds} timed rounds, round-robin",
        ["row", "(u,r)", "a2a_chunks", "tokens/s", "step ms", "spread", "planner ms",
         "planner/measured", "loss (checked step)"],
        [[r["name"], f"({r['ulysses']},{r['ring']})", r["a2a_chunks"],
          f"{r['tokens_per_s']:.0f}", f"{r['median_s'] * 1e3:.0f}", f"{r['spread']:.0%}",
          f"{r['predicted_s'] * 1e3:.0f}", f"{r['predicted_over_measured']:.2f}",
          f"{r['check_loss']:.6f}"] for r in summary["rows"]])
    lines.append(f"rows agree: checked step's loss within {summary['loss_rel_diff']:.1e}, "
                 f"every-token loss (a forward before it) within "
                 f"{summary['every_token_rel_diff']:.1e} (limit {c.loss_rtol:g}), grad norm "
                 f"within {summary['grad_norm_rel_diff']:.1e} (limit {c.grad_rtol:g}); after "
                 f"the last round the losses differ by {summary['last_loss_rel_diff']:.1e}")
    lay = p.layout
    lines.append(f"planner (resolve_run on the spec of the nominal rates, {p.spec.name}): "
                 f"ulysses {lay.ulysses} x ring {lay.ring} x dp {lay.dp}, a2a_chunks "
                 f"{lay.a2a_chunks}; predictions: usp.planner.cost.estimate on that spec with "
                 f"the measured link rates below")
    if summary.get("links"):
        lk = summary["links"]
        lines.append(f"links measured (gloo send/recv): intra-node {lk['intra'] / 1e6:.0f} MB/s "
                     f"(nominal {p.spec.intra_bw / 1e6:.0f}), inter-node "
                     f"{lk['inter'] / 1e6:.1f} MB/s (nominal {p.spec.inter_bw / 1e6:.1f})")
    return lines


def run(p: Prepared, log=say) -> tuple[dict, list[str]]:
    """Start the cluster (needs root), run the workers, write ``results.json`` and
    ``table.txt`` into ``cfg.out``; returns (summary, table lines). A failed worker (a loss
    check among them) raises ``RuntimeError`` with its output."""
    out = Path(p.cfg.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    (out / PLAN_FILE).write_text(json.dumps(plan_json(p), indent=2))
    (out / RESULT_FILE).unlink(missing_ok=True)
    with SimCluster(NODES, PER_NODE, rate=p.cfg.rate, intra_rate=p.cfg.intra_rate,
                    queue_ms=p.cfg.queue_ms, log=log) as cluster:
        r = cluster.run(["-m", "tools.lab.train_table_worker", str(out / PLAN_FILE),
                         str(out / RESULT_FILE)], timeout=p.cfg.timeout)
    if r.returncode:  # torchrun's report ends the output: repeat the ranks' errors last
        errors = [ln for ln in r.output.splitlines() if "Error:" in ln][:4]
        raise RuntimeError(f"train_table: the workers failed ({r.returncode}):\n"
                           + "\n".join([r.output[-3000:], "errors:", *errors]))
    summary = summarize(p, json.loads((out / RESULT_FILE).read_text()))
    lines = report(p, summary)
    (out / "results.json").write_text(json.dumps(dict(
        config=dataclasses.asdict(p.cfg), spec=dataclasses.asdict(p.spec),
        layout=dataclasses.asdict(p.layout), summary=summary), indent=2, default=str))
    (out / "table.txt").write_text("\n".join(lines) + "\n")
    return summary, lines
