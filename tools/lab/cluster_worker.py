"""What every rank of the simulated cluster measures for ``tools.lab.cluster``.

Started by torchrun on each node (``SimCluster.run``)::

    python -m tools.lab.cluster_worker OUT/bench.json {main|placement|ring|chunks}

``main`` (2 nodes x 2 ranks) measures the links, the overlap of a cross-node transfer with
a kernel, attention fwd+bwd for every case of ``MAIN_CASES`` (timed round-robin in the same
processes, max over ranks), the bytes each case sends per rank, and the bytes saved for
backward at P = 1, 2, 4; ``placement`` the links and the two (2,2) placements only;
``ring`` (2 nodes x 1 rank) the ring at P=2 against dense at every ``ring_seq_lens``;
``chunks`` the links, the overlap and (f) the pipelined all-to-all (``measure_chunks``);
``chunks_solo`` (2 nodes x 1 rank) (f) alone for the layouts of that cluster.
Rank 0 writes ``result_file(phase)`` into ``out``.
"""

from __future__ import annotations

import socket
import statistics
import sys
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from usp.attention import local_attention
from usp.layout import SequenceLayout
from usp.mesh import SPMesh
from .cluster_bench import PER_NODE, ClusterBench, chunk_layouts
from .simcluster import gloo_main, p2p_rate
from usp.bench.timing import mean_over_ranks


@dataclass(frozen=True)
class Case:
    """One timed attention call: ``usp_attention`` at (ulysses, ring), or with ``ulysses=0``
    the dense reference, the whole sequence on every rank."""

    name: str
    ulysses: int = 0
    ring: int = 0
    placement: str = "ulysses_inner"
    balance: str = "zigzag"
    a2a_chunks: int = 1
    pieces: str = "auto"  # "whole": SPMesh.build(fragment_bytes=None), messages never cut


DENSE = Case("dense P=1")
RING_CASES = (Case("ring P=2 zigzag", 1, 2),  # at world 4, dp 2: rings 0-2 and 1-3
              Case("ring P=2 contiguous", 1, 2, balance="contiguous"), DENSE)
MAIN_CASES = (Case("(2,2) ulysses_inner", 2, 2), Case("(2,2) ring_inner", 2, 2, "ring_inner"),
              Case("(4,1)", 4, 1), Case("(1,4)", 1, 4), *RING_CASES)
# the ring phase (2 nodes x 1 rank) also runs zigzag with whole messages, against the pieces
# its ring messages travel in by default across hosts
SOLO_RING_CASES = (*RING_CASES, Case("ring P=2 zigzag whole", 1, 2, pieces="whole"))
PLACEMENT_CASES = MAIN_CASES[:2]


def _inputs(cfg: ClusterBench, seq_len: int) -> tuple[torch.Tensor, ...]:
    """q, k, v, dout of one layer: [1, L, H, d] / [1, L, Hkv, d], the same on every rank."""
    g = torch.Generator().manual_seed(0)
    shapes = [(cfg.heads,), (cfg.kv_heads,), (cfg.kv_heads,), (cfg.heads,)]
    return tuple(torch.randn(1, seq_len, *h, cfg.head_dim, generator=g) for h in shapes)


def attention_calls(cfg: ClusterBench, seq_len: int, cases, stack: ExitStack,
                    sent: dict | None = None, comms: dict | None = None) -> dict:
    """{case name: a fwd+bwd call}. With ``sent``, each usp case is called once here and
    ``sent[name]`` gets the bytes it sent per rank next to ``attention_bytes``' value and
    how many hosts its ulysses and ring groups span; ``comms[name]`` gets each usp case's
    ``mesh.comm``. Meshes close when ``stack`` does."""
    from usp.attention import usp_attention
    from usp.planner.traffic import attention_bytes

    q, k, v, dout = _inputs(cfg, seq_len)
    calls = {}
    for c in cases:
        if c.ulysses == 0:
            ins = [t.clone().requires_grad_(True) for t in (q, k, v)]
            attn, grad = partial(local_attention, causal=True, kernel="torch"), dout
        else:
            mesh = stack.enter_context(SPMesh.build(
                ulysses=c.ulysses, ring=c.ring, placement=c.placement,
                fragment_bytes=None if c.pieces == "whole" else "auto"))
            lay = SequenceLayout(mesh, seq_len=seq_len, balance=c.balance)
            # [1, L, H, d] -> [1, L/P, H, d]: this rank's tokens
            ins = [lay.shard(t, dim=1).clone().requires_grad_(True) for t in (q, k, v)]
            attn = partial(usp_attention, mesh=mesh, layout=lay, causal=True, kernel="torch",
                           a2a_chunks=c.a2a_chunks)
            grad = lay.shard(dout, dim=1)
            if comms is not None:
                comms[c.name] = mesh.comm

        def call(ins=ins, attn=attn, grad=grad):
            for t in ins:
                t.grad = None
            attn(*ins).backward(grad)

        calls[c.name] = call
        if sent is not None and c.ulysses:
            mesh.comm.reset()
            call()  # one call's bytes; also a warm-up
            fwd, bwd = attention_bytes(1, seq_len, cfg.heads, cfg.kv_heads, cfg.head_dim,
                                       c.ulysses, c.ring, q.element_size(),
                                       a2a_chunks=c.a2a_chunks)
            b = {a: mesh.comm.bytes[a] for a in ("ulysses", "ring")}
            sent[c.name] = dict(
                measured=sum(b.values()), formula=sum(fwd.values()) + sum(bwd.values()), **b,
                **{f"hosts_per_{a}_group": len({mesh.hosts[x] for x in mesh.axis_ranks(a)})
                   for a in ("ulysses", "ring")})
    return calls


