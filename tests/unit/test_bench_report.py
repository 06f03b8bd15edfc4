"""tools.lab.cluster_report: tables, PNGs and the planner's verdict from a worker's
measurements (the part of the cluster benchmarks that needs no root)."""

from __future__ import annotations

import pytest

from tools.lab.cluster import ClusterBench
from tools.lab.cluster_report import report

CFG = ClusterBench(seq_len=2048, heads=8, kv_heads=2, head_dim=64, mem_seq_len=2048,
                   train_seq_len=2048, train_batch=2)


def worker_result(inter_bw: float) -> dict:
    """Measurements shaped like a 300 mbit run; ``inter_bw`` the node-to-node link."""
    ms = {"(2,2) ulysses_inner": 180.0, "(2,2) ring_inner": 278.0, "(4,1)": 263.0,
          "(1,4)": 165.0, "ring P=2 zigzag": 281.0, "ring P=2 contiguous": 293.0,
          "dense P=1": 524.0}
    one_layer = {"measured": 4194304, "formula": 4194304, "ulysses": 2621440, "ring": 1572864,
                 "hosts_per_ulysses_group": 1, "hosts_per_ring_group": 2}
    return {
        "links": {"intra": 340e6, "inter": inter_bw},
        "overlap": {"share": 0.86, "kernel_ms": 28.2, "transfer_ms": 28.2, "both_ms": 31.8},
        "attention_ms": {k: [v * 0.99, v, v * 1.02] for k, v in ms.items()},
        "bytes": {"(2,2) ulysses_inner": one_layer,
                  "(1,4)": {**one_layer, "measured": 4718593, "formula": 4718592}},
        "saved_bytes": {"1": 46456832, "2": 24276992, "4": 12138496},
        "hosts": ["n0", "n0", "n1", "n1"],
        "ring": {"4096": {"ring P=2 zigzag": [492.0], "ring P=2 contiguous": [665.0],
                          "dense P=1": [903.0]}},
    }


TRAIN = {"(2,2) ulysses_inner": 0.461, "(2,2) ring_inner": 0.504, "(4,1)": 0.529, "(1,4)": 0.422}


def test_report_tables_plots_and_planner_verdict(tmp_path):
    s, lines = report(CFG, worker_result(37e6), TRAIN, tmp_path)
    assert s["placement"]["attn_ratio"] == pytest.approx(278.0 / 180.0)
    assert s["placement"]["train_ratio"] == pytest.approx(0.504 / 0.461)
    assert s["bytes_max_rel_err"] == pytest.approx(1 / 4718592)
    assert s["act_ratio"][2] == pytest.approx(24276992 / (46456832 / 2))
    eff = s["ring_eff"]["1 rank per core, L=4096"]
    assert eff["ring P=2 zigzag"] == pytest.approx(903.0 / 2 / 492.0)
    assert s["ring_eff"]["4 ranks on 2 cores, L=2048"]["ring P=2 contiguous"] == \
        pytest.approx(524.0 / 2 / 293.0)
    # one shared 37 MB/s link per node: (1,4) sends off a node from one rank, (2,2) from two
    assert s["planner"] == {"choice": [1, 4], "best": [1, 4], "gap": 0.0}
    text = (tmp_path / "tables.txt").read_text()
    assert text == "\n".join(lines) + "\n"
    assert "planner choice (1, 4): measured +0.0% vs best (1, 4)" in text
    e_row = next(ln.split() for ln in lines if ln.lstrip().startswith("(1,4)") and "%" in ln)
    assert e_row[3:6] == ["4718593", "4718592", "+0.00%"]  # (e): measured, formula, diff
    for png in ("a_placement", "b_degree_sweep", "c_ring_efficiency", "d_activation_memory",
                "e_bytes"):
        assert (tmp_path / f"{png}.png").stat().st_size > 1000


def test_report_states_the_gap_when_the_planner_misses(tmp_path):
    # the same links (the planner still picks (1,4)), but (2,2) measured fastest:
    # (1,4)'s 0.450 s is 12.5% over (2,2)'s 0.400 s
    train = {**TRAIN, "(2,2) ulysses_inner": 0.400, "(1,4)": 0.450}
    s, lines = report(CFG, worker_result(37e6), train, tmp_path)
    assert s["planner"]["choice"] == [1, 4]
    assert s["planner"]["best"] == [2, 2]
    assert s["planner"]["gap"] == pytest.approx(0.125)
    assert "planner choice (1, 4): measured +12.5% vs best (2, 2)" in lines
    ranks = {ln.split()[0]: ln.split()[3] for ln in lines if ln.startswith("(")
             and len(ln.split()) == 6}  # (b): (u,r) -> measured rank
    assert ranks == {"(4,1)": "3", "(2,2)": "1", "(1,4)": "2"}
