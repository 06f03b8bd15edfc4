"""Calibration of the cost model (``usp.planner.calibration``, ``usp.planner.published``) and
the timing loops behind it (``usp.bench.timing``): fits recover known links and rates, the
attention model matches hand-derived times, evaluation ranks and compares as stated, the
loops time what they say. Single process (the timing loops run on a stand-in ``dist``)."""

import math
import time
import types

import pytest
import torch

from usp.bench import timing
from usp.bench.timing import LoopbackComm, overlap_times, round_robin, timed
from usp.kernels import get_kernel
from usp.planner import ClusterSpec, load_cluster
from usp.planner.calibration import (
    PROBE,
    PROBE_NC,
    AttentionShape,
    CalibrationSetup,
    calibrated_spec,
    causal_tile_from_rates,
    compare_predictions,
    fit_link,
    format_report,
    overlap_share,
    pairwise_agreement,
    predict_attention,
    ranking,
    yaml_lines,
)
from usp.planner.published import format_published, published_rows
from usp.ring import RingAttention, RingPlan


def test_fit_link_recovers_bandwidth_and_latency():
    bw, lat = 2e9, 50e-6
    small, large = 3 * 1024, 12 * 2**20
    got_bw, got_lat = fit_link(small, lat + small / bw, large, lat + large / bw)
    assert got_bw == pytest.approx(bw, rel=1e-9) and got_lat == pytest.approx(lat, rel=1e-6)
    # noise made the large message no slower: plain rate, latency = the small message's time
    assert fit_link(small, 0.01, large, 0.005) == (large / 0.005, 0.01)


def _fast_links(spec: ClusterSpec) -> ClusterSpec:
    return spec.replace(intra_bw=1e18, inter_bw=1e18, intra_latency_s=1e-15,
                        inter_latency_s=1e-15, hbm_bw=1e18)


@pytest.mark.parametrize("u, r", [(1, 1), (4, 1), (2, 2), (1, 4)])
def test_attention_model_is_ideal_share_when_links_are_free(u, r):
    spec = _fast_links(load_cluster("cpu_local")).replace(ranks_per_node=4)
    shape = AttentionShape(batch=1, seq_len=4096, heads=8, kv_heads=8, head_dim=64)
    p = predict_attention(spec, shape, u, r, "zigzag")
    rate = spec.peak_flops * spec.mfu
    ideal_fwd = 4 * 4096**2 * 8 * 64 / 2 / (u * r) / rate  # causal, balanced: 1/P of the work
    assert p["fwd"] == pytest.approx(ideal_fwd, rel=1e-6)
    assert p["fwd_bwd"] == pytest.approx(3.5 * ideal_fwd, rel=1e-6)  # 1 + FLASH_BWD
    assert p["fwd_bwd"] == pytest.approx(p["compute"] + p["merge"] + p["a2a"] + p["ring_exposed"])
    # a batch of 3 is 3 sequences one after another
    three = predict_attention(spec, AttentionShape(3, 4096, 8, 8, 64), u, r, "zigzag")
    assert three["fwd_bwd"] == pytest.approx(3 * p["fwd_bwd"], rel=1e-12)


def test_attention_model_contiguous_ring_waits_for_the_last_rank():
    spec = _fast_links(load_cluster("a100_ib")).replace(nodes=1)
    shape = AttentionShape(batch=1, seq_len=8 * 8192, heads=32, kv_heads=8, head_dim=128,
                           dtype_bytes=2)
    zig = predict_attention(spec, shape, 1, 8, "zigzag")["fwd"]
    contig = predict_attention(spec, shape, 1, 8, "contiguous")["fwd"]
    assert contig / zig == pytest.approx((0.5 + 7) / (0.5 + 7 * 0.5))  # 15/8


def test_attention_model_on_real_spec_adds_positive_comm():
    spec = load_cluster("cpu_local").replace(ranks_per_node=4)
    shape = AttentionShape(batch=1, seq_len=8192, heads=8, kv_heads=8, head_dim=64)
    for u, r in [(4, 1), (2, 2), (1, 4)]:
        p = predict_attention(spec, shape, u, r)
        assert all(math.isfinite(v) and v >= 0 for v in p.values())
        assert 0 < p["fwd"] < p["fwd_bwd"]
        assert (p["a2a"] > 0) == (u > 1) and (p["ring_exposed"] > 0) == (r > 1)


