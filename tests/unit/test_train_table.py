"""tools.train_table's parts that need no root and no process: the rows the planner's
layout gives, the refusals before any namespace exists, and the report of a result.
The table on a simulated cluster: ``root/test_train_table.py``."""

import os

import pytest

import tools.lab.train_table as tt
from tools.train_table import config, main, parse_args

SMALL = dict(seq_len=256, n_layers=1, warmup=1, rounds=2)


@pytest.fixture(scope="module")
def small():
    return tt.prepare(tt.TrainTable(out="/tmp/helper_tt_unit", **SMALL))


def test_rows_are_the_planners_choice_deepspeed_ulysses_and_ring_only(small):
    choice, ds, ring = small.rows
    lay = small.layout
    # the planner puts ulysses inside a node and the ring across the two nodes
    assert (lay.ulysses, lay.ring, lay.dp) == (2, 2, 1)
    assert (choice.attention, choice.ulysses, choice.ring) == ("usp", 2, 2)
    assert choice.a2a_chunks == lay.a2a_chunks and choice.balance == lay.balance
    assert (ds.attention, ds.ulysses, ds.ring, ds.a2a_chunks, ds.balance) == \
        ("deepspeed", 4, 1, 1, "contiguous")
    assert (ring.attention, ring.ulysses, ring.ring, ring.a2a_chunks) == ("usp", 1, 4, 1)
    assert len({r.name for r in small.rows}) == 3
    # the planner chose the layout it predicts fastest among the three
    assert min(small.predicted_s, key=small.predicted_s.get) == choice.name
    assert all(s > 0 for s in small.predicted_s.values())


def test_nominal_spec_is_the_shaped_links_on_two_nodes():
    spec = tt.nominal_spec(tt.TrainTable(rate="300mbit", intra_rate="2700mbit"))
    assert (spec.nodes, spec.ranks_per_node) == (2, 2)
    assert spec.inter_bw == 300e6 / 8 and spec.intra_bw == 2700e6 / 8
    assert spec.gpus_per_nic == 2  # the node's ranks share its veth
    unshaped = tt.nominal_spec(tt.TrainTable(intra_rate=None))
    assert unshaped.intra_bw == tt.load_cluster("cpu_local").intra_bw


@pytest.mark.parametrize("change, message", [
    (dict(rate="auto"), "not auto"),
    (dict(intra_rate="fast"), "bad rate 'fast'"),
    (dict(n_heads=6, n_kv_heads=2, dim=384), "query heads divisible by 4"),
    (dict(n_kv_heads=3, n_heads=6, dim=384), "DeepSpeed-Ulysses row"),
    (dict(seq_len=100), "100"),
    (dict(rounds=0), "rounds"),
    (dict(batch=0), "batch"),
    (dict(queue_ms=0), "queue_ms"),
    (dict(dim=500), "divisible by n_heads"),
])
def test_bad_settings_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        tt.TrainTable(**change)


def test_cli_refuses_before_any_namespace(monkeypatch, capsys, tmp_path):
    made = []
    monkeypatch.setattr(tt, "SimCluster", lambda *a, **kw: made.append(a))
    assert main(["--seq-len", "100"]) == 2
    assert "train_table: error:" in capsys.readouterr().err
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # preflight's probe
    assert main(["--seq-len", "256", "--out", str(tmp_path)]) == 2
    assert "needs root" in capsys.readouterr().err
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(tt.importlib.util, "find_spec", lambda name: None)  # no DeepSpeed
    monkeypatch.setattr("tools.train_table.preflight", lambda: None)
    assert main(["--seq-len", "256", "--out", str(tmp_path)]) == 2
    assert "needs deepspeed" in capsys.readouterr().err
    assert not made


def test_cli_flags_reach_the_config():
    cfg = config(parse_args(["--intra-rate", "none", "--heads", "16", "--kv-heads", "4",
                             "--dim", "1024", "--rounds", "3", "--seq-len", "512"]))
    assert cfg.intra_rate is None and cfg.model.head_dim == 64
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.rounds, cfg.seq_len) == (16, 4, 3, 512)
    assert config(parse_args([])) == tt.TrainTable()


def _worker(small, times):
    names = [r.name for r in small.rows]
    return {"links": {"intra": 3.0e8, "inter": 3.7e7}, "hosts": ["a", "a", "b", "b"],
            "rows": {n: dict(step_s=t, check_loss=6.0 + 1e-6 * i, check_grad_norm=2.0,
                             every_token_loss=5.8, last_loss=3.0)
                     for i, (n, t) in enumerate(zip(names, times))}}


def test_report_has_one_line_per_row_with_tokens_per_second(small):
    times = [[1.0, 2.0, 1.5], [2.0, 2.0, 2.0], [0.5, 0.5, 1.5]]
    summary = tt.summarize(small, _worker(small, times))
    rows = summary["rows"]
    assert [r["name"] for r in rows] == [r.name for r in small.rows]
    tokens = small.cfg.tokens_per_step  # 256 tokens per step
    assert [r["tokens_per_s"] for r in rows] == [tokens / 1.5, tokens / 2.0, tokens / 0.5]
    assert [r["spread"] for r in rows] == [1.0 / 1.5, 0.0, 1.0 / 0.5]
    # the prediction takes the measured links; both slower than nominal: longer steps
    assert all(r["predicted_s"] > r["predicted_s_nominal_links"] for r in rows)
    assert [r["predicted_s_nominal_links"] for r in rows] == [small.predicted_s[r["name"]]
                                                             for r in rows]
    assert rows[1]["predicted_over_measured"] == rows[1]["predicted_s"] / 2.0
    assert summary["loss_rel_diff"] == pytest.approx(2e-6 / 6.000002)
    lines = tt.report(small, summary)
    body = [ln for ln in lines if ln.lstrip().startswith(tuple(r["name"] for r in rows))]
    assert len(body) == 3
    assert body[0].split()[-8:-6] == ["(2,2)", str(small.layout.a2a_chunks)]
    assert "171" in body[0] and "128" in body[1] and "512" in body[2]  # tokens/s
    assert "67%" in body[0] and "200%" in body[2]  # spread
    assert any("links measured" in ln and "37.0 MB/s" in ln for ln in lines)
    assert any("ulysses 2 x ring 2 x dp 1" in ln for ln in lines)
