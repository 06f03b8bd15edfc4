"""usp on a simulated 2-node x 2-rank cluster (tools/simcluster.py): the multi-node benchmarks.

Needs root (network namespaces). The launcher builds one ``SimCluster`` and runs

1. one torchrun job of this file in ``--worker`` mode on the cluster, which measures
   - the links: gloo send/recv rank 0 -> 1 (same node, loopback) and 0 -> 2 (other node);
   - (a) attention fwd+bwd at (u, r) = (2, 2), ulysses inside nodes vs across nodes;
   - (b) attention fwd+bwd at (4, 1), (2, 2), (1, 4);
   - (c) the ring alone at P=2 (ring across nodes), zigzag vs contiguous, against the
     ideal dense time / 2 (dense attention on the full sequence, timed in the same rounds);
   - the overlap share of a cross-node transfer with a kernel (for the planner's spec);
   - (e) bytes sent per rank per attention layer (``mesh.comm.bytes``) vs the formula of
     ``tests/test_comm_volume.py``;
   - (d) bytes of tensors saved for backward per rank (``saved_tensors_hooks`` around a
     model forward) at P = 1, 2, 4 vs the single-process value / P;
   every attention config lives in the same processes and is timed round-robin, the
   iteration time being the max over ranks;
2. ``usp-train`` runs of a few steps for the full training step: (a) both placements and
   (b) the three degrees, median ``step_s`` from ``metrics.jsonl`` (first step dropped;
   ``--train-passes`` runs per config in alternating order, the lowest median kept),
   next to the planner's ranking (``usp.planner.plan`` on a ClusterSpec made of the
   measured link rates, FLOP rate and overlap, one shared link of each kind per node);
3. (c) once more on a 2-node x 1-rank cluster at the same rates (``--phase ring``): one
   process per core, so a waiting rank idles its core the way a waiting GPU idles.

Tables are printed and written to ``OUT/results.json``; a PNG per benchmark goes to OUT.

    python tools/bench_cluster.py               # rate auto (loopback / 9), out runs/bench_cluster
    python tools/bench_cluster.py --rate 2gbit --seq-len 4096 --iters 5
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout
sys.path.insert(0, str(ROOT / "tools"))

from simcluster import SimCluster, SimClusterError, interrupt_on_signal, preflight  # noqa: E402

NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE


# ======================================================================================
# worker: runs on every rank of the simulated cluster (torchrun env)
# ======================================================================================


def _expected_bytes():
    """The formula of tests/test_comm_volume.py (imported, not copied)."""
    spec = importlib.util.spec_from_file_location("_cv", ROOT / "tests" / "test_comm_volume.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.expected_bytes


def measure_links(nbytes: int, rounds: int = 3) -> dict:
    """Bytes/s of a gloo send/recv 0 -> 1 (same node) and 0 -> 2 (other node)."""
    import torch
    import torch.distributed as dist

    rank, out = dist.get_rank(), {}
    t = torch.ones(nbytes // 4)
    for name, peer in (("intra", 1), ("inter", PER_NODE)):
        best = float("inf")
        for _ in range(rounds + 1):  # first round warms the connection up
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(t, peer)
            elif rank == peer:
                dist.recv(t, 0)
            dist.barrier()
            best = min(best, time.perf_counter() - t0)
        out[name] = nbytes / best
    return out


def time_round_robin(configs: dict, iters: int, warmup: int) -> dict:
    """{name: [ms per iteration]} with configs interleaved, max over ranks per iteration."""
    import torch
    import torch.distributed as dist

    names = list(configs)
    times = torch.zeros(iters, len(names), dtype=torch.float64)
    for it in range(-warmup, iters):
        start = it % len(names)
        for j in list(range(start, len(names))) + list(range(start)):
            dist.barrier()
            t0 = time.perf_counter()
            configs[names[j]]()
            t1 = time.perf_counter()
            dist.barrier()
            if it >= 0:
                times[it, j] = (t1 - t0) * 1e3
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return {n: times[:, j].tolist() for j, n in enumerate(names)}


def attention_configs(args, specs, ref_bytes: dict) -> dict:
    """One fwd+bwd closure per (name, u, r, placement, balance); fills ref_bytes (e)."""
    import torch

    from usp import SequenceLayout, SPMesh, usp_attention
    from usp.kernels import local_attention

    expected_bytes = _expected_bytes()
    B, L, H, Hkv, d = 1, args.seq_len, args.heads, args.kv_heads, args.head_dim
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, L, H, d, generator=g)
    k = torch.randn(B, L, Hkv, d, generator=g)
    v = torch.randn(B, L, Hkv, d, generator=g)
    dout = torch.randn(B, L, H, d, generator=g)
    out = {}
    for name, u, r, placement, balance in specs:
        if u == 0:  # the dense reference: the whole sequence on every rank
            ins = [t.clone().requires_grad_(True) for t in (q, k, v)]

            def dense(ins=ins):
                for t in ins:
                    t.grad = None
                local_attention(*ins, causal=True, kernel="torch").backward(dout)

            out[name] = dense
            continue
        mesh = SPMesh.build(ulysses=u, ring=r, placement=placement)
        lay = SequenceLayout(mesh, seq_len=L, balance=balance)
        ins = [lay.shard(t, dim=1).clone().requires_grad_(True) for t in (q, k, v)]
        dl = lay.shard(dout, dim=1)

        def step(ins=ins, dl=dl, mesh=mesh, lay=lay):
            for t in ins:
                t.grad = None
            usp_attention(*ins, mesh=mesh, layout=lay, causal=True, kernel="torch").backward(dl)

        mesh.comm.reset()
        step()  # (e): one call's bytes; also a warm-up
        fwd, bwd = expected_bytes(B, L, H, Hkv, d, u, r, 4)
        got = sum(mesh.comm.bytes[a] for a in ("ulysses", "ring"))
        ref_bytes[name] = dict(
            measured=got, formula=sum(fwd.values()) + sum(bwd.values()),
            ulysses=mesh.comm.bytes["ulysses"], ring=mesh.comm.bytes["ring"],
            hosts_per_ulysses_group=len({mesh.hosts[x] for x in mesh.axis_ranks("ulysses")}),
            hosts_per_ring_group=len({mesh.hosts[x] for x in mesh.axis_ranks("ring")}))
        out[name] = step
    return out


def saved_activation_bytes(args) -> dict:
    """(d): bytes of tensors autograd saves in one model forward, per rank, at P = 1, 2, 4."""
    from functools import partial

    import torch

    from usp import SequenceLayout, SPMesh, usp_attention
    from usp.config import ModelConfig
    from usp.model import Transformer

    cfg = ModelConfig()  # the tiny model: dim 128, 8 heads, 2 KV heads, 2 layers
    L = args.mem_seq_len
    tokens = torch.randint(0, cfg.vocab_size, (1, L), generator=torch.Generator().manual_seed(1))
    res = {}
    for P, (u, r) in ((1, (1, 1)), (2, (2, 1)), (4, (2, 2))):
        mesh = SPMesh.build(ulysses=u, ring=r)
        lay = SequenceLayout(mesh, seq_len=L)
        attn = partial(usp_attention, mesh=mesh, layout=lay, causal=True, kernel="torch")
        model = Transformer(cfg, attn)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen: dict[int, int] = {}

        def pack(t):
            s = t.untyped_storage()
            if s.data_ptr() not in params:  # weights are state, not activations
                seen[s.data_ptr()] = s.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = model(lay.shard(tokens, dim=1), lay.positions())
        logits.float().sum().backward()
        res[P] = sum(seen.values())
    return res


def measure_overlap(args, reps: int = 7) -> dict:
    """How much of a cross-node transfer hides behind a kernel running at the same time.

    Every rank swaps one K/V block with its partner on the other node (both ranks of a
    node at once, as the (2,2) ring does) beside the forward of one ring block; kernel
    alone, transfer alone and both are timed back to back, ``reps`` times, max over ranks,
    and the share computed, as tools/calibrate_planner.py does (``overlap_times``,
    ``overlap_share``)."""
    import torch
    import torch.distributed as dist

    from calibrate_planner import overlap_share, overlap_times
    from usp.kernels import local_attention

    rank, world = dist.get_rank(), dist.get_world_size()
    partner = (rank + PER_NODE) % world
    blk, h = args.seq_len // 2, args.heads // 2  # the (2,2) layout's ring block
    q = torch.randn(1, blk, h, args.head_dim)
    k, v = (torch.randn(1, blk, 1, args.head_dim) for _ in range(2))
    send = torch.randn(2 * blk * args.head_dim)  # one K/V block, fp32
    recv = torch.empty_like(send)

    def kernel():
        with torch.no_grad():
            local_attention(q, k, v, causal=False, kernel="torch")

    def post():
        return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, partner),
                                       dist.P2POp(dist.irecv, recv, partner)])

    kernel_s, comm_s, both_s = overlap_times(kernel, post, reps, warmup=1)
    return dict(share=overlap_share(kernel_s, comm_s, both_s), kernel_ms=med(kernel_s) * 1e3,
                transfer_ms=med(comm_s) * 1e3, both_ms=med(both_s) * 1e3)


def ring_worker(args) -> None:
    """(c) on 2 nodes x 1 rank: one process per core, so a rank that waits idles its core
    as an idle GPU would. Dense on each rank vs the P=2 ring, zigzag and contiguous."""
    import torch.distributed as dist

    rank = dist.get_rank()
    specs = [("ring P=2 zigzag", 1, 2, "ulysses_inner", "zigzag"),
             ("ring P=2 contiguous", 1, 2, "ulysses_inner", "contiguous"),
             ("dense P=1", 0, 0, "", "")]
    res = {}
    for n_tok in (int(x) for x in args.ring_seq_len.split(",")):
        args.seq_len = n_tok
        configs = attention_configs(args, specs, {})
        res[n_tok] = time_round_robin(configs, args.ring_iters, args.warmup)
        if rank == 0:
            print(f"ring P=2, L={n_tok}: done", flush=True)
    if rank == 0:
        Path(args.out, "worker_ring.json").write_text(json.dumps(res, indent=2))


def worker(args) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    if args.phase == "ring":
        ring_worker(args)
        dist.barrier()
        dist.destroy_process_group()
        return
    rank = dist.get_rank()
    say = print if rank == 0 else (lambda *a, **k: None)
    res = {"links": measure_links(args.link_bytes)}
    say(f"links: {res['links']}", flush=True)
    if not args.only_placement:
        res["overlap"] = measure_overlap(args)
        say(f"overlap: {res['overlap']}", flush=True)

    ref_bytes: dict = {}
    specs = [
        ("(2,2) ulysses_inner", 2, 2, "ulysses_inner", "zigzag"),
        ("(2,2) ring_inner", 2, 2, "ring_inner", "zigzag"),
        ("(4,1)", 4, 1, "ulysses_inner", "zigzag"),
        ("(1,4)", 1, 4, "ulysses_inner", "zigzag"),
        ("ring P=2 zigzag", 1, 2, "ulysses_inner", "zigzag"),  # dp 2: rings 0-2 and 1-3
        ("ring P=2 contiguous", 1, 2, "ulysses_inner", "contiguous"),
        ("dense P=1", 0, 0, "", ""),
    ]
    if args.only_placement:
        specs = specs[:2]
    configs = attention_configs(args, specs, ref_bytes)
    say(f"timing {len(configs)} attention configs x {args.iters} rounds", flush=True)
    res["attention_ms"] = time_round_robin(configs, args.iters, args.warmup)
    res["bytes"] = ref_bytes
    if not args.only_placement:
        res["saved_bytes"] = saved_activation_bytes(args)
    res["hosts"] = [None] * dist.get_world_size()
    import socket

    dist.all_gather_object(res["hosts"], socket.gethostname())
    if rank == 0:
        Path(args.out, "worker.json").write_text(json.dumps(res, indent=2))
    dist.barrier()
    dist.destroy_process_group()


# ======================================================================================
# launcher: builds the cluster, runs the worker and the training jobs, reports
# ======================================================================================


def train_step_s(cluster: SimCluster, out: Path, name: str, overrides: list[str], steps: int):
    run_dir = out / f"train_{name}"
    cmd = ["-m", "usp.cli", *overrides, "parallel.ranks_per_node=null",
           f"trainer.steps={steps}", "data.eval_batches=0", "logging.wandb=disabled",
           "logging.plot=false", "logging.progress=false", f"trainer.run_dir={run_dir}",
           f"hydra.run.dir={run_dir}",
           "trainer.resume=false"]
    r = cluster.run(cmd, echo=False, timeout=600)
    if r.returncode:
        print(r.output[-3000:])
        raise SystemExit(f"training {name} failed ({r.returncode})")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    steps_s = [row["step_s"] for row in rows if "step_s" in row][1:]  # drop the first step
    return statistics.median(steps_s), steps_s


def table(title: str, head: list[str], rows: list[list], lines: list[str]) -> None:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(head)]
    out = [f"\n{title}", "  ".join(f"{h:>{w}}" for h, w in zip(head, widths)),
           "  ".join("-" * w for w in widths)]
    out += ["  ".join(f"{str(c):>{w}}" for c, w in zip(r, widths)) for r in rows]
    print("\n".join(out), flush=True)
    lines.extend(out)


def bar_png(path: Path, title: str, labels, values, ylabel: str, ref=None, ref_label=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(labels), 3.6))
    ax.bar(range(len(labels)), values, color="tab:blue")
    if ref is not None:
        ax.plot(range(len(labels)), ref, "r_", markersize=30, mew=2, label=ref_label)
        ax.legend(fontsize=8)
    ax.set_xticks(range(len(labels)), labels, fontsize=8, rotation=10)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def grouped_bar_png(path: Path, labels, series: list, ylabel: str, *, title=None, xlabel=None,
                    hline=None, width: float = 6.0, tick_size=None):
    """Two bars per label, one per ``(name, values)`` in ``series``; ``hline`` = (y, label)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(width, 3.6))
    x = range(len(labels))
    for off, (name, values) in zip((-0.2, 0.2), series):
        ax.bar([i + off for i in x], values, 0.4, label=name)
    if hline is not None:
        ax.axhline(hline[0], color="red", lw=1, ls="--", label=hline[1])
    ax.set_xticks(list(x), labels, fontsize=tick_size)
    if xlabel:
        ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def med(x):
    return statistics.median(x)


