"""Planner without a process group: cluster specs, cost model, feasibility rules, ranking,
the monotonic trends the physics implies, and the mesh picture."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import yaml

from usp.config import ModelConfig
from usp.planner import (
    BatchSpec,
    ClusterSpec,
    Search,
    StepPolicy,
    draw_mesh,
    estimate,
    group_span,
    load_cluster,
    plan,
    rank_grid,
)
from usp.config.cluster import GiB, cluster_dir
from usp.planner.cost import attention_cost, best_a2a_chunks, layer_matmul_params, layer_params
from usp.rules import check_seq_len
from usp.dims.heads import check_heads

LLAMA3_8B = ModelConfig(
    vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
    rope_theta=500000, tie_embeddings=False,
)
M = 1 << 20


def llama_like(n_kv_heads: int) -> ModelConfig:
    """A Llama-2-7B-shaped model with a chosen number of KV heads."""
    return ModelConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32,
                       n_kv_heads=n_kv_heads, ffn_dim=11008, tie_embeddings=False)


@pytest.fixture
def h100() -> ClusterSpec:
    return load_cluster("h100_ib")


@pytest.fixture
def l40s() -> ClusterSpec:
    return load_cluster("l40s_roce")


# ---- cluster specs -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, intra, inter, flops, mem",
    [
        ("h100_ib", 450e9, 50e9, 989e12, 80 * GiB),
        ("a100_ib", 300e9, 25e9, 312e12, 80 * GiB),
        ("l40s_roce", 25e9, 12.5e9, 362e12, 48 * GiB),
    ],
)
def test_cluster_yaml_values(name, intra, inter, flops, mem):
    c = load_cluster(name)
    assert (c.name, c.ranks_per_node) == (name, 8)
    assert (c.intra_bw, c.inter_bw, c.peak_flops, c.mem_bytes) == (intra, inter, flops, mem)
    assert 1e-6 <= c.intra_latency_s <= c.inter_latency_s <= 50e-6


def test_cluster_yaml_keys_are_the_dataclass_fields():
    fields = [f.name for f in dataclasses.fields(ClusterSpec)]
    files = sorted(cluster_dir().glob("*.yaml"))
    assert {p.stem for p in files} >= {"h100_ib", "a100_ib", "l40s_roce", "cpu_local"}
    for p in files:
        assert list(yaml.safe_load(p.read_text())) == fields, p


def test_cluster_yaml_validates_against_structured_schema():
    from omegaconf import OmegaConf  # what the CLI will do with a ConfigStore schema

    for p in sorted(cluster_dir().glob("*.yaml")):
        cfg = OmegaConf.merge(OmegaConf.structured(ClusterSpec), OmegaConf.load(p))
        assert ClusterSpec(**OmegaConf.to_container(cfg)) == load_cluster(p)


def test_cpu_local_is_one_small_node():
    c = load_cluster("cpu_local")
    assert (c.nodes, c.ranks_per_node) == (1, 2)
    assert c.peak_flops < 1e12 and c.intra_bw < 10e9 and c.intra_latency_s >= 10e-6


def test_load_cluster_rejects_bad_files(tmp_path):
    good = yaml.safe_load((cluster_dir() / "h100_ib.yaml").read_text())
    (tmp_path / "extra.yaml").write_text(yaml.safe_dump({**good, "nvlink": 1}))
    with pytest.raises(ValueError, match=r"unknown keys \['nvlink'\]"):
        load_cluster(tmp_path / "extra.yaml")
    del good["mfu"]
    (tmp_path / "short.yaml").write_text(yaml.safe_dump(good))
    with pytest.raises(ValueError, match=r"missing keys \['mfu'\]"):
        load_cluster(tmp_path / "short.yaml")
    with pytest.raises(ValueError, match="known clusters: .*h100_ib"):
        load_cluster("tpu_pod")


@pytest.mark.parametrize("field, value", [("inter_bw", 0.0), ("ranks_per_node", -8), ("mfu", 1.5),
                                          ("gpus_per_nic", 0), ("gpus_per_intra_link", 1.5)])
def test_cluster_spec_rejects_nonsense(field, value):
    with pytest.raises(ValueError, match=field):
        ClusterSpec(**{field: value})


# ---- where ranks sit -----------------------------------------------------------------------


@pytest.mark.parametrize("dp, ring, uly", [(1, 4, 8), (2, 2, 4), (1, 2, 16)])
def test_rank_grid_matches_mesh_convention(dp, ring, uly):
    world = dp * ring * uly
    inner = torch.arange(world).reshape(dp, ring, uly).tolist()
    outer = torch.arange(world).reshape(dp, uly, ring).transpose(1, 2).tolist()
    assert rank_grid(dp, ring, uly, 8, "ulysses_inner") == inner
    assert rank_grid(dp, ring, uly, 8, "ring_inner") == outer


def test_group_span():
    # ulysses 8 fills a node; its ring of 4 joins local rank j of each of the 4 nodes
    assert group_span(1, 4, 8, 8, "ulysses", "ulysses_inner").remote_peers == 0
    ring = group_span(1, 4, 8, 8, "ring", "ulysses_inner")
    assert (ring.nodes, ring.crosses) == (4, True)
    # ulysses 16 on 8-GPU nodes: 7 peers on the node, 8 on the other one
    u16 = group_span(1, 2, 16, 8, "ulysses", "ulysses_inner")
    assert (u16.local_peers, u16.remote_peers, u16.nodes) == (7, 8, 2)
    # one node: ring 2 x ulysses 4 stays inside it
    assert group_span(1, 2, 4, 8, "ring", "ulysses_inner").crosses is False
    # ring_inner puts the ring inside the node and spreads ulysses over nodes
    assert group_span(1, 4, 8, 8, "ring", "ring_inner").crosses is False
    assert group_span(1, 4, 8, 8, "ulysses", "ring_inner").remote_peers == 6


@pytest.mark.parametrize("u, r, placement, uly, ring", [
    # (intra_senders, inter_senders) of the busiest node, 2 nodes x 2 GPUs
    (2, 2, "ulysses_inner", (2, 0), (0, 2)),  # both rings leave every node at once
    (2, 2, "ring_inner", (0, 2), (2, 0)),
    (1, 4, "ulysses_inner", (0, 0), (1, 1)),  # 0->1 stays, 1->2 leaves node 0
    (4, 1, "ulysses_inner", (2, 2), (0, 0)),
])
def test_group_span_counts_concurrent_senders(u, r, placement, uly, ring):
    us = group_span(1, r, u, 2, "ulysses", placement)
    rs = group_span(1, r, u, 2, "ring", placement)
    assert (us.intra_senders, us.inter_senders) == uly
    assert (rs.intra_senders, rs.inter_senders) == ring


def test_link_bw_splits_a_shared_link_only():
    rail = ClusterSpec(ranks_per_node=8, inter_bw=50e9, intra_bw=400e9)
    assert rail.link_bw(True, 8) == rail.link_bw(True, 1) == 50e9  # one NIC per GPU
    one_nic = rail.replace(gpus_per_nic=8)
    assert one_nic.link_bw(True, 1) == 50e9  # alone on the NIC
    assert one_nic.link_bw(True, 4) == 12.5e9
    two_nics = rail.replace(gpus_per_nic=4)
    assert two_nics.link_bw(True, 2) == 50e9 and two_nics.link_bw(True, 8) == 12.5e9
    bus = rail.replace(gpus_per_intra_link=8)
    assert bus.link_bw(False, 2) == 200e9 and bus.link_bw(True, 8) == 50e9


def test_shared_nic_slows_layouts_whose_ranks_leave_the_node_together():
    """2 nodes x 2 GPUs, one NIC per node (like tools.simcluster): ring (2,2) has both
    GPUs of a node sending off it every step, ring (1,4) only one."""
    m = ModelConfig()
    rail = load_cluster("cpu_local").replace(ranks_per_node=2, nodes=2, inter_bw=40e6,
                                              intra_bw=400e6, overlap=1.0,
                                              intra_latency_s=1e-9, inter_latency_s=1e-9)
    nic = rail.replace(gpus_per_nic=2)
    kw = dict(global_batch=2, dtype_bytes=4, act_checkpoint=False)

    def cost(spec, u, r):
        return estimate(m, spec, 2048, 1, r, u, **kw)

    r22, n22 = cost(rail, 2, 2), cost(nic, 2, 2)
    assert n22.ring_comm_s == pytest.approx(2 * r22.ring_comm_s, rel=1e-4)
    assert n22.a2a_s == r22.a2a_s  # its all-to-all stays inside the node
    assert cost(nic, 1, 4).ring_comm_s == cost(rail, 1, 4).ring_comm_s
    assert cost(nic, 4, 1).a2a_s > 1.5 * cost(rail, 4, 1).a2a_s
    # rail-optimised: (2,2) is the better layout; one NIC per node: (1,4) is
    assert cost(rail, 2, 2).step_s < cost(rail, 1, 4).step_s
    assert cost(nic, 1, 4).step_s < cost(nic, 2, 2).step_s


# ---- cost model ------------------------------------------------------------------------------


def test_a2a_volume_matches_gqa_formula(h100):
    L, d, b = M, LLAMA3_8B.head_dim, 2
    for u, r in [(4, 8), (8, 4), (16, 2)]:
        T = L / (u * r)
        kv = check_heads(32, 8, u)  # 2, 1, 1 (replicated)
        qkv_in = (u - 1) * T * (32 / u + 2 * kv) * d
        out = (u - 1) * T * (32 / u) * d
        c = estimate(LLAMA3_8B, h100, L, 1, r, u)
        assert c.kv_per_rank == kv
        assert c.a2a_bytes == pytest.approx(2 * (qkv_in + out) * b)  # fwd + bwd mirror


def test_no_comm_without_the_axis(h100):
    only_ring = estimate(LLAMA3_8B, h100, M, 1, 32, 1)
    only_uly = estimate(LLAMA3_8B, h100, M, 1, 1, 32)
    assert only_ring.a2a_s == only_ring.a2a_bytes == 0 and only_ring.a2a_link == "-"
    assert only_uly.ring_comm_s == only_uly.ring_bytes == only_uly.merge_s == 0
    assert only_uly.ring_link == "-"


def test_attention_flops_causal_half_and_zigzag_balance(h100):
    full = estimate(LLAMA3_8B, h100, 1 << 16, 1, 1, 8, causal=False)
    causal = estimate(LLAMA3_8B, h100, 1 << 16, 1, 1, 8, causal=True)
    assert causal.attn_s == pytest.approx(full.attn_s / 2)
    # ring r: zigzag does r half blocks; contiguous waits for the last rank's full blocks
    r = 4
    zig = estimate(LLAMA3_8B, h100, 1 << 16, 1, r, 8, balance="zigzag")
    con = estimate(LLAMA3_8B, h100, 1 << 16, 1, r, 8, balance="contiguous")
    assert zig.attn_s == pytest.approx(causal.attn_s / r)  # balanced: 1/r of the work each
    assert con.attn_s / zig.attn_s == pytest.approx((0.5 + (r - 1)) / (0.5 * r))


def test_activation_memory_scales_with_sequence_share(h100):
    # same ulysses, ring doubled: every activation buffer holds half the tokens (short
    # enough for one attention backward call on both: usp.dims.work)
    a = estimate(LLAMA3_8B, h100, 1 << 16, 1, 2, 4)
    b = estimate(LLAMA3_8B, h100, 1 << 16, 1, 4, 4)
    assert a.mem_act_bytes / b.mem_act_bytes == pytest.approx(2.0)


def test_fsdp_shards_state_over_dp_times_sp(h100):
    n = LLAMA3_8B.num_params()
    rep = estimate(LLAMA3_8B, h100, 1 << 16, 2, 4, 4, global_batch=2, fsdp=False)
    sh = estimate(LLAMA3_8B, h100, 1 << 16, 2, 4, 4, global_batch=2, fsdp=True)
    assert rep.mem_state_bytes == 16 * n  # bf16 param + grad, fp32 master + Adam m, v
    # sharded over 32 ranks, plus what FSDP2 holds unsharded at the peak: the root unit
    # (embedding + LM head: bf16 parameter and gradient) and at most three blocks' worth of
    # gathered parameters / gradients (bf16 + an fp32 copy)
    blk = layer_params(LLAMA3_8B)
    root = n - 32 * blk
    assert 16 * n / 32 + 4 * root <= sh.mem_state_bytes <= 16 * n / 32 + 4 * root + 3 * 6 * blk
    assert sh.mem_state_bytes < rep.mem_state_bytes / 10


def test_layer_params_follow_the_model_config():
    # Llama-3-8B: q, o 4096x4096; k, v 4096x1024; gate, up, down 4096x14336; 2 norms
    assert layer_matmul_params(LLAMA3_8B) == 2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    assert layer_params(LLAMA3_8B) == layer_matmul_params(LLAMA3_8B) + 2 * 4096
    emb = 2 * 128256 * 4096  # untied input and output embeddings
    assert LLAMA3_8B.num_params() == 32 * layer_params(LLAMA3_8B) + emb + 4096  # + final norm


def test_attention_cost_is_the_attention_part_of_estimate(h100):
    """``estimate``'s attention fields are ``attention_cost`` per layer x layers x sequences
    per dp rank, with the recompute forward under activation checkpointing."""
    for ckpt, n_fwd in ((True, 2), (False, 1)):
        c = estimate(LLAMA3_8B, h100, 1 << 18, 2, 4, 8, global_batch=6, act_checkpoint=ckpt)
        a = attention_cost(h100, 1 << 18, 32, 8, 128, 8, 4, dp=2, n_fwd=n_fwd)
        n = 3 * 32  # sequences per dp rank x layers
        assert (c.attn_s, c.a2a_s, c.merge_s, c.ring_exposed_s) == pytest.approx(
            (n * a.compute_s, n * a.a2a_s, n * a.merge_s, n * a.ring_exposed_s), rel=1e-12)
        assert (c.a2a_link, c.ring_link) == (a.a2a_link, a.ring_link)
    with pytest.raises(ValueError, match="balance in"):
        attention_cost(h100, 1 << 18, 32, 8, 128, 8, 4, balance="zig")
    with pytest.raises(ValueError, match="causal_tile >= 0"):
        attention_cost(h100, 1 << 18, 32, 8, 128, 8, 4, causal_tile=-1)


def test_per_document_is_priced_as_balanced_causal_work(h100):
    """``per_document`` evens out the work of packed rows (``usp.dims.balance``): priced as
    zigzag prices one causal triangle, half a block per later step; contiguous pays whole."""
    kw = dict(dp=2)
    zig, per, con = (attention_cost(h100, 1 << 18, 32, 8, 128, 8, 4, balance=b, **kw)
                     for b in ("zigzag", "per_document", "contiguous"))
    assert per == zig and per.compute_s < con.compute_s


def test_step_breakdown_is_consistent(h100):
    c = estimate(LLAMA3_8B, h100, M, 1, 4, 8)
    assert c.step_s == pytest.approx(
        c.compute_s + c.a2a_s + c.ring_exposed_s + c.merge_s + c.grad_exposed_s
    )
    assert c.ring_comm_s > 0 and 0 <= c.ring_tail_s <= c.ring_exposed_s <= c.ring_comm_s
    assert 0 < c.grad_exposed_s <= c.grad_s
    assert 0 < c.comm_share < 0.05  # 1M tokens: attention compute dominates


def test_ulysses_across_nodes_pays_the_inter_node_link(h100):
    inside = estimate(LLAMA3_8B, h100, M, 1, 2, 16)
    flat = estimate(LLAMA3_8B, h100.replace(inter_bw=h100.intra_bw), M, 1, 2, 16)
    assert inside.a2a_link == "inter"
    # 8 of 15 peers are remote: the a2a runs at inter_bw instead of intra_bw (9x slower)
    assert inside.a2a_s / flat.a2a_s > 5


def test_ring_exposure_follows_block_compute_vs_transfer(l40s):
    """Per ring step, attention is ~blk^2 and K/V transfer ~blk (blk = L/r tokens), so the
    transfer hides once blk > blk*. Backward is the binding side: 2.5 x 2 blk^2 (Hq/u) d
    FLOPs against K,V (bf16) + dK,dV (fp32) = blk * 2 kv d (2 + 4) bytes."""
    m, u, r, bw = llama_like(4), 4, 4, 3e9
    cl = l40s.replace(inter_bw=bw)
    rate = cl.peak_flops * cl.mfu
    hq_u, kv = 32 / u, check_heads(32, 4, u)
    blk_star = (2 * kv * (2 + 4)) * rate / (2.5 * 2 * hq_u * bw)  # tokens, ~16k here
    assert 10_000 < blk_star < 20_000
    share = []
    for L in [1 << 14, 1 << 15, 1 << 16, 1 << 17, 1 << 18]:
        c = estimate(m, cl, L, 1, r, u)
        waits = c.ring_exposed_s - c.ring_tail_s  # the final dK/dV hop is always exposed
        share.append(waits / c.ring_comm_s)
        if L / r < blk_star / 2:
            assert waits > 0, L
        if L / r > 2 * blk_star:
            assert waits == 0, L
    assert share == sorted(share, reverse=True) and share[0] > 0.3 and share[-1] == 0
    # the last hop, one fp32 dK/dV block of L/r tokens x kv heads per layer, hides behind
    # the backward of half the owner's diagonal block (a causal half of blk^2)
    tails = []
    for L in [1 << 14, 1 << 18]:
        c, blk = estimate(m, cl, L, 1, r, u), L / r
        hop = cl.inter_latency_s + 2 * blk * kv * 128 * 4 / bw
        half_diag = 2.5 * (4 * blk * blk * hq_u * 128 / rate) / 4
        assert c.ring_tail_s == pytest.approx(32 * max(0.0, hop - half_diag))
        tails.append(c.ring_tail_s)
    assert tails[0] > 0 == tails[1]


# ---- plan: rules ------------------------------------------------------------------------------


def _reason(fn, *args) -> str:
    with pytest.raises(ValueError) as e:
        fn(*args)
    return str(e.value)


def test_plan_enumerates_every_layout_once(h100):
    p = plan(llama_like(32), h100.replace(mem_bytes=1e15), 1 << 17,
             batch=BatchSpec(global_batch=32))
    seen = [c.degrees for c in p.candidates] + [(x.dp, x.ring, x.ulysses) for x in p.dropped]
    expected = {(32 // (u * r), r, u) for u in [1, 2, 4, 8, 16, 32] for r in [1, 2, 4, 8, 16, 32]
                if 32 % (u * r) == 0}
    assert sorted(seen) == sorted(expected)
    per_seq = [c.cost.step_s / c.global_batch for c in p.candidates]
    assert per_seq == sorted(per_seq)


def test_the_table_compares_time_per_sequence_in_columns_named_by_unit(h100):
    """A lower time per pass of a smaller dp read as worse when the column compared was
    another unit: 'vs best' is of s/seq, printed beside it; s/pass covers seqs sequences."""
    p = plan(llama_like(32), h100.replace(nodes=4), 8192, batch=BatchSpec(per_dp_rank=1))
    lines = p.format_table(show_dropped=False).splitlines()
    assert lines[1].split()[:9] == ["#", "dp", "ring", "ulysses", "s/seq", "vs", "best",
                                    "s/pass", "seqs"]
    rows = [line.split() for line in lines[2:2 + len(p.candidates)]]
    per_seq = [float(r[4]) for r in rows]
    for r in rows:
        assert 1 + float(r[5].rstrip("%")) / 100 == pytest.approx(float(r[4]) / per_seq[0],
                                                                  rel=2e-3)
        assert float(r[4]) == pytest.approx(float(r[6]) / int(r[7]), rel=2e-3)
    # the case that read wrong: a pass of fewer sequences is quicker, yet ranked below
    assert any(float(a[6]) > float(b[6]) and int(a[7]) > int(b[7])
               for a, b in zip(rows, rows[1:]))
    assert lines[2 + len(p.candidates)].startswith("(s/seq: predicted seconds per sequence")


def test_heads_rule_drops_with_check_heads_message(h100):
    m = ModelConfig(dim=1536, n_heads=6, n_kv_heads=2, ffn_dim=4096, n_layers=4)
    p = plan(m, h100.replace(nodes=1), 1 << 15)
    heads = {x.ulysses: x.reason for x in p.dropped if x.rule == "heads"}
    assert heads == {8: _reason(check_heads, 6, 2, 8)}  # 6 query heads over 8 ranks
    assert (1, 2, 4) in [c.degrees for c in p.candidates]  # 6 over 4: an uneven split


def test_kv_replication_is_a_note_not_a_drop(h100):
    p = plan(llama_like(4), h100.replace(nodes=1), 1 << 18)
    c8 = next(c for c in p.candidates if c.ulysses == 8)
    assert c8.cost.kv_per_rank == 1
    assert "KV heads replicated x2 (ulysses 8, 4 KV heads)" in c8.notes
    assert not any("replicated" in n for c in p.candidates if c.ulysses <= 4 for n in c.notes)


def test_seq_len_rule_drops_with_check_seq_len_message(h100):
    # 48 tokens: zigzag needs 2 x ring x ulysses | 48, so sp 16 fails while sp 8 works
    m = ModelConfig(n_heads=16, n_kv_heads=16, dim=256)
    p = plan(m, h100.replace(nodes=2), 48, batch=BatchSpec(global_batch=2))
    sp16 = [x for x in p.dropped if x.dp == 1]
    assert len(sp16) == 5  # every (ring, ulysses) with ring x ulysses = 16
    for x in sp16:
        assert x.reason == _reason(check_seq_len, 48, x.ulysses, x.ring, "zigzag")
    assert p.candidates and all(c.dp == 2 for c in p.candidates)
    # contiguous only needs ring x ulysses | 48, which 16 divides
    q = plan(m, h100.replace(nodes=2), 48, search=Search(balance="contiguous"),
             batch=BatchSpec(global_batch=2))
    assert any(c.dp == 1 for c in q.candidates)


def test_batch_rule(h100):
    p = plan(LLAMA3_8B, h100, 1 << 17, batch=BatchSpec(global_batch=2))
    assert {c.dp for c in p.candidates} <= {1, 2}
    d4 = [x for x in p.dropped if x.dp == 4]
    assert d4 and "global batch 2 sequences does not split over dp 4" in d4[0].reason


def test_memory_rule_drops_what_does_not_fit(h100):
    """A layout is dropped exactly when its memory_split peak exceeds 90% of the GPU; the
    refusal names the largest term and what lowers it."""
    roomy = plan(LLAMA3_8B, h100.replace(mem_bytes=1e15), M)
    totals = {c.degrees: c.memory.total for c in roomy.candidates}
    cut = sorted(totals.values())[len(totals) // 2]
    p = plan(LLAMA3_8B, h100.replace(mem_bytes=cut / 0.9), M)
    over = {(x.dp, x.ring, x.ulysses): x.reason for x in p.dropped if x.rule == "memory"}
    assert set(over) == {k for k, t in totals.items() if t > cut}
    assert all("per rank at its peak" in r and "largest term" in r for r in over.values())
    assert all(c.memory.total <= cut for c in p.candidates)
    with pytest.raises(ValueError, match=r"(?s)no feasible layout .*largest term logits"):
        plan(LLAMA3_8B, h100.replace(mem_bytes=20 * GiB), M)
    # replicated (no FSDP) Llama-8B state alone is 16 B/param = 120 GiB
    with pytest.raises(ValueError, match=r"largest term state 119\.\d GiB; try more ranks"):
        plan(LLAMA3_8B, h100, 1 << 15, batch=BatchSpec(global_batch=32),
             step=StepPolicy(fsdp=False))


def test_ulysses_spanning_nodes_is_a_warning_not_a_drop(h100):
    p = plan(LLAMA3_8B, h100, M)
    c16 = p.find(1, 2, 16)
    assert c16 is not None and c16.cost.a2a_link == "inter"
    assert any(n.startswith("WARNING ulysses spans 2 nodes") for n in c16.notes)
    assert not any("WARNING" in n for n in p.find(1, 4, 8).notes)


def test_fixed_degrees(h100):
    p = plan(LLAMA3_8B, h100, M, search=Search(ulysses=4))
    assert [c.degrees for c in p.candidates] == [(1, 8, 4)]
    q = plan(LLAMA3_8B, h100, 1 << 17, search=Search(ring=2), batch=BatchSpec(global_batch=4))
    assert {c.ring for c in q.candidates} == {2}
    assert {c.degrees for c in q.candidates} == {(4, 2, 4), (2, 2, 8), (1, 2, 16)}
    with pytest.raises(ValueError, match="does not divide world 32"):
        plan(LLAMA3_8B, h100, M, search=Search(ulysses=3))
    with pytest.raises(ValueError, match=r"ulysses \(8\) x ring \(8\) = 64 does not divide"):
        plan(LLAMA3_8B, h100, M, search=Search(ulysses=8, ring=8))


def test_plan_options_refuse_bad_values_when_made():
    """``Search`` and ``BatchSpec`` check themselves, so a bad value fails before any
    layout is judged; ``Search.layouts`` keeps only the fixed degrees."""
    with pytest.raises(ValueError, match=r"ring degree must be a positive integer .*got 0"):
        Search(ring=0)
    with pytest.raises(ValueError, match="placement"):
        Search(placement="bogus")
    with pytest.raises(ValueError, match=r"batch_per_dp_rank=0 and global_batch=None must"):
        BatchSpec(per_dp_rank=0)
    with pytest.raises(ValueError, match="global batch 6 sequences does not split over dp 4"):
        BatchSpec(global_batch=6).for_dp(4)
    assert BatchSpec(global_batch=8).for_dp(4) == 2 and BatchSpec(3).for_dp(4) == 3
    assert Search(dp=2).layouts(8) == [(2, 4, 1), (2, 2, 2), (2, 1, 4)]
    assert len(Search().layouts(8)) == 10  # every (dp, ring, ulysses) with product 8


def test_world_and_nodes(h100):
    assert plan(LLAMA3_8B, h100.replace(nodes=1), 1 << 17).world == 8
    assert plan(LLAMA3_8B, h100, 1 << 17, world=16).cluster.nodes == 2
    with pytest.raises(ValueError, match="whole number of 8-GPU nodes"):
        plan(LLAMA3_8B, h100, 1 << 17, world=12)


# ---- plan: the answers ---------------------------------------------------------------------


def test_llama3_8b_1m_on_4x8_h100_is_ulysses8_ring4(h100):
    p = plan(LLAMA3_8B, h100, M, batch=BatchSpec(global_batch=1), step=StepPolicy(fsdp=True))
    assert p.best.degrees == (1, 4, 8)
    assert p.reason.startswith("ulysses 8 x ring 4 x dp 1: ulysses capped at 8 = KV heads")
    assert "ring 4 across nodes, K/V and dK/dV transfers hidden behind attention" in p.reason
    best = p.best.cost
    assert best.ring_exposed_s == best.ring_tail_s == 0 < best.ring_comm_s
    assert best.mem_bytes < 0.9 * 80 * GiB
    # the neighbours lose for the stated reasons: more ring steps to merge, or a2a over IB
    u4, u16 = p.find(1, 8, 4).cost, p.find(1, 2, 16).cost
    assert u4.merge_s > p.best.cost.merge_s and u16.a2a_s > 5 * p.best.cost.a2a_s
    table = p.format_table()
    assert table.splitlines()[2].split()[:4] == ["1", "1", "4", "8"]
    assert "reason: ulysses 8 x ring 4" in table


def test_four_kv_heads_on_8_gpu_nodes_explains_replication_or_ring(h100):
    m = dataclasses.replace(LLAMA3_8B, n_kv_heads=4)
    p = plan(m, h100, 1 << 18, search=Search(dp=1))
    b = p.best
    if b.ulysses > 4:  # KV replication: say so, and against which ring
        assert "ulysses 8 = GPUs per node > 4 KV heads: KV heads replicated x2" in p.reason
        assert "replication beats ring 8 with ulysses 4" in p.reason
        assert p.find(1, 8, 4).cost.step_s > b.cost.step_s
    else:  # a larger ring instead: say replication was the alternative
        assert b.ring >= 8 and "needs KV replication x2" in p.reason


def test_slower_inter_node_link_pushes_toward_larger_ulysses(l40s):
    uly = [plan(llama_like(4), l40s.replace(inter_bw=bw, nodes=2), 1 << 16,
                search=Search(dp=1)).best.ulysses for bw in [12.5e9, 6e9, 3e9, 1.5e9, 0.75e9]]
    assert uly == sorted(uly) and uly[0] < uly[-1]
    assert max(uly) <= 8  # it grows inside the node, not across it


def test_fewer_kv_heads_push_toward_ring(l40s):
    rings = [plan(llama_like(h), l40s.replace(nodes=2), 1 << 16, search=Search(dp=1)).best.ring
             for h in [32, 16, 8, 4, 2, 1]]
    assert rings == sorted(rings) and rings[0] < rings[-1]


def test_longer_sequences_shift_toward_ring(l40s):
    cl = l40s.replace(inter_bw=3e9)
    rings = [plan(llama_like(4), cl.replace(nodes=2), 1 << k, search=Search(dp=1)).best.ring
             for k in range(13, 20)]
    assert rings == sorted(rings) and rings[0] < rings[-1]


def test_format_table_lists_dropped_with_reasons(h100):
    p = plan(LLAMA3_8B, h100, M)
    lines = p.format_table().splitlines()
    assert lines[0] == ("plan: world 32 (4 x 8 on h100_ib), seq_len 1048576, batch 1 per dp "
                        "rank, zigzag")
    assert "dropped:" in lines
    assert sum("largest term logits" in ln for ln in lines) == len(p.dropped) == 15
    assert "dropped:" not in p.format_table(show_dropped=False)


# ---- picture ----------------------------------------------------------------------------------


def test_draw_mesh_text():
    text = str(draw_mesh(1, 4, 8, 8))
    lines = text.splitlines()
    assert lines[1].split()[:3] == ["node", "0:", "0:U0/R0"]
    assert lines[2].split()[2:4] == ["8:U1/R0", "9:U1/R1"]
    assert "R0 = 0 -> 8 -> 16 -> 24 -> 0 on nodes [0, 1, 2, 3], 4 of 4 hops cross nodes" in text
    assert "U0 = [0, 1, 2, 3, 4, 5, 6, 7] on node 0" in text and "span nodes" not in text
    wide = str(draw_mesh(1, 2, 16, 8))
    assert "2 span nodes (all-to-all over the inter-node link)" in wide
    inner = str(draw_mesh(2, 2, 4, 8, "ring_inner"))
    assert "R0 = 0 -> 1 -> 0 on node 0, 0 of 2 hops cross nodes" in inner
    assert "U0 = [0, 2, 4, 6] on node 0" in inner and "dp groups: 8 x 2 ranks" in inner


def test_draw_mesh_png(tmp_path):
    path = draw_mesh(1, 4, 8, 8).save_png(tmp_path / "mesh.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


# ---- pipelined ulysses all-to-alls (a2a_chunks) ---------------------------------------------


def test_unpipelined_all_to_all_is_all_exposed(h100):
    a = attention_cost(h100, 1 << 15, 32, 8, 128, 8, 1)
    assert a.a2a_chunks == 1 and a.a2a_s == a.a2a_comm_s > 0


def test_pipelined_all_to_all_hides_behind_the_ring_and_pays_latency(h100):
    one = attention_cost(h100, 1 << 18, 32, 8, 128, 8, 1)
    four = attention_cost(h100, 1 << 18, 32, 8, 128, 8, 1, a2a_chunks=4)
    # compute-bound: only the first stage in and the last stage out wait, about 2 of 8 parts
    assert four.a2a_s < 0.3 * one.a2a_s
    assert four.a2a_comm_s > one.a2a_comm_s  # 4x the messages, each with its latency
    assert four.compute_s == one.compute_s
    # nothing hides when no transfer overlaps compute: pipelining only adds latency
    none = attention_cost(h100, 1 << 18, 32, 8, 128, 8, 1, a2a_chunks=4, overlap=0.0)
    assert none.a2a_s == pytest.approx(none.a2a_comm_s) and none.a2a_s > one.a2a_s


def test_shared_kv_heads_cost_ring_traffic(h100):
    # Llama-3-8B on ulysses 8: one KV head per rank serves every stage, so each stage's
    # ring pass carries it again; the all-to-all bytes stay
    one = estimate(LLAMA3_8B, h100, 1 << 18, 1, 2, 8)
    two = estimate(LLAMA3_8B, h100, 1 << 18, 1, 2, 8, a2a_chunks=2)
    assert two.a2a_bytes == one.a2a_bytes and two.ring_bytes == 2 * one.ring_bytes
    assert two.ring_comm_s > one.ring_comm_s and two.a2a_chunks == 2


def test_best_a2a_chunks(h100):
    args = (32, 8, 128, 8, 1)
    assert best_a2a_chunks(h100, 1 << 18, *args) == 1  # the ulysses group inside a node
    across = h100.replace(ranks_per_node=4, nodes=2)  # u=8 spans two nodes of 4
    assert best_a2a_chunks(across, 1 << 18, *args) == 4  # compute-bound: the most stages
    slow_start = across.replace(inter_latency_s=1e-3)  # every message costs a millisecond
    assert best_a2a_chunks(slow_start, 1 << 12, *args) == 1
    assert best_a2a_chunks(h100, 1 << 18, 32, 8, 128, 1, 8) == 1  # no ulysses group
    assert best_a2a_chunks(across, 1 << 18, *args, max_chunks=2) == 2
    with pytest.raises(ValueError, match="a2a_chunks=8 > 4 query heads"):
        attention_cost(h100, 1 << 18, *args, a2a_chunks=8)


def test_plan_chooses_a2a_chunks_per_layout(h100):
    p = plan(LLAMA3_8B, h100, 1 << 18, world=8, search=Search(a2a_chunks="auto"))
    for c in p.candidates:
        want = 1 if c.ulysses == 1 else best_a2a_chunks(
            h100.replace(nodes=1), 1 << 18, 32, 8, 128, c.ulysses, c.ring, dp=c.dp, n_fwd=2)
        assert c.cost.a2a_chunks == want, c.label()
    fixed = plan(LLAMA3_8B, h100, 1 << 18, world=8, search=Search(a2a_chunks=8))
    assert {c.ulysses for c in fixed.candidates} == {1, 2, 4}  # 32 heads / 8 < 8 stages
    assert any(d.rule == "a2a_chunks" and "a2a_chunks=8 > 4" in d.reason for d in fixed.dropped)


def test_a_global_batch_in_tokens_drops_the_dp_that_cannot_make_it(h100):
    """trainer.global_batch_tokens of 8 sequences a step: dp 16 and 32 cannot accumulate
    whole micro-batches to it and are dropped by the batch rule; dp 8 and fewer stay."""
    h100 = h100.replace(nodes=4)
    model = dataclasses.replace(LLAMA3_8B, loss_chunk=8192, mlp_tiles=4)
    free = plan(model, h100, 131072, world=32, batch=BatchSpec(per_dp_rank=1))
    assert {c.dp for c in free.candidates} >= {16, 32}
    eight = plan(model, h100, 131072, world=32,
                 batch=BatchSpec(per_dp_rank=1, step_sequences=8))
    assert max(c.dp for c in eight.candidates) == 8
    dropped = {(d.dp, d.rule) for d in eight.dropped}
    assert {(16, "batch"), (32, "batch")} <= dropped
    assert not any(d.dp <= 8 and d.rule == "batch" for d in eight.dropped)


def test_a_forward_pass_ignores_the_training_batch_in_tokens():
    """usp-eval's forward (``forward_only``) runs no optimizer step: a training config's
    ``trainer.global_batch_tokens`` constrains no dp there."""
    from usp.config import ParallelConfig, RecallData, RunConfig, TrainerConfig
    from usp.planner.report import plan_run

    model = dataclasses.replace(LLAMA3_8B, loss_chunk=8192, mlp_tiles=4)
    cfg = RunConfig(model=model, data=RecallData(seq_len=131072, batch_per_dp_rank=1),
                    parallel=ParallelConfig(ulysses_degree="auto", ring_degree="auto"),
                    trainer=TrainerConfig(global_batch_tokens=3 * 131072, dtype="bf16",
                                          activation_checkpointing=True))
    spec = load_cluster("h100_ib").replace(nodes=1)
    assert {c.dp for c in plan_run(cfg, spec, 8).candidates} <= {1}  # 3 sequences: dp 1 only
    assert {c.dp for c in plan_run(cfg, spec, 8, forward_only=True).candidates} == {1, 2, 4, 8}


def test_local_layers_cost_their_band_and_the_table_says_so(h100, capsys):
    """Gemma 3's mix (5 local : 1 global, a 1,024-token window) at 128K: each local layer's
    attention is priced at its band (L*w - w^2/2 of L^2/2), the full layers as before; the
    contiguous ring of a local layer makes one hop, the zigzag one every hop; usp-plan prints
    the mix. A window as long as the sequence is a full layer."""
    from dataclasses import replace

    import usp.cli as cli
    from hydra import compose, initialize_config_dir
    from usp.planner.traffic import band_share

    L, w = 131072, 1024
    assert band_share(8, 2) == (8 * 2 - 2) / 32 and band_share(L, L) == band_share(L, None) == 1
    full = replace(LLAMA3_8B, n_layers=6)
    mixed = replace(full, sliding_window=w, layer_types=["sliding_attention"] * 5
                    + ["full_attention"])
    whole = replace(full, sliding_window=L, full_attention_every=0)
    for balance in ("zigzag", "contiguous"):
        kw = dict(seq_len=L, dp=1, ring=4, ulysses=2, balance=balance)
        f, m = estimate(full, h100, **kw), estimate(mixed, h100, **kw)
        assert estimate(whole, h100, **kw) == f
        assert m.attn_s == pytest.approx(f.attn_s * (1 + 5 * band_share(L, w)) / 6, rel=1e-9)
        hops = 3 if balance == "zigzag" else 1  # of the ring's 3 for a local layer
        assert m.ring_bytes == pytest.approx(f.ring_bytes * (1 + 5 * hops / 3) / 6, rel=1e-9)
        assert m.step_s < f.step_s
    with initialize_config_dir(config_dir=cli.CONFIG_DIR, version_base="1.3"):
        cfg = cli.to_config(compose("plan", overrides=[
            "model=llama3_8b", "cluster=h100_ib", "model.n_layers=6", f"model.sliding_window={w}",
            "model.full_attention_every=6", f"data.seq_len={L}"]))
    cli._plan(cfg)
    assert (f"layers: 1 full + 5 local (window {w}: attention {band_share(L, w):.3g} of a full "
            "layer's); the step time prices each kind") in capsys.readouterr().out