def time_cases(calls: dict, rounds: int, warmup: int) -> dict:
    """{name: [ms per round]}: the calls interleaved, the slowest rank's time per call."""
    from usp.bench.timing import round_robin

    per_round = round_robin(list(calls.values()), rounds, warmup)
    return {n: [r[j] * 1e3 for r in per_round] for j, n in enumerate(calls)}


def saved_activation_bytes(seq_len: int) -> dict:
    """{P: bytes of the tensors autograd saves in one forward of the tiny model, per rank}
    at P = 1, 2, 4 (parameters, being state, are not counted)."""
    from usp.attention import usp_attention
    from usp.config import ModelConfig
    from usp.models.decoder import Transformer

    cfg = ModelConfig()
    tokens = torch.randint(0, cfg.vocab_size, (1, seq_len),
                           generator=torch.Generator().manual_seed(1))
    res = {}
    for P, (u, r) in ((1, (1, 1)), (2, (2, 1)), (4, (2, 2))):
        with SPMesh.build(ulysses=u, ring=r) as mesh:
            lay = SequenceLayout(mesh, seq_len=seq_len)
            attn = partial(usp_attention, mesh=mesh, layout=lay, causal=True, kernel="torch")
            model = Transformer(cfg, attn)
            params = {p.untyped_storage().data_ptr() for p in model.parameters()}
            seen: dict[int, int] = {}

            def pack(t):
                s = t.untyped_storage()
                if s.data_ptr() not in params:
                    seen[s.data_ptr()] = s.nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                logits = model(lay.shard(tokens, dim=1), lay.positions())
            logits.float().sum().backward()
        res[P] = sum(seen.values())
    return res


def _block_kernel(cfg: ClusterBench):
    """The forward of one ring block of the (2,2) layout, as a call with no arguments."""
    blk, h = cfg.seq_len // 2, cfg.heads // 2
    q = torch.randn(1, blk, h, cfg.head_dim)
    k, v = (torch.randn(1, blk, 1, cfg.head_dim) for _ in range(2))

    def kernel():
        with torch.no_grad():
            local_attention(q, k, v, causal=False, kernel="torch")

    return kernel


def _swap(send: torch.Tensor, recv: torch.Tensor, partner: int) -> list:
    """Post a ring step's exchange with ``partner``: its requests."""
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, partner),
                                   dist.P2POp(dist.irecv, recv, partner)])