def report(args, w: dict, train: dict, out: Path) -> dict:
    from usp.config import ModelConfig
    from usp.planner import plan
    from usp.planner.cluster import load_cluster

    lines: list[str] = []
    L = args.seq_len
    links = w["links"]
    print(f"\nhosts seen by the ranks: {w['hosts']}")
    table("links (gloo send/recv, best of 3)", ["link", "MB/s", "ratio"],
          [["intra-node (loopback)", f"{links['intra'] / 1e6:.0f}", "1.00"],
           ["inter-node (veth+tbf)", f"{links['inter'] / 1e6:.0f}",
            f"{links['intra'] / links['inter']:.2f}x slower"]], lines)
    ms = {k: med(v) for k, v in w["attention_ms"].items()}
    summary: dict = {"links": links}

    # (a) placement
    a_in, a_out = ms["(2,2) ulysses_inner"], ms["(2,2) ring_inner"]
    t_in, t_out = train["(2,2) ulysses_inner"][0], train["(2,2) ring_inner"][0]
    table(f"(a) placement, (u,r)=(2,2): attention fwd+bwd L={L} (median ms, max over ranks) "
          f"and usp-train step (median s)",
          ["placement", "attn ms", "train step s"],
          [["ulysses inside nodes", f"{a_in:.1f}", f"{t_in:.3f}"],
           ["ulysses across nodes", f"{a_out:.1f}", f"{t_out:.3f}"],
           ["across / inside", f"{a_out / a_in:.2f}x", f"{t_out / t_in:.2f}x"]], lines)
    summary["placement"] = dict(attn_ratio=a_out / a_in, train_ratio=t_out / t_in)
    bar_png(out / "a_placement.png", f"(a) (2,2) placement, attention L={L}",
            ["ulysses inner", "ring inner"], [a_in, a_out], "fwd+bwd ms")

    # (e) bytes
    rows = []
    for name, b in w["bytes"].items():
        rows.append([name, b["ulysses"], b["ring"], b["measured"], b["formula"],
                     f"{(b['measured'] / b['formula'] - 1) * 100:+.2f}%",
                     b["hosts_per_ulysses_group"], b["hosts_per_ring_group"]])
    table(f"(e) bytes sent per rank per attention layer (fwd+bwd, fp32, B=1 L={L} "
          f"Hq={args.heads} Hkv={args.kv_heads} d={args.head_dim})",
          ["config", "ulysses B", "ring B", "measured B", "formula B", "diff",
           "hosts/uly grp", "hosts/ring grp"], rows, lines)
    summary["bytes_max_rel_err"] = max(abs(b["measured"] / b["formula"] - 1)
                                       for b in w["bytes"].values())
    names = list(w["bytes"])
    bar_png(out / "e_bytes.png", "(e) bytes per rank per layer", names,
            [w["bytes"][n]["measured"] / 1e6 for n in names], "MB",
            ref=[w["bytes"][n]["formula"] / 1e6 for n in names], ref_label="formula")

    # (d) activation memory
    sb = {int(k): v for k, v in w["saved_bytes"].items()}
    rows = [[P, f"{sb[P] / 2**20:.2f}", f"{sb[1] / P / 2**20:.2f}", f"{sb[P] / (sb[1] / P):.3f}"]
            for P in sorted(sb)]
    table(f"(d) tensors saved for backward per rank, tiny model, L={args.mem_seq_len}",
          ["P", "MiB/rank", "single/P MiB", "ratio"], rows, lines)
    summary["act_ratio"] = {P: sb[P] / (sb[1] / P) for P in sb}
    bar_png(out / "d_activation_memory.png", f"(d) saved activations per rank L={args.mem_seq_len}",
            [f"P={P}" for P in sorted(sb)], [sb[P] / 2**20 for P in sorted(sb)], "MiB",
            ref=[sb[1] / P / 2**20 for P in sorted(sb)], ref_label="single / P")

    # (c) ring efficiency: one rank per core (the target), and 2 ranks per core
    rings = ("ring P=2 zigzag", "ring P=2 contiguous")
    rows, summary["ring_eff"] = [], {}
    setups = [("1 rank per core", {k: med(v) for k, v in by_name.items()}, int(n_tok))
              for n_tok, by_name in (w.get("ring") or {}).items()]
    setups.append(("4 ranks on 2 cores", ms, L))
    for setup, t, n_tok in setups:
        ideal = t["dense P=1"] / 2
        rows.append([setup, n_tok, f"{t['dense P=1']:.1f}", f"{ideal:.1f}"]
                    + [f"{t[n]:.1f} ({ideal / t[n] * 100:.0f}%)" for n in rings])
        summary["ring_eff"][f"{setup}, L={n_tok}"] = {n: ideal / t[n] for n in rings}
    table("(c) ring at P=2 across nodes vs the ideal dense / 2, attention fwd+bwd "
          "(median ms, efficiency)",
          ["setup", "L", "dense P=1", "ideal = dense/2", "zigzag", "contiguous"], rows, lines)
    grouped_bar_png(
        out / "c_ring_efficiency.png", [f"L={n_tok}\n{setup}" for setup, _, n_tok in setups],
        [(n.split()[-1], [t["dense P=1"] / 2 / t[n] * 100 for _, t, _ in setups])
         for n in rings],
        "% of ideal (dense / 2)", title="(c) ring P=2 efficiency", hline=(90, "90%"),
        width=6.5, tick_size=7)

    # (b) degree sweep + planner
    base = load_cluster("cpu_local")
    # compute calibrated too: the dense attention timed above, as FLOP/s at mfu 1
    # (causal fwd 2*L^2*Hq*d, backward 2.5x that)
    flops = 3.5 * 2 * L * L * args.heads * args.head_dim / (ms["dense P=1"] / 1e3)
    # one shaped veth per node and one shaped loopback per node: the node's ranks share
    # each link (gpus_per_nic = gpus_per_intra_link = ranks per node); the overlap of a
    # cross-node transfer with a kernel is measured on this cluster, not cpu_local's
    overlap = w["overlap"]["share"] if "overlap" in w else base.overlap
    spec = base.replace(name="simcluster", ranks_per_node=PER_NODE, nodes=NODES,
                        intra_bw=links["intra"], inter_bw=links["inter"],
                        peak_flops=flops, mfu=1.0, overlap=overlap,
                        gpus_per_nic=PER_NODE, gpus_per_intra_link=PER_NODE)
    print(f"planner cluster spec: intra {links['intra'] / 1e6:.0f} MB/s, inter "
          f"{links['inter'] / 1e6:.0f} MB/s, one of each per node; {flops / 1e9:.1f} GFLOP/s "
          f"per rank; overlap {overlap:.2f} (all measured)")
    lines.append(f"planner spec: intra {links['intra'] / 1e6:.0f} MB/s, inter "
                 f"{links['inter'] / 1e6:.0f} MB/s per node, {flops / 1e9:.1f} GFLOP/s, "
                 f"overlap {overlap:.2f}")
    if "overlap" in w:
        o = w["overlap"]
        print(f"overlap test: kernel {o['kernel_ms']:.1f} ms, cross-node transfer "
              f"{o['transfer_ms']:.1f} ms, both {o['both_ms']:.1f} ms -> {o['share']:.0%} of the "
              f"shorter hidden (median of paired repetitions)")
    model = ModelConfig()
    p = plan(model, spec, args.train_seq_len, world=WORLD, dp=1,
             global_batch=args.train_batch, dtype_bytes=4, act_checkpoint=False)
    pred = {(c.ulysses, c.ring): c.cost.step_s for c in p.candidates}
    sweep = {(4, 1): "(4,1)", (2, 2): "(2,2) ulysses_inner", (1, 4): "(1,4)"}
    measured = {k: train[v][0] for k, v in sweep.items()}
    rank_m = sorted(measured, key=measured.get)
    rank_p = sorted((k for k in sweep if k in pred), key=pred.get)
    rows = [[f"({u},{r})", f"{ms[sweep[(u, r)]]:.1f}", f"{measured[(u, r)]:.3f}",
             rank_m.index((u, r)) + 1,
             f"{pred[(u, r)]:.3f}" if (u, r) in pred else "dropped",
             rank_p.index((u, r)) + 1 if (u, r) in pred else "-"]
            for (u, r) in sweep]
    table(f"(b) degree sweep at world 4: attention L={L} and usp-train step "
          f"(L={args.train_seq_len}, batch {args.train_batch}) vs planner (measured links)",
          ["(u,r)", "attn ms", "train s", "measured rank", "planner s", "planner rank"],
          rows, lines)
    choice = rank_p[0]
    gap = measured[choice] / measured[rank_m[0]] - 1
    print(f"planner choice {choice}: its measured step is {gap * 100:+.1f}% vs the measured "
          f"best {rank_m[0]}")
    lines.append(f"planner choice {choice}: measured {gap * 100:+.1f}% vs best {rank_m[0]}")
    summary["planner"] = dict(choice=list(choice), best=list(rank_m[0]), gap=gap)
    bar_png(out / "b_degree_sweep.png", "(b) usp-train step vs planner", [sweep[k] for k in sweep],
            [measured[k] for k in sweep], "step s",
            ref=[pred.get(k, float("nan")) for k in sweep], ref_label="planner")
    (out / "tables.txt").write_text("\n".join(lines) + "\n")
    return summary