@pytest.mark.parametrize("u, r", [(4, 1), (1, 4), (2, 2)])
def test_causal_tile_adds_the_diagonal_share(u, r):
    """The diagonal block costs (1 + tile/blk) x its half square; zigzag's other r-1 blocks
    are half squares too: compute grows by tile / (r * blk) = tile / L."""
    spec = _fast_links(load_cluster("cpu_local")).replace(ranks_per_node=4)
    shape = AttentionShape(batch=1, seq_len=4096, heads=8, kv_heads=8, head_dim=64)
    base = predict_attention(spec, shape, u, r)["compute"]
    tiled = predict_attention(spec, shape, u, r, causal_tile=512)["compute"]
    assert tiled / base == pytest.approx(1 + 512 / 4096, rel=1e-12)


def test_overlap_zero_adds_every_ring_transfer():
    spec = load_cluster("cpu_local").replace(ranks_per_node=4, hbm_bw=1e18)
    shape = AttentionShape(batch=1, seq_len=8192, heads=8, kv_heads=8, head_dim=64)
    hidden = predict_attention(spec, shape, 1, 4, overlap=1.0)["fwd_bwd"]
    serial = predict_attention(spec, shape, 1, 4, overlap=0.0)["fwd_bwd"]
    kv = 2 * 2048 * 8 * 64 * 4  # one K/V block, fp32
    lat, bw = spec.intra_latency_s, spec.intra_bw
    # 3 forward hops, 3 backward hops carrying K/V and dK/dV; the dK/dV hop home is exposed in both
    transfers = 3 * (lat + kv / bw) + 3 * (2 * lat + 2 * kv / bw)
    assert serial - hidden == pytest.approx(transfers, rel=1e-9)
    with pytest.raises(ValueError, match="overlap in"):
        predict_attention(spec, shape, 1, 4, overlap=1.5)


def test_ranking_and_pairwise_agreement():
    rounds = {"a": [1.0, 1.1, 1.0], "b": [2.0, 2.1, 1.9], "c": [1.05, 1.0, 1.2]}
    assert ranking({"a": 1.0, "b": 2.0, "c": 1.05}) == ["a", "c", "b"]
    # a<b and c<b in every round; a vs c flips between rounds -> unresolved
    assert pairwise_agreement(rounds, {"a": 1, "b": 3, "c": 2}) == (2, 2, 3)
    assert pairwise_agreement(rounds, {"a": 3, "b": 1, "c": 2}) == (0, 2, 3)


def test_calibrated_yaml_loads_back(tmp_path):
    micro = dict(a2a_bw=1.25e9, a2a_lat_s=2.5e-3, p2p_bw=9.4e8, p2p_lat_s=6.6e-4,
                 kernel_flops=3.1e10, merge_bw=3.5e9)
    spec = calibrated_spec(load_cluster("cpu_local"), micro)
    assert spec.mfu == pytest.approx(3.1e10 / spec.peak_flops)
    path = tmp_path / "measured.yaml"
    path.write_text(yaml_lines(spec) + "\n")
    back = load_cluster(path)
    assert (back.name, back.ranks_per_node, back.nodes, back.mem_bytes) == \
        (spec.name, spec.ranks_per_node, spec.nodes, spec.mem_bytes)
    for f in ("intra_bw", "intra_latency_s", "inter_bw", "inter_latency_s", "hbm_bw", "mfu"):
        assert getattr(back, f) == pytest.approx(getattr(spec, f), rel=1e-3), f


def test_published_rows():
    rows = published_rows()
    eff = {(r["hw"], r["what"].split(":")[0]): r for r in rows if "rate / (flash" in r["what"]}
    assert len(eff) == 8
    for (hw, what), r in eff.items():
        assert 0 < r["published"] < 1 and 0 < r["model"] <= 1, (hw, what)
        if what.startswith("ring_attn"):  # contiguous: the last rank does 7.5 of 8 blocks
            assert r["model"] <= 8 / 15 + 1e-9
    # the published zigzag efficiency, read off the README: 17.4 / (154.7 / 8)
    assert eff[("8xH800", "zigzag_ring fwd+bwd")]["published"] == pytest.approx(0.9, abs=2e-3)
    text = format_published(rows)
    assert "8xL20" in text and "issue 40" in text


