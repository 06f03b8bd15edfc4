"""(f) of the cluster benchmarks: the pipelined all-to-all's measured gain against the
planner's prediction and choice (``tools.lab.cluster_report``), on synthetic measurements,
and ``best_a2a_chunks`` choosing what ``attention_cost`` ranks first."""

from __future__ import annotations

import statistics

import pytest

from tools.lab.cluster import ClusterBench, chunk_train_counts
from tools.lab.cluster_report import (chunk_lines, chunk_picks, chunk_spec, chunk_verdict,
                                      report)
from usp.config.cluster import load_cluster
from usp.planner.cost import attention_cost, best_a2a_chunks

CFG = ClusterBench(seq_len=2048, heads=8, kv_heads=2, head_dim=64, train_seq_len=2048,
                   train_batch=2, a2a_chunks=(1, "auto"))


def test_verdict_pairs_rounds_and_applies_the_five_percent_rule():
    # round 2 ran under twice the load: paired ratios cancel it, medians of times would not
    measured = {1: [0.60, 1.20, 0.60], 2: [0.40, 0.80, 0.40], 3: [0.41, 0.82, 0.41],
                4: [0.44, 0.88, 0.44]}
    predicted = {1: 0.500, 2: 0.400, 3: 0.380, 4: 0.375}
    v = chunk_verdict(measured, predicted, choice=3)
    assert v["best"] == 2 and v["choice"] == 3
    assert v["gain"] == pytest.approx({1: 1.0, 2: 1.5, 3: 0.60 / 0.41, 4: 0.60 / 0.44})
    assert v["predicted_gain"][4] == pytest.approx(0.500 / 0.375)
    assert v["gap"] == pytest.approx(0.41 / 0.40 - 1) and v["within"]  # +2.5%
    miss = chunk_verdict(measured, predicted, choice=4)  # +10%
    assert miss["gap"] == pytest.approx(0.1) and not miss["within"]
    tie = chunk_verdict({1: [0.5, 0.6], 2: [0.5, 0.6]}, {1: 0.5, 2: 0.4}, choice=2)
    assert tie["best"] == 1 and tie["gap"] == 0.0  # a tie goes to fewer stages
    # the median of per-round ratios, not the ratio of medians
    drift = chunk_verdict({1: [1.0, 2.0, 3.0], 2: [0.5, 1.0, 6.0]}, {1: 1.0, 2: 1.0}, 2)
    assert drift["gain"][2] == pytest.approx(2.0)
    with pytest.raises(ValueError):  # counts timed in different rounds cannot be paired
        chunk_verdict({1: [1.0, 2.0], 2: [1.0]}, {1: 1.0, 2: 1.0}, 2)


def test_table_marks_the_choice_and_states_each_verdict():
    m41, m22 = {1: [0.6], 2: [0.4]}, {1: [0.5], 4: [0.6]}
    t = {"(4,1)": (m41, chunk_verdict(m41, {1: 0.5, 2: 0.4}, 2)),
         "(2,2) ring_inner": (m22, chunk_verdict(m22, {1: 0.5, 4: 0.4}, 4))}
    lines = chunk_lines("title", "attn ms", t)
    rows = [ln.split() for ln in lines if ln.lstrip().startswith("(")]
    assert rows[1][:6] == ["(4,1)", "2", "400.000", "1.50x", "1.25x", "<-"]
    assert rows[0][-1] == "1.00x"  # no mark on the count the planner did not choose
    assert lines[-2] == ("(4,1): planner a2a_chunks=2, measured best 2: +0.0% (within 5%: "
                         "yes); predicted gains off by at most 16.7% (a2a_overlap fitted to these gains; "
                         "within 10%: no)")  # 1.25/1.5
    assert lines[-1] == ("(2,2) ring_inner: planner a2a_chunks=4, measured best 1: +20.0% "
                         "(within 5%: no); predicted gains off by at most 50.0% (a2a_overlap "
                         "fitted to these gains; within 10%: no)")  # 1.25 predicted, 0.83 measured
    close = chunk_verdict(m41, {1: 0.5, 2: 0.35}, 2)  # 1.43 predicted, 1.5 measured
    assert close["prediction_off"] == pytest.approx(1 - (0.5 / 0.35) / 1.5)
    assert close["prediction_holds"]


