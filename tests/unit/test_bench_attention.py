"""usp.bench.attention: the benchmark's settings are refused before any process starts, and
its report (rows, ratios, correctness column) is built from the measured times."""

import pytest

from usp.bench.attention import AttentionBench, Row, parse_layouts
from usp.bench.attention_report import format_report, results
from tools.lab.deepspeed_ulysses import skip_reason


def test_settings_are_checked_before_launch():
    bench = AttentionBench(nprocs=4, heads=8, seq_len=1024, threads=1)
    assert bench.layouts == ((4, 1), (2, 2), (1, 4)) and bench.kv_heads == 8
    assert skip_reason(bench) is None
    assert parse_layouts("4x1,2X2") == ((4, 1), (2, 2))
    with pytest.raises(ValueError, match="bad layout '4y1'"):
        parse_layouts("4y1")
    with pytest.raises(ValueError, match=r"layout 2x1 uses 2 of 4 processes.*ulysses x ring = 4"):
        AttentionBench(nprocs=4, layouts=((2, 1),), seq_len=1024)
    with pytest.raises(ValueError, match=r"sequence length 1004 .* use seq_len 1000 or 1008"):
        AttentionBench(nprocs=4, seq_len=1004)
    with pytest.raises(ValueError, match=r"bench.iters=0 must be >= 1"):
        AttentionBench(iters=0, seq_len=1024)
    with pytest.raises(ValueError, match=r"bench.dtype='fp8'"):
        AttentionBench(dtype="fp8", seq_len=1024)
    gqa = AttentionBench(nprocs=4, heads=8, kv_heads=2, seq_len=1024, threads=1)
    assert "KV heads (2) divisible by its degree 4" in skip_reason(gqa)


def test_results_and_report_from_measured_rows():
    bench = AttentionBench(nprocs=4, seq_len=1024, iters=3, threads=1)
    ds = Row("deepspeed u=4", "peer", 4, 1, [20.0, 10.0, 30.0], 0.0)
    pure = Row("usp u=4 r=1", "usp", 4, 1, [9.0, 12.0, 36.0], 0.0)
    ring = Row("usp u=1 r=4", "usp", 1, 4, [40.0, 40.0, 40.0], 3e-6)
    res = results(bench, [ds, pure, ring], None)
    assert [r["name"] for r in res["rows"]] == ["deepspeed u=4", "usp u=4 r=1", "usp u=1 r=4"]
    assert res["rows"][2]["ratio_to_peer"] == pytest.approx(2.0)
    ratios = res["usp_over_peer"]
    assert ratios["mean"] == pytest.approx(19.0 / 20.0)
    assert ratios["median"] == pytest.approx(12.0 / 20.0)
    assert ratios["min"] == pytest.approx(9.0 / 10.0)
    assert ratios["paired_median"] == pytest.approx(1.2)  # per round: 0.45, 1.2, 1.2
    text = format_report(res)
    assert "usp u=1 r=4" in text and "3.00e-06" in text and "2.000" in text
    assert "usp(u=4, c1) / deepspeed(u=4) = 0.950 (mean); 0.600 (median); 0.900 (min); 1.200 (median of" in text
    alone = results(bench, [pure, ring], "not asked for")
    assert alone["usp_over_peer"] is None and alone["rows"][0]["ratio_to_peer"] is None
    assert "no peer row (not asked for); no ratio" in format_report(alone)