@pytest.mark.parametrize("balance", ["zigzag", "contiguous"])
def test_loopback_ring_does_the_rings_kernel_calls(balance):
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
    plan = RingPlan(2, r, S, True, balance)
    out = RingAttention.apply(q, k, v, LoopbackComm(), plan, Counting(), 8**-0.5)
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


def test_causal_tile_from_rates():
    full, tile, n = 38e9, 512.0, 4096
    causal = full * n / (n + tile)
    assert causal_tile_from_rates(n, causal, full) == pytest.approx(tile)
    assert causal_tile_from_rates(n, full * 1.1, full) == 0.0  # noise: never negative


def test_overlap_share_is_paired_and_clipped():
    # rep 1: 10 ms kernel + 4 ms transfer took 11 ms together -> 3 of 4 ms hidden
    # rep 2: the same under load (everything 2x) -> still 75%; rep 3: serial -> 0%
    assert overlap_share([10, 20, 10], [4, 8, 4], [11, 22, 14]) == pytest.approx(0.75)
    assert overlap_share([10], [4], [16]) == 0.0  # slower than serial: clipped
    assert overlap_share([10], [4], [9]) == 1.0
    with pytest.raises(ValueError, match="equally many"):
        overlap_share([10, 10], [4], [11])


def test_setup_refuses_layouts_and_lengths_that_do_not_fit():
    with pytest.raises(ValueError, match="does not use all 4 processes"):
        CalibrationSetup(layouts=((2, 1),))
    with pytest.raises(ValueError, match="not a multiple of 8 .* use 1000"):
        CalibrationSetup(seq_lens=(1004,))
    with pytest.raises(ValueError, match="ulysses degree"):
        CalibrationSetup(heads=2, layouts=((4, 1),))
    assert CalibrationSetup(heads=4).kv_heads == 4  # kv_heads defaults to heads


# ---- evaluation on measurements made up from known links and rates ------------------------

BW, LAT, MERGE_BW, RATE_CAUSAL, RATE_FULL = 1e9, 1e-3, 5e9, 30e9, 40e9


def _fake_res(setup: CalibrationSetup, attention: dict) -> dict:
    """Raw results as ``usp.bench.calibrate.measure`` returns them, for links of ``BW`` and
    ``LAT``, a kernel at ``RATE_CAUSAL`` (causal, counted the model's way) and ``RATE_FULL``
    (unmasked), a transfer half hidden; ``attention``: entry name -> per-round seconds."""
    n = setup.nprocs
    link = dict(small=1024, large=4 * 2**20)
    micro = {f"a2a_{t}_bytes": (n - 1) * b for t, b in link.items()}
    micro.update({f"p2p_{t}_bytes": b for t, b in link.items()})
    for key in [k for k in micro if k.endswith("_bytes")]:
        micro[key.replace("_bytes", "_s")] = [LAT + micro[key] / BW * x for x in (1.3, 1.0)]
    micro["merge_bytes"] = 3 * 4 * 2048 * 8 * 64
    micro["merge_s"] = [micro["merge_bytes"] / MERGE_BW, 1.0]
    micro.update(ovl_kernel_s=[0.03] * 3, ovl_comm_s=[0.01] * 3, ovl_both_s=[0.035] * 3)
    fwd_flops = 4 * PROBE[0] ** 2 * PROBE[1] * 64 / 2
    rounds = {"kernel fwd": [fwd_flops / RATE_CAUSAL] * setup.iters,
              "kernel fwd+bwd": [3.5 * fwd_flops / RATE_CAUSAL] * setup.iters,
              "kernel fwd+bwd non-causal":
                  [3.5 * 4 * PROBE_NC[0] ** 2 * PROBE_NC[1] * 64 / RATE_FULL] * setup.iters}
    return dict(micro=micro, rounds={**rounds, **attention})


