"""Pure helpers of tools/calibrate_planner.py: link fits, the attention-only model, ranking,
the calibrated YAML, the published comparison and the compute-only ring. Single process, fast."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from usp.kernels import get_kernel
from usp.planner import ClusterSpec, load_cluster
from usp.ring import RingAttention

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cal():
    spec = importlib.util.spec_from_file_location("calibrate_planner",
                                                  ROOT / "tools/calibrate_planner.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


def test_fit_link_recovers_bandwidth_and_latency(cal):
    bw, lat = 2e9, 50e-6
    small, large = 3 * 1024, 12 * 2**20
    got_bw, got_lat = cal.fit_link(small, lat + small / bw, large, lat + large / bw)
    assert got_bw == pytest.approx(bw, rel=1e-9) and got_lat == pytest.approx(lat, rel=1e-6)
    # noise made the large message no slower: plain rate, latency = the small message's time
    assert cal.fit_link(small, 0.01, large, 0.005) == (large / 0.005, 0.01)


def _fast_links(spec: ClusterSpec) -> ClusterSpec:
    return spec.replace(intra_bw=1e18, inter_bw=1e18, intra_latency_s=1e-15,
                        inter_latency_s=1e-15, hbm_bw=1e18)


@pytest.mark.parametrize("u, r", [(1, 1), (4, 1), (2, 2), (1, 4)])
def test_attention_model_is_ideal_share_when_links_are_free(cal, u, r):
    spec = _fast_links(load_cluster("cpu_local")).replace(ranks_per_node=4)
    shape = cal.Shape(batch=1, seq_len=4096, heads=8, kv_heads=8, head_dim=64)
    p = cal.predict_attention(spec, shape, u, r, "zigzag")
    rate = spec.peak_flops * spec.mfu
    ideal_fwd = 4 * 4096**2 * 8 * 64 / 2 / (u * r) / rate  # causal, balanced: 1/P of the work
    assert p["fwd"] == pytest.approx(ideal_fwd, rel=1e-6)
    assert p["fwd_bwd"] == pytest.approx(3.5 * ideal_fwd, rel=1e-6)  # 1 + FLASH_BWD
    assert p["fwd_bwd"] == pytest.approx(p["compute"] + p["merge"] + p["a2a"] + p["ring_exposed"])


def test_attention_model_contiguous_ring_waits_for_the_last_rank(cal):
    spec = _fast_links(load_cluster("a100_ib")).replace(nodes=1)
    shape = cal.Shape(batch=1, seq_len=8 * 8192, heads=32, kv_heads=8, head_dim=128, dtype_bytes=2)
    zig = cal.predict_attention(spec, shape, 1, 8, "zigzag")["fwd"]
    contig = cal.predict_attention(spec, shape, 1, 8, "contiguous")["fwd"]
    assert contig / zig == pytest.approx((0.5 + 7) / (0.5 + 7 * 0.5))  # 15/8


def test_attention_model_on_real_spec_adds_positive_comm(cal):
    spec = load_cluster("cpu_local").replace(ranks_per_node=4)
    shape = cal.Shape(batch=1, seq_len=8192, heads=8, kv_heads=8, head_dim=64)
    for u, r in [(4, 1), (2, 2), (1, 4)]:
        p = cal.predict_attention(spec, shape, u, r)
        assert all(math.isfinite(v) and v >= 0 for v in p.values())
        assert 0 < p["fwd"] < p["fwd_bwd"]
        assert (p["a2a"] > 0) == (u > 1) and (p["ring_exposed"] > 0) == (r > 1)


def test_ranking_and_pairwise_agreement(cal):
    rounds = {"a": [1.0, 1.1, 1.0], "b": [2.0, 2.1, 1.9], "c": [1.05, 1.0, 1.2]}
    assert cal.ranking({"a": 1.0, "b": 2.0, "c": 1.05}) == ["a", "c", "b"]
    # a<b and c<b in every round; a vs c flips between rounds -> unresolved
    assert cal.pairwise_agreement(rounds, {"a": 1, "b": 3, "c": 2}) == (2, 2, 3)
    assert cal.pairwise_agreement(rounds, {"a": 3, "b": 1, "c": 2}) == (0, 2, 3)


def test_calibrated_yaml_loads_back(cal, tmp_path):
    micro = dict(a2a_bw=1.25e9, a2a_lat_s=2.5e-3, p2p_bw=9.4e8, p2p_lat_s=6.6e-4,
                 kernel_flops=3.1e10, merge_bw=3.5e9)
    spec = cal.calibrated_spec(load_cluster("cpu_local"), micro)
    assert spec.mfu == pytest.approx(3.1e10 / spec.peak_flops)
    path = tmp_path / "measured.yaml"
    path.write_text(cal.yaml_lines(spec) + "\n")
    back = load_cluster(path)
    assert (back.name, back.ranks_per_node, back.nodes, back.mem_bytes) == \
        (spec.name, spec.ranks_per_node, spec.nodes, spec.mem_bytes)
    for f in ("intra_bw", "intra_latency_s", "inter_bw", "inter_latency_s", "hbm_bw", "mfu"):
        assert getattr(back, f) == pytest.approx(getattr(spec, f), rel=1e-3), f


def test_published_rows(cal):
    rows = cal.published_rows()
    eff = {(r["hw"], r["what"].split(":")[0]): r for r in rows if "rate / (flash" in r["what"]}
    assert len(eff) == 8
    for (hw, what), r in eff.items():
        assert 0 < r["published"] < 1 and 0 < r["model"] <= 1, (hw, what)
        if what.startswith("ring_attn"):  # contiguous: the last rank does 7.5 of 8 blocks
            assert r["model"] <= 8 / 15 + 1e-9
    # the published zigzag efficiency, read off the README: 17.4 / (154.7 / 8)
    assert eff[("8xH800", "zigzag_ring fwd+bwd")]["published"] == pytest.approx(0.9, abs=2e-3)
    text = cal.format_published(rows)
    assert "8xL20" in text and "issue 40" in text


@pytest.mark.parametrize("balance", ["zigzag", "contiguous"])
def test_loopback_ring_does_the_rings_kernel_calls(cal, balance):
    calls = []

    class Counting:
        name = "counting"

        def __init__(self):
            self.inner = get_kernel("reference")

        def forward(self, q, k, v, causal, scale):
            calls.append(("fwd", q.shape[1], k.shape[1], causal))
            return self.inner.forward(q, k, v, causal, scale)

        def backward(self, dout, q, k, v, out, lse, causal, scale):
            calls.append(("bwd", q.shape[1], k.shape[1], causal))
            return self.inner.backward(dout, q, k, v, out, lse, causal, scale)

    r, S = 4, 16
    q, k, v = (torch.randn(1, S, 2, 8, requires_grad=True) for _ in range(3))
    out = RingAttention.apply(q, k, v, cal.LoopbackComm(), 2, r, True, balance, Counting(), 8**-0.5)
    out.backward(torch.randn_like(out))
    # ring rank 2 of 4: diagonal + blocks from ranks 1, 0 (before it) and 3 (after it)
    if balance == "zigzag":
        blocks = [(S, S, True), (S, S // 2, False), (S, S // 2, False), (S // 2, S, False)]
    else:  # contiguous: full blocks from earlier ranks, the later one skipped
        blocks = [(S, S, True), (S, S, False), (S, S, False)]
    assert [c[1:] for c in calls if c[0] == "fwd"] == blocks
    # backward: half the diagonal first ([:S/2] and [S/2:] causal), the other half
    # ([S/2:] x [:S/2]) after the last send, while our own dK/dV make their last hop
    h = S // 2
    assert [c[1:] for c in calls if c[0] == "bwd"] == [(h, h, True), (h, h, True), *blocks[1:],
                                                        (h, h, False)]
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("cluster, nodes, u, r, balance", [
    ("cpu_local", 2, 2, 2, "zigzag"), ("cpu_local", 2, 4, 1, "zigzag"),
    ("cpu_local", 2, 1, 4, "contiguous"), ("h100_ib", 2, 8, 2, "zigzag"),
    ("h100_ib", 2, 16, 1, "zigzag"), ("l40s_roce", 4, 4, 8, "zigzag"),
])
def test_proposed_model_reduces_to_estimate(cal, cluster, nodes, u, r, balance):
    spec = load_cluster(cluster).replace(nodes=nodes)
    shape = cal.Shape(batch=2, seq_len=64 * 1024, heads=32, kv_heads=8, head_dim=128, dtype_bytes=2)
    base = cal.predict_attention(spec, shape, u, r, balance)["fwd_bwd"]
    assert cal.proposed_attention(spec, shape, u, r, balance) == pytest.approx(base, rel=1e-12)
    # the two changes only add time: less hiding, more diagonal work
    assert cal.proposed_attention(spec, shape, u, r, balance, overlap=0.0) >= base
    assert cal.proposed_attention(spec, shape, u, r, balance, causal_tile=512) > base


def test_proposed_model_serial_ring_adds_every_transfer(cal):
    spec = load_cluster("cpu_local").replace(ranks_per_node=4, hbm_bw=1e18)
    shape = cal.Shape(batch=1, seq_len=8192, heads=8, kv_heads=8, head_dim=64)
    hidden = cal.proposed_attention(spec, shape, 1, 4, overlap=1.0)
    serial = cal.proposed_attention(spec, shape, 1, 4, overlap=0.0)
    kv = 2 * 2048 * 8 * 64 * 4  # one K/V block, fp32
    lat, bw = spec.intra_latency_s, spec.intra_bw
    # 3 forward hops, 3 backward hops carrying K/V and dK/dV; the dK/dV hop home is exposed in both
    transfers = 3 * (lat + kv / bw) + 3 * (2 * lat + 2 * kv / bw)
    assert serial - hidden == pytest.approx(transfers, rel=1e-9)


def test_causal_tile_from_rates(cal):
    full, tile, n = 38e9, 512.0, 4096
    causal = full * n / (n + tile)
    assert cal.causal_tile_from_rates(n, causal, full) == pytest.approx(tile)
    assert cal.causal_tile_from_rates(n, full * 1.1, full) == 0.0  # noise: never negative


def test_overlap_share_is_paired_and_clipped(cal):
    # rep 1: 10 ms kernel + 4 ms transfer took 11 ms together -> 3 of 4 ms hidden
    # rep 2: the same under load (everything 2x) -> still 75%; rep 3: serial -> 0%
    assert cal.overlap_share([10, 20, 10], [4, 8, 4], [11, 22, 14]) == pytest.approx(0.75)
    assert cal.overlap_share([10], [4], [16]) == 0.0  # slower than serial: clipped
    assert cal.overlap_share([10], [4], [9]) == 1.0