def placement_sweep(args, out: Path, fwd: list[str]) -> int:
    """(a) attention only, at several (inter, intra) link rates: where does placement matter?"""
    rows, lines, got = [], [], []
    for pair in args.placement_sweep.split(","):
        inter, _, intra = pair.partition(":")
        sub = out / f"sweep_{inter}_{intra or 'lo'}"
        sub.mkdir(parents=True, exist_ok=True)
        with SimCluster(NODES, PER_NODE, rate=inter, intra_rate=intra or None) as cluster:
            r = cluster.run([str(Path(__file__).resolve()), "--worker", "--only-placement",
                             f"--out={sub}", *fwd], timeout=900, echo=False)
        if r.returncode:
            print(r.output[-3000:])
            return 1
        w = json.loads((sub / "worker.json").read_text())
        ms = {k: med(v) for k, v in w["attention_ms"].items()}
        a_in, a_out = ms["(2,2) ulysses_inner"], ms["(2,2) ring_inner"]
        lk = w["links"]
        rows.append([inter, intra or "loopback", f"{lk['inter'] / 1e6:.0f}",
                     f"{lk['intra'] / 1e6:.0f}", f"{lk['intra'] / lk['inter']:.1f}",
                     f"{a_in:.1f}", f"{a_out:.1f}", f"{a_out / a_in:.2f}x"])
        got.append((f"{inter}", a_in, a_out))
        print(f"done {pair}: across/inside {a_out / a_in:.2f}x", flush=True)
    table(f"(a) placement sweep, (u,r)=(2,2), attention fwd+bwd L={args.seq_len} "
          f"Hq={args.heads} Hkv={args.kv_heads} (median ms, max over ranks)",
          ["inter rate", "intra rate", "inter MB/s", "intra MB/s", "intra/inter",
           "ulysses inside ms", "ulysses across ms", "across/inside"], rows, lines)
    (out / "placement_sweep.txt").write_text("\n".join(lines) + "\n")
    grouped_bar_png(out / "a_placement_sweep.png", [g[0] for g in got],
                    [("ulysses inside nodes", [g[1] for g in got]),
                     ("ulysses across nodes", [g[2] for g in got])],
                    "attention fwd+bwd ms", xlabel="inter-node rate")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/bench_cluster"))
    ap.add_argument("--rate", default="auto", help="inter-node rate, tc units or 'auto'")
    ap.add_argument("--ratio", type=float, default=9.0)
    ap.add_argument("--seq-len", type=int, default=2048, help="attention benchmarks")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2, help="GQA like the tiny model")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--mem-seq-len", type=int, default=2048)
    ap.add_argument("--train-seq-len", type=int, default=2048)
    ap.add_argument("--train-batch", type=int, default=2)
    ap.add_argument("--train-steps", type=int, default=6)
    ap.add_argument("--train-passes", type=int, default=2,
                    help="usp-train runs per config, in alternating order; best median wins")
    ap.add_argument("--ring-seq-len", default="2048,4096,8192",
                    help="(c) on 2 nodes x 1 rank (one process per core): lengths, comma-separated")
    ap.add_argument("--ring-iters", type=int, default=7)
    ap.add_argument("--phase", default="main", choices=["main", "ring"], help=argparse.SUPPRESS)
    ap.add_argument("--link-bytes", type=int, default=32 * 2**20)
    ap.add_argument("--intra-rate", default=None, help="shape loopback too (simcluster)")
    ap.add_argument("--placement-sweep", default=None,
                    help="only (a) attention, once per INTER:INTRA rate pair, e.g. "
                         "'1gbit:9gbit,200mbit:1800mbit' (INTRA empty: loopback)")
    ap.add_argument("--only-placement", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--report-only", action="store_true",
                    help="re-print the tables of OUT/results.json (same size flags as the run)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.report_only:  # tables and PNGs again from a saved results.json (no root needed)
        saved = json.loads((args.out / "results.json").read_text())
        train = {k: (v, []) for k, v in saved["summary"]["train"].items()}
        report(args, saved["worker"], train, args.out.resolve())
        return 0
    try:
        preflight()
    except SimClusterError as e:
        print(f"bench_cluster: error: {e}", file=sys.stderr)
        return 2
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    import signal

    signal.signal(signal.SIGTERM, interrupt_on_signal)  # unwind through SimCluster's clean-up
    sizes = ("seq_len", "heads", "kv_heads", "head_dim", "iters", "warmup", "mem_seq_len",
             "link_bytes", "ring_seq_len", "ring_iters")  # what the worker needs
    fwd = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in sizes]
    if args.placement_sweep:
        return placement_sweep(args, out, fwd)
    with SimCluster(NODES, PER_NODE, rate=args.rate, ratio=args.ratio,
                    intra_rate=args.intra_rate) as cluster:
        r = cluster.run([str(Path(__file__).resolve()), "--worker", f"--out={out}", *fwd],
                        timeout=900)
        if r.returncode:
            print(f"bench_cluster: worker failed ({r.returncode})", file=sys.stderr)
            return 1
        common = [f"data.seq_len={args.train_seq_len}", f"data.batch_size={args.train_batch}"]
        runs = [("(2,2) ulysses_inner", 2, 2, "ulysses_inner"),
                ("(2,2) ring_inner", 2, 2, "ring_inner"),
                ("(4,1)", 4, 1, "ulysses_inner"),
                ("(1,4)", 1, 4, "ulysses_inner")]
        train: dict = {}
        for pas in range(args.train_passes):  # alternate the order: drift hits all alike
            for name, u, rr, pl in runs if pas % 2 == 0 else runs[::-1]:
                tag = (name.replace("(", "").replace(")", "").replace(",", "x")
                       .replace(" ", "_") + f"_p{pas}")
                got = train_step_s(
                    cluster, out, tag, [*common, f"parallel.ulysses_degree={u}",
                                        f"parallel.ring_degree={rr}", f"parallel.placement={pl}"],
                    args.train_steps)
                print(f"usp-train {name} pass {pas}: median step {got[0]:.3f} s", flush=True)
                if name not in train or got[0] < train[name][0]:
                    train[name] = got
        rate, intra_rate = cluster.rate, cluster.intra_rate
    # (c) again with one process per core: 2 nodes x 1 rank, the same link rates
    with SimCluster(NODES, 1, rate=rate, intra_rate=intra_rate) as cluster:
        r = cluster.run([str(Path(__file__).resolve()), "--worker", "--phase=ring",
                         f"--out={out}", *fwd], timeout=900)
        if r.returncode:
            print(f"bench_cluster: ring worker failed ({r.returncode})", file=sys.stderr)
            return 1
    w = json.loads((out / "worker.json").read_text())
    w["ring"] = json.loads((out / "worker_ring.json").read_text())
    print(f"\nsimulated cluster: {NODES} nodes x {PER_NODE} ranks, inter-node rate {rate}")
    summary = report(args, w, train, out)
    summary["rate"] = rate
    summary["train"] = {k: v[0] for k, v in train.items()}
    (out / "results.json").write_text(json.dumps(dict(worker=w, summary=summary), indent=2))
    print(f"\nwrote {out}/results.json, tables.txt and *.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