def _attention(setup: CalibrationSetup, seconds) -> dict:
    out = {}
    for L in setup.seq_lens:
        for u, r in setup.layouts:
            name = f"L={L} u={u} r={r}"
            t = seconds(L, f"u={u} r={r}")
            out[f"usp {name}"] = [t * (1 + 0.01 * i) for i in range(setup.iters)]
            out[f"local {name}"] = [0.8 * t] * setup.iters
    return out


def test_compare_predictions_recovers_the_made_up_machine():
    setup = CalibrationSetup(seq_lens=(1024, 2048), iters=3)
    ev = compare_predictions(setup, _fake_res(setup, _attention(setup, lambda L, c: 1.0)), "min")
    cal = ev["calibration"]
    for key, want in (("a2a_bw", BW), ("a2a_lat_s", LAT), ("p2p_bw", BW), ("p2p_lat_s", LAT),
                      ("merge_bw", MERGE_BW), ("kernel_flops", RATE_CAUSAL),
                      ("kernel_nc_flops", RATE_FULL), ("bwd_over_fwd", 2.5), ("overlap", 0.5),
                      ("causal_tile", PROBE[0] * (RATE_FULL / RATE_CAUSAL - 1))):
        assert cal[key] == pytest.approx(want, rel=1e-9), key
    assert ev["spec"].mfu == pytest.approx(RATE_CAUSAL / ev["spec"].peak_flops)
    # the median of two repetitions is the lower one (a measured time, not a mean)
    median = compare_predictions(setup, _fake_res(setup, _attention(setup, lambda L, c: 1.0)), "median")
    assert median["micro"]["merge_s"] == ev["micro"]["merge_s"]


def test_compare_predictions_ratios_and_orders():
    setup = CalibrationSetup(seq_lens=(1024, 2048), iters=3)
    first = compare_predictions(setup, _fake_res(setup, _attention(setup, lambda L, c: 1.0)))
    pred = {(r["L"], r["config"]): r["pred_s"] for r in first["rows"]}
    assert len(set(pred.values())) == len(pred)  # the layouts differ in the model
    # measured = 2 x predicted: ratio 1/2 everywhere, every order and resolved pair agrees
    ev = compare_predictions(setup, _fake_res(setup, _attention(setup, lambda L, c: 2 * pred[L, c])))
    s = ev["summary"]["model"]
    assert s["min"] == pytest.approx(0.5) and s["max"] == pytest.approx(0.5)
    assert s["same_order"] == s["lengths"] == 2
    assert all(o["agree"] == o["resolved"] == o["pairs"] == 3 for o in ev["orders"])
    assert all(r["rest_s"] == pytest.approx(0.2 * r["measured_s"]) for r in ev["rows"])
    # measured in the reverse order of the model: no length and no pair agrees
    rev = compare_predictions(setup, _fake_res(setup, _attention(setup, lambda L, c: 1 / pred[L, c])))
    assert rev["summary"]["model"]["same_order"] == 0
    assert all(o["agree"] == 0 and o["resolved"] == 3 for o in rev["orders"])
    text, js = format_report(setup, _fake_res(setup, _attention(setup, lambda L, c: 1.0)))
    assert set(js) == {"min", "median"} and js["min"]["spec"]["intra_bw"] == pytest.approx(BW)
    assert "1.000 GB/s per rank, latency 1.000 ms" in text
    assert "50% of the shorter one hidden" in text
    assert f"causal diagonal waste = {PROBE[0] * (RATE_FULL / RATE_CAUSAL - 1):.0f} tokens" in text


# ---- timing loops, on a stand-in for torch.distributed (one rank) ---------------------------


@pytest.fixture
def one_rank(monkeypatch):
    """``usp.bench.timing``'s ``dist`` as a one-rank group: barriers pass, MAX is identity."""
    fake = types.SimpleNamespace(barrier=lambda: None, all_reduce=lambda t, op=None: t,
                                 ReduceOp=types.SimpleNamespace(MAX="max"))
    monkeypatch.setattr(timing, "dist", fake)