def test_best_a2a_chunks_is_the_cost_models_argmin():
    slow = load_cluster("cpu_local").replace(ranks_per_node=2, nodes=2, inter_bw=35e6,
                                             intra_bw=320e6, peak_flops=14e9, mfu=1.0,
                                             overlap=0.9, gpus_per_nic=2)
    for u, r, pl in ((4, 1, "ulysses_inner"), (2, 2, "ring_inner"), (2, 2, "ulysses_inner")):
        totals = {c: attention_cost(slow, 2048, 8, 2, 64, u, r, dtype_bytes=4, placement=pl,
                                    a2a_chunks=c).total_s for c in CFG.legal_chunks(u)}
        want = min(totals, key=lambda c: (totals[c], c))
        assert best_a2a_chunks(slow, 2048, 8, 2, 64, u, r, dtype_bytes=4, placement=pl) == want
    # across the slow link the all-to-all is worth hiding; on links whose messages cost
    # more in latency than they move, one stage is best
    assert best_a2a_chunks(slow, 2048, 8, 2, 64, 4, 1, dtype_bytes=4) == 2
    fast = slow.replace(inter_bw=1e15, intra_bw=1e15, inter_latency_s=0.05, intra_latency_s=0.05)
    assert best_a2a_chunks(fast, 2048, 8, 2, 64, 4, 1, dtype_bytes=4) == 1
    assert best_a2a_chunks(slow, 2048, 8, 2, 64, 2, 2, dtype_bytes=4, max_chunks=2) <= 2


def worker_chunks(ms: dict) -> dict:
    """A ``chunks`` phase result: links of a 300 mbit run, attention ``ms`` per case."""
    split = dict(a2a_exposed_ms=100.0, a2a_hidden_ms=50.0, ring_exposed_ms=10.0)
    return {"links": {"intra": 320e6, "inter": 35e6}, "hosts": ["n0", "n0", "n1", "n1"],
            "overlap": {"share": 0.9, "kernel_ms": 90.0, "transfer_ms": 38.0, "both_ms": 92.0},
            "attention_ms": {k: [v, v * 1.01, v * 0.99] for k, v in ms.items()},
            "split": {k: split for k in ms if k != "dense P=1"}}


def test_report_of_a_chunks_only_run(tmp_path):
    ms = {"(4,1) c=1": 700.0, "(4,1) c=2": 480.0, "(2,2) ring_inner c=1": 490.0,
          "(2,2) ring_inner c=2": 495.0, "(2,2) ring_inner c=3": 520.0,
          "(2,2) ring_inner c=4": 560.0, "dense P=1": 1076.0}
    w = worker_chunks(ms)
    picks = chunk_picks(CFG, w)
    assert picks["(4,1)"]["attention"] == 2  # the slow link: hide the all-to-all
    counts = chunk_train_counts(CFG, {k: v["train"] for k, v in picks.items()})
    assert counts["(4,1)"] == [1, 2]
    w["train"] = {name: {str(c): [1.0 + 0.1 * c, 1.1 + 0.1 * c] for c in cs}
                  for name, cs in counts.items()}
    s = report(CFG, {"chunks": w}, {}, tmp_path)[0]
    att = s["chunks"]["(4,1)"]["attention"]
    assert att["best"] == 2 and att["gain"][2] == pytest.approx(700.0 / 480.0)
    assert s["chunks"]["(4,1)"]["train"]["best"] == 1  # synthetic steps grow with c
    text = (tmp_path / "tables.txt").read_text()
    assert "(f) pipelined all-to-all across nodes" in text and "(f) usp-train step" in text
    assert (tmp_path / "f_a2a_chunks.png").stat().st_size > 1000


