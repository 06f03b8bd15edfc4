"""tools.bench_moe's parts that need no root and no process: the settings' refusals, the run
order, the usp-train command line, a run's figures from its metrics.jsonl, the planner's
figures and the report of a result."""

import json
import os

import pytest

import tools.lab.moe_bench as mb
from tools.bench_moe import config, main, parse_args, parse_degrees

SMALL = dict(seq_len=256, n_layers=1, steps=3, skip=1, passes=2)


@pytest.fixture(scope="module")
def small():
    return mb.prepare(mb.MoeBench(out="/tmp/helper_bm_unit", **SMALL))


@pytest.mark.parametrize("change, message", [
    (dict(rate="auto"), "not auto"),
    (dict(degrees=(2, 4)), "must hold 1"),
    (dict(degrees=(1, 2, 2)), "no degree twice"),
    (dict(degrees=(1, 3)), "expert_degree=3"),
    (dict(n_experts=6, degrees=(1, 4)), "expert_degree=4"),
    (dict(ulysses=2, ring=1), "must be the 4 ranks"),
    (dict(steps=2, skip=2), "steps > skip"),
    (dict(seq_len=100), "100"),
    (dict(experts_per_token=9), "experts_per_token=9"),
])
def test_bad_settings_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        mb.MoeBench(**change)


def test_order_alternates_the_degrees_pass_by_pass():
    assert mb.order((1, 2, 4), 3) == [(0, 1), (0, 2), (0, 4), (1, 4), (1, 2), (1, 1),
                                      (2, 1), (2, 2), (2, 4)]


def test_the_run_is_usp_train_of_the_builtin_moe_at_the_degree(tmp_path):
    cmd = mb.MoeBench().overrides(4, tmp_path)
    for item in ("model.arch=qwen3_moe", "model.n_experts=8", "model.experts_per_token=2",
                 "model.expert_ffn_dim=512", "parallel.expert_degree=4",
                 "parallel.ulysses_degree=2", "parallel.ring_degree=2",
                 "parallel.ranks_per_node=null", f"trainer.run_dir={tmp_path}",
                 "data.seq_len=4096", "trainer.steps=6"):
        assert item in cmd


def test_run_figures_drop_the_first_steps():
    rows = [dict(step=i, step_s=s, attn_comm_share=0.1 * i, loss=6 - i, aux_loss=2.0,
                 expert_load=1.0 + i) for i, s in enumerate([9.0, 5.0, 2.0, 4.0, 3.0], 1)]
    text = "\n".join(json.dumps(r) for r in rows) + "\n" + json.dumps({"final": 1}) + "\n"
    got = mb.run_figures(text, 2)
    assert got["step_s"] == [2.0, 4.0, 3.0] and got["median_s"] == 3.0
    assert got["attn_comm_share"] == pytest.approx(0.4)
    assert (got["loss"], got["expert_load"]) == (1, 6.0)
    with pytest.raises(ValueError, match="none after the first 5"):
        mb.run_figures(text, 5)


def test_the_planner_prices_each_degree_on_the_shaped_links(small):
    pred = small.predicted
    assert sorted(pred) == [1, 2, 4]
    assert pred[1].expert_a2a_s == 0 and pred[1].expert_link == "-"
    # ulysses inside the node: expert groups of 2 stay in it, of 4 cross the slow link
    assert (pred[2].expert_link, pred[4].expert_link) == ("intra", "inter")
    assert pred[4].expert_a2a_s > pred[2].expert_a2a_s > 0
    assert small.pick == min(pred, key=lambda d: pred[d].step_s)


def test_report_ratios_to_degree_one(small):
    def fig(s):
        return dict(median_s=s, attn_comm_share=0.2, expert_load=1.5, loss=5.0)
    runs = {1: [fig(4.0), fig(5.0)], 2: [fig(2.0), fig(4.0)], 4: [fig(1.0), fig(2.0)]}
    summary = mb.summarize(small, runs)
    rows = {r["degree"]: r for r in summary["rows"]}
    tokens = small.cfg.tokens_per_step
    assert rows[2]["median_s"] == 2.0 and rows[2]["tokens_per_s"] == tokens / 2.0
    assert rows[4]["vs_1"] == 4.0  # best against best
    assert rows[4]["vs_1_paired"] == 3.25 and rows[4]["vs_1_paired_range"] == [2.5, 4.0]
    assert rows[1]["vs_1"] == 1.0 and rows[1]["predicted_vs_1"] == 1.0
    assert rows[2]["predicted_over_measured"] == small.predicted[2].step_s / 2.0
    lines = mb.report(small, summary)
    body = [ln.split() for ln in lines if ln.lstrip()[:1].isdigit()]
    assert [b[0] for b in body] == ["1", "2", "4"]
    assert body[2][1:5] == ["inter", str(round(tokens / 1.0)), "1000", "4.00"]
    assert body[2][5:7] == ["3.25", "(2.50-4.00)"] and body[2][7] == "1000/2000"
    assert body[2][-1] == "1.50"  # expert load
    assert any(f"expert_degree=auto picks {small.pick}" in ln for ln in lines)


def test_report_again_from_the_saved_runs(tmp_path):
    p = mb.prepare(mb.MoeBench(out=str(tmp_path), **SMALL))
    fig = dict(median_s=2.0, attn_comm_share=0.2, expert_load=4.0, loss=5.0)
    (tmp_path / "results.json").write_text(json.dumps(dict(runs={"1": [fig], "2": [fig],
                                                                 "4": [fig]})))
    summary, lines = mb.report_saved(p)
    assert [r["vs_1"] for r in summary["rows"]] == [1.0, 1.0, 1.0]
    assert main(["--report-only", "--out", str(tmp_path), "--seq-len", "256", "--layers", "1",
                 "--steps", "3", "--skip", "1", "--passes", "2"]) == 0


def test_cli_flags_reach_the_config_and_refuse_before_any_namespace(monkeypatch, capsys):
    cfg = config(parse_args(["--intra-rate", "none", "--degrees", "1,4", "--experts", "16",
                             "--top-k", "4", "--seq-len", "2048"]))
    assert cfg.intra_rate is None and cfg.degrees == (1, 4) and cfg.model.n_experts == 16
    assert (cfg.experts_per_token, cfg.seq_len) == (4, 2048)
    assert config(parse_args([])) == mb.MoeBench()
    assert parse_degrees(" 1, 2 ,4") == (1, 2, 4)
    with pytest.raises(ValueError, match="--degrees"):
        parse_degrees("1,two")
    made = []
    monkeypatch.setattr(mb, "SimCluster", lambda *a, **kw: made.append(a))
    assert main(["--degrees", "1,3", "--seq-len", "256", "--layers", "1"]) == 2
    assert "bench_moe: error:" in capsys.readouterr().err
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # preflight's probe
    assert main(["--seq-len", "256", "--layers", "1"]) == 2
    assert "needs root" in capsys.readouterr().err
    assert main(["--plan-only", "--seq-len", "256", "--layers", "1"]) == 0
    assert "expert_degree=auto picks" in capsys.readouterr().out
    assert not made