def measure_overlap(cfg: ClusterBench, reps: int = 7) -> dict:
    """Share of a cross-node transfer hidden behind a kernel running at the same time.

    Every rank swaps one K/V block of the (2,2) layout with its partner on the other node
    (both ranks of a node at once, as the (2,2) ring does) beside the forward of one ring
    block; kernel alone, transfer alone and both are timed back to back ``reps`` times."""
    from usp.planner.calibration import overlap_share
    from usp.bench.timing import overlap_times

    partner = (dist.get_rank() + PER_NODE) % dist.get_world_size()
    send = torch.randn(2 * (cfg.seq_len // 2) * cfg.head_dim)  # one K/V block, fp32
    recv = torch.empty_like(send)
    kernel_s, comm_s, both_s = overlap_times(_block_kernel(cfg),
                                             lambda: _swap(send, recv, partner), reps, warmup=1)
    med = statistics.median
    return dict(share=overlap_share(kernel_s, comm_s, both_s), kernel_ms=med(kernel_s) * 1e3,
                transfer_ms=med(comm_s) * 1e3, both_ms=med(both_s) * 1e3)


def measure_latency(reps: int = 15, nbytes: int = 1024) -> dict:
    """{link: seconds} of one small (``nbytes``) ring-step exchange with a partner on the
    same node (``intra``) and on the other node (``inter``): median over ``reps`` of the
    slowest rank's time, barriers between (the message start-up ``ClusterSpec`` calls
    ``*_latency_s``)."""
    from usp.bench.timing import timed

    rank, world = dist.get_rank(), dist.get_world_size()
    send, recv = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    res = {}
    for link, partner in (("intra", rank ^ 1), ("inter", (rank + PER_NODE) % world)):
        def step(partner=partner):
            for req in _swap(send, recv, partner):
                req.wait()

        step()  # connection set-up
        res[link] = statistics.median(timed(step, reps))
    return res


def chunk_case(layout: str, chunks: int) -> str:
    """The (f) case name of ``layout`` (a ``cluster.CHUNK_LAYOUTS`` name) at ``chunks``
    stages."""
    return f"{layout} c={chunks}"


def measure_chunks(cfg: ClusterBench, stack: ExitStack, per_node: int = PER_NODE) -> dict:
    """(f): attention fwd+bwd of every layout of this cluster (``chunk_layouts(per_node)``)
    at every legal ``a2a_chunks``, interleaved with the dense case, plus per case the
    ulysses time the compute was blocked on (``a2a_exposed_ms``), the ulysses transfer time
    that ran behind compute (``a2a_hidden_ms``) and the ring's blocked time, per call,
    mean over ranks."""
    cases = [Case(chunk_case(name, c), u, r, pl, a2a_chunks=c)
             for name, u, r, pl, _ in chunk_layouts(per_node) for c in cfg.legal_chunks(u)]
    sent, comms = {}, {}
    calls = attention_calls(cfg, cfg.seq_len, [*cases, DENSE], stack, sent, comms)
    for comm in comms.values():
        comm.reset()  # from here: the timed calls only
    _log(f"timing {len(calls)} attention cases x {cfg.iters} rounds (a2a_chunks)")
    times = time_cases(calls, cfg.iters, cfg.warmup)
    n = cfg.iters + cfg.warmup
    split = mean_over_ranks([[comms[k].exposed_s["ulysses"], comms[k].hidden_s["ulysses"],
                              comms[k].exposed_s["ring"]] for k in comms])
    return dict(attention_ms=times, bytes=sent, split={
        k: dict(a2a_exposed_ms=e / n * 1e3, a2a_hidden_ms=h / n * 1e3,
                ring_exposed_ms=g / n * 1e3) for k, (e, h, g) in zip(comms, split)})


def _log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def measure(cfg: ClusterBench, phase: str) -> dict:
    """One phase's measurements (collective: every rank calls it); see the module doc."""
    with ExitStack() as stack:
        if phase == "ring":
            res = {}
            for n_tok in cfg.ring_seq_lens:
                res[n_tok] = time_cases(attention_calls(cfg, n_tok, SOLO_RING_CASES, stack),
                                        cfg.ring_iters, cfg.warmup)
                _log(f"ring P=2, L={n_tok}: done")
            return res
        if phase == "chunks_solo":
            return {**measure_chunks(cfg, stack, per_node=1), "hosts": _hosts()}
        res = {"links": {"intra": p2p_rate(cfg.link_bytes, 0, 1),
                         "inter": p2p_rate(cfg.link_bytes, 0, PER_NODE)}}
        _log(f"links: {res['links']}")
        if phase in ("main", "chunks"):
            res["latency"] = measure_latency()
            res["overlap"] = measure_overlap(cfg)
            _log(f"latency: {res['latency']}, overlap: {res['overlap']}")
        if phase == "chunks":
            res.update(measure_chunks(cfg, stack))
        else:
            cases, sent = MAIN_CASES if phase == "main" else PLACEMENT_CASES, {}
            calls = attention_calls(cfg, cfg.seq_len, cases, stack, sent)
            _log(f"timing {len(calls)} attention cases x {cfg.iters} rounds")
            res["attention_ms"] = time_cases(calls, cfg.iters, cfg.warmup)
            res["bytes"] = sent
    if phase == "main":
        res["saved_bytes"] = saved_activation_bytes(cfg.mem_seq_len)
    res["hosts"] = _hosts()
    return res


def _hosts() -> list[str]:
    """Every rank's host name, in rank order (collective)."""
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    return hosts


PHASES = ("main", "placement", "ring", "chunks", "chunks_solo")


def result_file(phase: str) -> str:
    """The file rank 0 writes into ``out`` for ``phase``."""
    return "worker.json" if phase in ("main", "placement") else f"worker_{phase}.json"


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[1] not in PHASES:
        raise SystemExit(f"usage: python -m tools.lab.cluster_worker BENCH.json "
                         f"{{{'|'.join(PHASES)}}}")
    cfg = ClusterBench.load(Path(argv[0]))
    return gloo_main(partial(measure, cfg, argv[1]), Path(cfg.out, result_file(argv[1])), 600)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