def test_report_adds_the_one_rank_per_node_cluster_and_the_steps_comm_share(tmp_path):
    ms = {"(4,1) c=1": 700.0, "(4,1) c=2": 480.0, "(2,2) ring_inner c=1": 490.0,
          "(2,2) ring_inner c=2": 495.0, "(2,2) ring_inner c=3": 520.0,
          "(2,2) ring_inner c=4": 560.0, "dense P=1": 1076.0}
    w = worker_chunks(ms)
    solo_ms = {"(2,1) 1 rank/node c=1": 320.0, "(2,1) 1 rank/node c=2": 218.0,
               "(2,1) 1 rank/node c=3": 214.0, "(2,1) 1 rank/node c=4": 189.0,
               "dense P=1": 370.0}
    solo = {**worker_chunks(solo_ms), "hosts": ["n0", "n1"]}
    # the 2 x 2 picks do not name the 2 x 1 layout, and the other way round
    assert set(chunk_picks(CFG, w)) == {"(4,1)", "(2,2) ring_inner"}
    picks = chunk_picks(CFG, solo, per_node=1)
    assert set(picks) == {"(2,1) 1 rank/node"}
    c = picks["(2,1) 1 rank/node"]["train"]
    w["solo"] = {**solo, "train": {"(2,1) 1 rank/node": {"1": [1.5, 1.52], str(c): [1.2, 1.25]}},
                 "train_share": {"(2,1) 1 rank/node": {"1": [0.29, 0.31], str(c): [0.1, 0.12]}}}
    s, lines = report(CFG, {"chunks": w}, {}, tmp_path)
    v = s["chunks"]["(2,1) 1 rank/node"]
    assert v["attention"]["gain"][4] == pytest.approx(320.0 / 189.0)
    assert v["train"]["gain"][c] == pytest.approx(statistics.median([1.5 / 1.2, 1.52 / 1.25]))
    row = next(ln.split() for ln in lines  # the step table's row (only it has a % column)
               if ln.split()[:4] == ["(2,1)", "1", "rank/node", str(c)] and "%" in ln)
    assert row[-1] == "11.0%"  # the step's attention-communication share, median of passes
    assert any("one rank per core" in ln for ln in lines)


def test_measured_latency_reaches_the_planners_choice(tmp_path):
    # every count gains 1.75x, beyond what any share predicts: the fit takes all of it
    ms = {f"{n} c={c}": 700.0 if c == 1 else 400.0
          for n, u in (("(4,1)", 4), ("(2,2) ring_inner", 2)) for c in CFG.legal_chunks(u)}
    w = worker_chunks({**ms, "dense P=1": 1076.0})
    w["overlap"]["share"] = 1.0
    assert chunk_spec(CFG, w)[0].a2a_overlap == 1.0
    assert chunk_picks(CFG, w)["(2,2) ring_inner"]["attention"] == 4  # cpu_local's 0.4-0.6 ms
    # every stage pays a message's latency: at 20 ms a message, fewer stages pay off
    slow = {**w, "latency": {"intra": 0.02, "inter": 0.02}}
    picks = chunk_picks(CFG, slow)
    assert picks["(2,2) ring_inner"]["attention"] == 2
    lines = report(CFG, {"chunks": slow}, {}, tmp_path)[1]
    assert any("latency intra 20.00 ms, inter 20.00 ms" in ln and "(all measured)" in ln
               for ln in lines)


def test_chunk_counts_refused_before_launch():
    assert chunk_train_counts(CFG.replace(a2a_chunks=(3, "auto")),
                              {"(4,1)": 2, "(2,2) ring_inner": 4}) == \
        {"(4,1)": [2], "(2,2) ring_inner": [3, 4]}
    with pytest.raises(ValueError, match=r"a2a_chunks \[5\] fit no layout"):
        CFG.replace(a2a_chunks=(5,))
    with pytest.raises(ValueError, match="got \\['two'\\]"):
        ClusterBench.parse_chunks("1,two")
    assert ClusterBench.parse_chunks("1, 2,auto") == (1, 2, "auto")