def test_timed_and_round_robin_time_each_call(one_rank):
    assert all(t >= 0.01 for t in timed(lambda: time.sleep(0.01), 3))
    calls, after = [], []
    fns = [lambda j=j: (calls.append(j), time.sleep(0.01 * (j == 1))) for j in range(3)]
    out = round_robin(fns, 3, warmup=1, on_round=after.append)
    # each round starts one entry later: warmup at entry 2, then 0, 1, 2
    assert calls == [2, 0, 1, 0, 1, 2, 1, 2, 0, 2, 0, 1]
    assert after == [-1, 0, 1, 2] and len(out) == 3 and all(len(row) == 3 for row in out)
    assert all(row[1] >= 0.01 > max(row[0], row[2]) for row in out)
    calls.clear()
    round_robin(fns, 2, rotate=False)
    assert calls == [0, 1, 2, 0, 1, 2]


class _Transfer:
    """A stand-in request: done ``s`` seconds after it was posted (``wait`` sleeps the rest),
    or, when ``blocking``, ``s`` seconds after ``wait`` is called."""

    def __init__(self, s: float, blocking: bool):
        self.s, self.blocking, self.posted = s, blocking, time.perf_counter()

    def wait(self):
        start = time.perf_counter() if self.blocking else self.posted
        time.sleep(max(0.0, start + self.s - time.perf_counter()))


@pytest.mark.parametrize("blocking", [False, True])
def test_overlap_times_sees_a_transfer_hide(one_rank, blocking):
    kernel_s, comm_s, both_s = overlap_times(lambda: time.sleep(0.03),
                                             lambda: [_Transfer(0.02, blocking)], 5, warmup=1)
    assert len(kernel_s) == len(comm_s) == len(both_s) == 5
    assert min(kernel_s) >= 0.03 and min(comm_s) >= 0.02
    share = overlap_share(kernel_s, comm_s, both_s)
    assert (share < 0.4) if blocking else (share > 0.6), share


def test_fit_a2a_overlap_recovers_the_share_that_made_the_gains():
    from usp.planner.calibration import fit_a2a_overlap
    from usp.planner.cost import attention_cost

    spec = load_cluster("cpu_local").replace(ranks_per_node=1, nodes=2, inter_bw=37e6,
                                             overlap=0.9)
    shape = dict(seq_len=2048, hq=8, hkv=2, head_dim=64, ulysses=2, ring=1, dtype_bytes=4)

    def gain(share, c):
        t = [attention_cost(spec, **shape, a2a_chunks=k, a2a_overlap=share).total_s
             for k in (1, c)]
        return t[0] / t[1]

    assert gain(0.3, 2) < gain(0.6, 2) < gain(0.9, 2)  # a share the ring's overlap leaves
    for share in (0.0, 0.35, 0.8):
        cases = [(gain(share, c), dict(shape, a2a_chunks=c)) for c in (2, 4)]
        assert fit_a2a_overlap(spec, cases) == pytest.approx(share, abs=0.005)
    # two counts pulling apart: the share that misses both by the least
    pulled = [(gain(0.2, 2), dict(shape, a2a_chunks=2)), (gain(0.6, 4), dict(shape, a2a_chunks=4))]
    fit = fit_a2a_overlap(spec, pulled)
    assert 0.2 < fit < 0.6
    off = max(abs(gain(fit, kw["a2a_chunks"]) / g - 1) for g, kw in pulled)
    assert off <= min(max(abs(gain(x, kw["a2a_chunks"]) / g - 1) for g, kw in pulled)
                      for x in (0.2, 0.4, 0.6))
    assert fit_a2a_overlap(spec, [(0.5, dict(shape, a2a_chunks=2))]) == 0.0  # nothing hides
    assert fit_a2a_overlap(spec, [(9.0, dict(shape, a2a_chunks=2))]) == 1.0  # beyond the model
    with pytest.raises(ValueError, match="a2a_chunks >= 2"):
        fit_a2a_overlap(spec, [(1.2, dict(shape, a2a_chunks=1))])
    with pytest.raises(ValueError, match="a2a_overlap must be in"):
        spec.replace(a2a_overlap=1.5)
    assert spec.replace(a2a_overlap=0.4).a2a_overlap == 0.4
